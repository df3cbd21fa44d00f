"""`GET /metrics` in Prometheus text format through prometheus-client (runs in the proxy).

The proxy sees every request, so request, latency and token figures are counted here. Engine,
cache-tier and child-process figures live in other processes: each scrape reads them from the
engines' latest status messages (sent every 0.5 s) and the supervisor's last child snapshot, so
one scrape of the proxy covers the whole daemon. Engine counters restart from zero when an
engine restarts (a counter reset, which Prometheus' rate() handles)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlxd.proxy.errors import APIError
from mlxd.proxy.state import STATE, ProxyState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5)
STATES = ("starting", "loading", "ready", "backoff", "failed", "stopping", "stopped")


class RequestMetrics:
    """Counters and histograms observed by the proxy's handlers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("mlxd_http_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=registry)
        self.ttft = Histogram("mlxd_time_to_first_token_seconds",
                              "From request admission to the first generated token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("mlxd_inter_token_latency_seconds",
                             "Between consecutive generated tokens of one request",
                             ["model"], buckets=ITL_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "Prompt tokens of finished requests",
                                     ["model"], registry=registry)
        self.completion_tokens = Counter("mlxd_completion_tokens",
                                         "Generated tokens of finished requests", ["model"],
                                         registry=registry)
        self.cached_tokens = Counter("mlxd_cached_prompt_tokens",
                                     "Prompt tokens served from the KV cache (any tier)",
                                     ["model"], registry=registry)
        self._itl_by_model: dict[str, Histogram] = {}

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model).observe(seconds)

    def tokens(self, model: str, n: int, gap: float) -> None:
        """`n` tokens arrived `gap` seconds after the previous ones."""
        if n > 0:
            per = gap / n
            hist = self._itl_by_model.get(model)
            if hist is None:  # `labels()` costs a lock and a tuple per call: once per model
                hist = self._itl_by_model[model] = self.itl.labels(model)
            for _ in range(n):
                hist.observe(per)

    def finished(self, model: str, prompt: int, completion: int, cached: int) -> None:
        self.prompt_tokens.labels(model).inc(prompt)
        self.completion_tokens.labels(model).inc(completion)
        self.cached_tokens.labels(model).inc(cached)


