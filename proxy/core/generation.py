"""One generation, whatever the dialect (runs in the proxy): `started_generation` routes a
`GenerationRequest` to an engine, starts it and releases the engine however the block exits;
`Generation` is the run itself: deltas in, engine errors mapped to API errors, transparent
resume after an engine death. Dialects check and translate their bodies first (bad input never
reaches the router), then format what `Generation` yields."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec

from mlxd.protocol import stage_trace
from mlxd.protocol.messages import Delta, Generate, TokenLogprob
from mlxd.proxy import stage_trace as proxy_trace
from mlxd.proxy.core.images import ImageRef, check_image_count, decode_images
from mlxd.proxy.core.sampling import SEED_MASK, CheckedSampling
from mlxd.proxy.core.validation import check_prompt_fits
from mlxd.proxy.engines.client import EngineClient, EngineGone, EngineRecord, RequestStream
from mlxd.proxy.errors import APIError, bad_request, unavailable
from mlxd.proxy.metrics import RequestMetrics
from mlxd.proxy.state import ProxyState

# Engine error codes that mean the client's request was at fault.
CLIENT_ERROR_CODES = {"context_length_exceeded", "empty_prompt", "invalid_messages",
                      "invalid_token", "invalid_request", "image_too_large"}


log = logging.getLogger("mlxd.proxy")

RECONNECT_POLL = 0.1  # seconds between sends to an engine that is not reachable yet


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _delta_error(d: Delta) -> APIError:
    if d.error_code in CLIENT_ERROR_CODES:
        return bad_request(d.error or "invalid request", code=d.error_code)
    if d.error_code == "engine_loading":
        return unavailable(d.error or "loading", "engine_loading", retry_after=5)
    if d.error_code == "shutdown":
        return unavailable(d.error or "mlxd is shutting down", "shutdown", retry_after=10)
    if d.error_code == "engine_crashed":
        return unavailable(d.error or "the engine crashed", "engine_crashed", retry_after=2)
    return APIError(500, d.error or "the engine failed this request", type="server_error",
                    code=d.error_code or "engine_error")


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """A request in no dialect's words: which model, how to sample, and what to generate from
    (chat `messages`, or a `prompt` or its token ids), with optional grammar and tools."""
    model: str | None
    sampling: CheckedSampling
    id_prefix: str  # of the request id: "chatcmpl", "cmpl", "msg", "ollama", "count"
    keep_alive: float | None = None  # seconds the model stays loaded after; None: the default
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    grammar: str | None = None
    tools: list[dict] | None = None
    count_only: bool = False
    suffix: str | None = None  # fill-in-the-middle: the text after the hole
    echo_prompt: bool = False  # the admission notice carries the prompt's text
    images: tuple[ImageRef, ...] = ()  # image parts, in order (vision models)

    def engine_message(self, context_length: int) -> Generate:
        """The engine's `Generate`, under a new request id, for an engine with that context
        (an explicit max_tokens beyond it is refused here)."""
        return Generate(request_id=new_request_id(self.id_prefix),
                        sampling=self.sampling.params_for(context_length),
                        messages=self.messages, prompt=self.prompt,
                        prompt_token_ids=self.prompt_token_ids, count_only=self.count_only,
                        grammar=self.grammar, tools=self.tools, suffix=self.suffix,
                        echo_prompt=self.echo_prompt)


def group_messages(msg: Generate, n: int) -> list[Generate]:
    """n answers to one prompt: n requests of one prefill group, each with its own id and a
    seed of its own (greedy answers are alike anyway)."""
    if n == 1:
        return [msg]
    group = msg.request_id
    return [msgspec.structs.replace(
        msg, request_id=f"{group}-{i}", prefill_group=group, group_size=n,
        sampling=msgspec.structs.replace(msg.sampling,
                                         seed=(msg.sampling.seed + i) & SEED_MASK))
        for i in range(n)]


@asynccontextmanager
async def started_generation(state: ProxyState, req: GenerationRequest
                             ) -> AsyncIterator[Generation]:
    """A started Generation (the engine admitted the request: errors so far are HTTP
    statuses); the engine is released when the block exits, however it exits."""
    async with started_generations(state, req, 1) as gens:
        yield gens[0]


@asynccontextmanager
async def started_generations(state: ProxyState, req: GenerationRequest, n: int
                              ) -> AsyncIterator[list[Generation]]:
    """`n` started Generations of one request (OpenAI's `n`), on one engine, sharing one
    prefill there; each resumes on its own after an engine death."""
    router = state.router
    traced_at = stage_trace.now() if stage_trace.ON else 0
    if req.messages and state.volatile.pattern is not None:
        req = dataclasses.replace(req, messages=state.volatile.scrub(req.messages))
    if req.images:
        check_image_count(req.images)
    began = time.perf_counter_ns()
    was_ready = _ready(state, req.model)
    engine = await router.acquire(req.model)
    load_ns = 0 if was_ready else time.perf_counter_ns() - began
    gens: list[Generation] = []
    try:
        msg = req.engine_message(engine.status.context_length if engine.status else 0)
        adapter = router.adapter_of(req.model)
        if adapter:  # a LoRA adapter's name: the base's engine runs it on this request's rows
            msg = msgspec.structs.replace(msg, adapter=adapter)
        if req.images:  # what the model can take first: a text model never sees them decoded
            if "vision" not in (engine.status.capabilities if engine.status else []):
                raise bad_request(f"{engine.model_id} does not take images (mlxd serves it "
                                  "as a text model)", code="invalid_request")
            # a bad image is a 400 before the engine sees anything of the request
            images = await decode_images(list(req.images), state.allow_image_urls)
            msg = msgspec.structs.replace(msg, images=images)
        check_prompt_fits(msg, engine.status)
        for one in group_messages(msg, n):
            if traced_at:
                if began := proxy_trace.http_in():
                    stage_trace.stamp_request(one.request_id, "http_in", "proxy", at=began)
                stage_trace.stamp_request(one.request_id, "proxy_in", "proxy", at=traced_at)
            gens.append(Generation(state.client, engine, one, resume=state.resume,
                                   load_wait=router.load_wait, stats=state.resume_stats,
                                   metrics=None if req.count_only else state.metrics,
                                   load_ns=load_ns))
        if len(gens) == 1:  # sent before this loop turns to the next request: no task
            await gens[0].start()  # (in a burst, each engine gets its requests as they come)
        else:
            started = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
            for outcome in started:
                if isinstance(outcome, BaseException):
                    raise outcome
        yield gens
    finally:
        for gen in gens:
            await gen.close()
        await router.release(engine, req.keep_alive)


def _ready(state: ProxyState, name: str | None) -> bool:
    """Whether the engine a request names is resident and ready (else acquiring it waits
    for a load, which Ollama reports as `load_duration`)."""
    try:
        _, eid = state.router.resolve(name)
    except APIError:
        return False  # acquire says why
    rec, pool = state.client.engines.get(eid), state.router.pool
    return rec is not None and rec.state == "ready" and (pool is None or eid in pool.resident)


@dataclass
class Collected:
    """A whole (non-streamed) answer, gathered from its deltas."""
    text: str
    reasoning: str
    tool_calls: list[dict]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_sequence: str | None


@dataclass
class ResumeStats:
    resumes: int = 0
    resumed_tokens: int = 0  # tokens delivered before a crash and kept
    recomputed_tokens: int = 0  # prompt + delivered tokens the new engine had to prefill
    poison_rejections: int = 0


class Generation:
    """One request's run. `start()` returns once the engine admitted it (errors raised there
    happen before any byte is sent); then iterate `deltas()`. If the engine dies, the request
    is re-sent to its restarted engine with the token IDs already delivered, and the client
    only sees a pause (transparent resume). A request that was running during two engine
    deaths with no token delivered in between is failed as poison: it is what kills them; one
    that made progress between two deaths has not shown itself to be the cause."""

    MAX_FRUITLESS_CRASHES = 2
    MAX_DROPS = 3  # engine-side aborts of a request this proxy still reads, re-sent each time

    def __init__(self, client: EngineClient, engine: EngineRecord, msg: Generate,
                 resume: bool = False, load_wait: float = 120.0,
                 stats: ResumeStats | None = None, metrics: RequestMetrics | None = None,
                 load_ns: int = 0) -> None:
        self.client = client
        self.metrics = metrics
        self._t_last = time.monotonic()
        self._seen_token = False
        self.engine = engine
        self.msg = msg
        self.resume = resume
        self.load_wait = load_wait
        self.stats = stats or ResumeStats()
        self.stream: RequestStream | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.crashes = 0  # engine deaths during this request
        self.fruitless_crashes = 0  # deaths since the last one after which tokens arrived
        self.drops = 0
        self._delivered_at_crash = 0
        self.recovered_tokens = 0
        self.delivered_ids: list[int] = []
        self.delivered_chars = 0
        self._pending: Delta | None = None
        self._resumed_prompt: int | None = None  # tokens to prefill after the last resume
        self.prompt_text = ""  # the prompt as text, when the request asked (`echo_prompt`)
        # perf_counter_ns stamps, for Ollama's durations: the model load this request waited
        # for (0: none), when it went to the engine, its first and its last token
        self.load_ns = load_ns
        self.sent_ns = 0
        self.first_token_ns = 0
        self.last_token_ns = 0

    async def start(self) -> None:
        self.sent_ns = time.perf_counter_ns()
        first = await self._submit(self.msg)
        if self._dropped(first):
            return await self.start_resumed()
        if first.finish_reason == "error":
            if first.error_code == "engine_crashed" and await self._may_resume():
                return await self.start_resumed()
            raise _delta_error(first)
        self.prompt_tokens = first.prompt_tokens
        self.prompt_text = first.prompt_text
        self._pending = first if (first.text or first.finish_reason) else None

    async def start_resumed(self) -> None:
        """Re-send to the restarted engine with what the client already has."""
        while True:
            msg = msgspec.structs.replace(  # alone: its delivered tokens are its own
                self.msg, request_id=new_request_id("resume"), prefill_group="", group_size=1,
                resume_token_ids=list(self.delivered_ids), resume_text_len=self.delivered_chars)
            first = await self._submit(msg)
            if self._dropped(first):
                continue
            if first.finish_reason == "error":
                if first.error_code == "engine_crashed" and await self._may_resume():
                    continue
                raise _delta_error(first)
            self.stats.resumes += 1
            self.stats.resumed_tokens += len(self.delivered_ids)
            self.recovered_tokens += len(self.delivered_ids)
            self._pending = first if (first.text or first.finish_reason) else None
            self._resumed_prompt = first.prompt_tokens + len(self.delivered_ids)
            return

    def _dropped(self, d: Delta) -> bool:
        """An `abort` finish the client never asked for (this proxy aborts only requests whose
        client left): the engine dropped the request, e.g. an abort-all meant for a dead
        proxy's rows. It is re-sent with what was delivered, a few times, never shown as a
        finish reason no API has."""
        if d.finish_reason != "abort":
            return False
        self.drops += 1
        if self.drops > self.MAX_DROPS:
            raise unavailable(f"the engine serving {self.engine.model_id} dropped this request "
                              f"{self.drops} times", "engine_dropped", retry_after=2)
        log.warning("the engine dropped request %s; re-sending it", d.request_id)
        return True

    async def _submit(self, msg: Generate) -> Delta:
        """Send and wait for the admission notice. An engine that cannot be reached yet is
        dying (the supervisor will say so and restart it) or is still connecting to this
        proxy (after a proxy restart): sending is retried as its state changes, for up to
        --load-wait, so neither costs the client its request."""
        deadline = time.monotonic() + self.load_wait
        why = f"the engine serving {self.engine.model_id} is {self.engine.state}"
        while True:
            if self.engine.state == "ready":
                try:
                    if stage_trace.ON:
                        stage_trace.stamp_request(msg.request_id, "sending", "proxy", True)
                    return await self._send(msg)
                except EngineGone as e:
                    why = str(e)
            left = deadline - time.monotonic()
            if left <= 0 or self.engine.state == "failed" \
                    or self.client.engines.get(self.engine.engine_id) is not self.engine:
                raise unavailable(why, "engine_unavailable")
            await self.client.wait_change(self.engine, min(left, RECONNECT_POLL))

    async def _send(self, msg: Generate) -> Delta:
        """Send and wait for the first delta; images the engine holds go by their content
        hash alone (`SentImages`), and go whole if it answers that it does not hold them."""
        sent, eid, epoch = self.client.sent_images, self.engine.engine_id, self.engine.epoch
        slim = sent.slim(eid, epoch, msg.images, time.monotonic()) if msg.images else None
        self.stream = await self.client.submit(
            self.engine, msg if slim is None else msgspec.structs.replace(msg, images=slim))
        first = await self._next()
        if slim is not None and first.error_code == "image_unknown":
            sent.forget(eid, epoch, slim)
            self.stream = await self.client.submit(self.engine, msg)
            first = await self._next()
        if msg.images and first.finish_reason != "error":
            sent.sent(eid, epoch, msg.images, time.monotonic())
        return first

    async def _may_resume(self) -> bool:
        """After an engine death (crash, kill, or the hang watchdog's kill: one path): wait for
        its restart, unless resume is off or the request is poison."""
        assert self.stream is not None
        self.crashes += 1
        progressed = len(self.delivered_ids) > self._delivered_at_crash
        self.fruitless_crashes = 1 if progressed else self.fruitless_crashes + 1
        self._delivered_at_crash = len(self.delivered_ids)
        if not self.resume:
            return False
        if self.fruitless_crashes >= self.MAX_FRUITLESS_CRASHES:
            self.stats.poison_rejections += 1
            raise APIError(500, f"this request was running when the engine serving "
                           f"{self.engine.model_id} crashed {self.fruitless_crashes} times "
                           "without producing a token in between; it is not retried again",
                           type="server_error", code="request_poisoned")
        return await self.client.wait_serving(self.engine, self.stream.epoch, self.load_wait)

    async def _next(self) -> Delta:
        """The next delta. An engine death arrives here as an error delta, pushed by the
        supervisor's snapshot or by the client's stream watcher (no timer per token)."""
        assert self.stream is not None
        return await self.stream.queue.get()

    def pending(self) -> bool:
        """Whether a delta is already queued (a writer may batch it with this one)."""
        return self._pending is not None or (self.stream is not None
                                             and not self.stream.queue.empty())

    async def deltas(self) -> AsyncIterator[Delta]:
        assert self.stream is not None
        d = self._pending
        self._pending = None
        while True:
            if d is None:
                d = await self._next()
            if self._dropped(d):
                await self.start_resumed()
                d = self._pending
                self._pending = None
                continue
            if d.finish_reason == "error":
                if d.error_code == "engine_crashed" and await self._may_resume():
                    await self.start_resumed()
                    d = self._pending
                    self._pending = None
                    continue
                raise _delta_error(d)
            self.completion_tokens = d.completion_tokens or self.completion_tokens
            self.prompt_tokens = d.prompt_tokens or self.prompt_tokens
            if d.finish_reason is not None and self._resumed_prompt is not None:
                self.stats.recomputed_tokens += self._resumed_prompt - d.cached_tokens
                self._resumed_prompt = None
            elif not self.crashes:
                self.cached_tokens = d.cached_tokens or self.cached_tokens
            if self.metrics is not None:
                self._observe(d)
            if d.token_ids:
                self.last_token_ns = time.perf_counter_ns()
                self.first_token_ns = self.first_token_ns or self.last_token_ns
            self.delivered_ids.extend(d.token_ids)
            self.delivered_chars += len(d.text)
            yield d
            if d.finish_reason is not None:
                return
            d = None

    async def collect(self) -> Collected:
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        logprobs: list[TokenLogprob] = []
        last = None
        async for d in self.deltas():
            text.append(d.text)
            reasoning.append(d.reasoning)
            calls.extend(d.tool_calls or ())
            logprobs.extend(d.logprobs or ())
            last = d
        return Collected("".join(text), "".join(reasoning), calls, logprobs,
                         last.finish_reason if last else None,
                         last.stop_sequence if last else None)

    def _observe(self, d: Delta) -> None:
        assert self.metrics is not None
        now = time.monotonic()
        model = self.engine.model_id
        if d.token_ids:
            if not self._seen_token:
                self.metrics.first_token(model, now - self._t_last)
                self._seen_token = True
            else:
                self.metrics.tokens(model, len(d.token_ids), now - self._t_last)
            self._t_last = now
        if d.finish_reason is not None:
            self.metrics.finished(model, self.prompt_tokens, self.completion_tokens,
                                  self.cached_tokens)

    async def close(self) -> None:
        if self.stream is not None and not self.stream.finished:
            await self.client.abort(self.stream)

    def usage(self) -> dict:
        return usage([self])

    @property
    def model_name(self) -> str:
        """The model the answer names: the adapter's name for an adapter's request, else
        the engine's model id."""
        return self.msg.adapter or self.engine.model_id


def usage(gens: list[Generation]) -> dict:
    """OpenAI's usage of one request: its prompt once, the completions of all its answers."""
    first = gens[0]
    completion = sum(g.completion_tokens for g in gens)
    u: dict = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
               "total_tokens": first.prompt_tokens + completion,
               "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
    crashes = sum(g.crashes for g in gens)
    if crashes:
        u["resumes"] = crashes
        u["recovered_tokens"] = sum(g.recovered_tokens for g in gens)
    return u