class DaemonCollector(Collector):
    """Figures read at scrape time from the engines' and the supervisor's reports."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def collect(self) -> Iterator:
        client, router = self.state.client, self.state.router
        state = GaugeMetricFamily("mlxd_engine_state", "1 for the state each engine is in",
                                  labels=["model", "engine_id", "state"])
        active = GaugeMetricFamily("mlxd_engine_active_requests", "Rows in the engine's batch",
                                   labels=["model"])
        cap = GaugeMetricFamily("mlxd_engine_batch_cap", "Rows the engine's KV budget "
                                "allows now (--batch auto or N)", labels=["model"])
        budget = GaugeMetricFamily("mlxd_engine_kv_budget_bytes", "Memory the engine may fill "
                                   "with KV cache (--batch auto; within its pool share)",
                                   labels=["model"])
        share = GaugeMetricFamily("mlxd_engine_memory_share", "The engine's fraction of the "
                                  "machine's memory (--model-pool N; 1 alone)", labels=["model"])
        waiting = GaugeMetricFamily("mlxd_engine_waiting_requests", "Requests the engine holds "
                                    "back until rows finish (KV budget)", labels=["model"])
        gen = CounterMetricFamily("mlxd_engine_generated_tokens", "Tokens generated by the "
                                  "engine in its current life", labels=["model"])
        hits = CounterMetricFamily("mlxd_cache_events", "KV cache lookups and evictions by tier",
                                   labels=["model", "tier", "event"])
        size = GaugeMetricFamily("mlxd_cache_bytes", "KV cache bytes held, by tier",
                                 labels=["model", "tier"])
        restored = CounterMetricFamily("mlxd_cache_restored_tokens",
                                       "Prompt tokens restored from SSD", labels=["model"])
        writes = CounterMetricFamily("mlxd_storage_writes", "KV blocks sent to the storage "
                                     "worker, by outcome", labels=["model", "outcome"])
        written = CounterMetricFamily("mlxd_storage_bytes_written", "Bytes of KV blocks written "
                                      "to SSD", labels=["model"])
        queue = GaugeMetricFamily("mlxd_storage_write_queue", "KV blocks waiting to be written",
                                  labels=["model"])
        spec = CounterMetricFamily("mlxd_speculative_tokens", "Speculative decoding: tokens "
                                   "drafted, accepted, and produced by speculative steps",
                                   labels=["model", "kind"])
        spec_steps = CounterMetricFamily("mlxd_speculative_steps", "Speculative steps (drafts "
                                         "verified in one forward pass)", labels=["model"])
        spec_rate = GaugeMetricFamily("mlxd_speculative_acceptance", "Accepted / drafted "
                                      "tokens in the engine's current life", labels=["model"])
        spec_per = GaugeMetricFamily("mlxd_speculative_tokens_per_step", "Tokens produced per "
                                     "speculative step in the engine's current life",
                                     labels=["model"])
        for rec in client.engines.values():
            m = rec.model_id
            for s in STATES:
                state.add_metric([m, rec.engine_id, s], 1.0 if rec.state == s else 0.0)
            st = rec.status
            if st is None:
                continue
            # an engine stopped (unloaded) or failed holds no rows, memory or share: its last
            # status is kept for its counters, not shown as what it holds now
            live = rec.state not in ("stopped", "failed")
            x = st.stats
            if live:
                active.add_metric([m], st.active)
                cap.add_metric([m], st.batch_cap)
                waiting.add_metric([m], st.waiting)
                budget.add_metric([m], x.kv_budget_bytes)
                share.add_metric([m], x.memory_share)
                size.add_metric([m, "ram"], x.ram_bytes)
            gen.add_metric([m], st.generated_tokens_total)
            if x.spec_mode:
                for kind, value in (("drafted", x.spec_drafted), ("accepted", x.spec_accepted),
                                    ("produced", x.spec_tokens)):
                    spec.add_metric([m, kind], value)
                spec_steps.add_metric([m], x.spec_steps)
                spec_rate.add_metric([m], x.spec_acceptance)
                spec_per.add_metric([m], x.spec_tokens_per_step)
            for tier, event, value in (
                    ("ram", "hits", x.ram_hits), ("ram", "misses", x.ram_misses),
                    ("ram", "evictions", x.ram_evictions),
                    ("ram", "superseded", x.ram_superseded), ("ssd", "hits", x.ssd_hits),
                    ("ssd", "misses", x.ssd_misses), ("ssd", "evictions", x.ssd_evicted)):
                if tier == "ram" or x.ssd_state != "off":
                    hits.add_metric([m, tier, event], value)
            if x.ssd_state != "off":
                size.add_metric([m, "ssd"], x.ssd_bytes)
                restored.add_metric([m], x.ssd_restored_tokens)
                for outcome, value in (("written", x.ssd_blocks_written),
                                       ("existed", x.ssd_blocks_existed),
                                       ("failed", x.ssd_write_failures),
                                       ("skipped", x.ssd_skipped_no_slot),
                                       ("skipped_degraded", x.ssd_skipped_degraded)):
                    writes.add_metric([m, outcome], value)
                written.add_metric([m], x.ssd_bytes_written)
                if live:
                    queue.add_metric([m], x.ssd_write_queue)
        yield from (state, active, cap, budget, share, waiting, gen, hits, size, restored, writes,
                    written, queue, spec, spec_steps, spec_rate, spec_per)

        restarts = CounterMetricFamily("mlxd_child_restarts", "Restarts of each supervised "
                                       "child process", labels=["role", "child_id"])
        child_state = GaugeMetricFamily("mlxd_child_state", "1 for the state each child is in",
                                        labels=["role", "child_id", "state"])
        for c in client.children:
            restarts.add_metric([c.role, c.child_id], c.restarts)
            for s in STATES:
                child_state.add_metric([c.role, c.child_id, s], 1.0 if c.state == s else 0.0)
        yield from (restarts, child_state)

        in_flight = GaugeMetricFamily("mlxd_requests_in_flight", "Requests being served")
        in_flight.add_metric([], router.active)
        waiting = GaugeMetricFamily("mlxd_pool_queue_depth",
                                    "Requests waiting for the model pool to free an engine")
        waiting.add_metric([], router.waiting)
        draining = GaugeMetricFamily("mlxd_draining", "1 while mlxd takes no new requests")
        draining.add_metric([], 1.0 if router.draining else 0.0)
        rs = self.state.resume_stats
        resumes = CounterMetricFamily("mlxd_resumes", "Requests resumed after an engine crash")
        resumes.add_metric([], rs.resumes)
        poison = CounterMetricFamily("mlxd_poison_rejections",
                                     "Requests failed after crashing their engine twice")
        poison.add_metric([], rs.poison_rejections)
        uptime = GaugeMetricFamily("mlxd_uptime_seconds", "Seconds since the proxy started")
        uptime.add_metric([], time.time() - self.state.started)
        yield from (in_flight, waiting, draining, resumes, poison, uptime)


def new_registry() -> CollectorRegistry:
    """A registry of this app's own (several apps may live in one process: the tests)."""
    disable_created_metrics()  # the *_created series only double the page
    return CollectorRegistry()


def install(app: web.Application) -> None:
    """`GET /metrics`, with the daemon-wide figures read from the app's state."""
    state = app[STATE]
    state.metrics_registry.register(DaemonCollector(state))
    app.router.add_get("/metrics", serve_metrics)


async def serve_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics_registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts every request once, with the status it got (errors included)."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except (web.HTTPException, APIError) as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        if route != "/metrics":
            request.app[STATE].metrics.requests.labels(route, request.method, str(status)).inc()
