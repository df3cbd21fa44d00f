"""The aiohttp application, its state and its listeners (loopback TCP and a Unix socket);
runs in the proxy."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from mlxd.protocol import stage_trace
from mlxd.protocol.listen_address import BACKLOG, adopt, listen_on, tcp_url
from mlxd.protocol.messages import EngineStats
from mlxd.proxy import admin_routes, metrics, model_routes, security
from mlxd.proxy import stage_trace as proxy_trace
from mlxd.proxy.core.generation import ResumeStats
from mlxd.proxy.core.sampling import Defaults
from mlxd.proxy.dialects.anthropic import routes as anthropic_routes
from mlxd.proxy.dialects.embeddings import routes as embedding_routes
from mlxd.proxy.dialects.ollama import routes as ollama_routes
from mlxd.proxy.dialects.openai import routes as openai_routes
from mlxd.proxy.dialects.rerank import routes as rerank_routes
from mlxd.proxy.dialects.responses import routes as responses_routes
from mlxd.proxy.engines.client import EngineClient
from mlxd.proxy.engines.router import Router
from mlxd.proxy.errors import error_middleware
from mlxd.proxy.health import health
from mlxd.proxy.state import STATE, ListeningAt, ProxyState


@dataclass
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    socket_path: Path | None = None
    max_body: int = 16 * 1024 * 1024
    max_header: int = 8190
    access: security.AccessSettings = field(default_factory=security.AccessSettings)


def make_app(client: EngineClient, router: Router, defaults: Defaults, listen: ListenSettings,
             *, resume: bool = False, shutdown_timeout: float = 15.0,
             request_stop: Callable[[], None] = lambda: None) -> web.Application:
    """The app with every route, its state under STATE. `client_max_size` is the body limit
    (the error middleware reads it from each request)."""
    traced = [proxy_trace.middleware] if stage_trace.ON else []
    app = web.Application(client_max_size=listen.max_body, middlewares=[
        *traced, error_middleware, metrics.middleware, security.middleware(listen.access)])
    app.on_response_prepare.append(security.cors_signal(listen.access))
    registry = metrics.new_registry()
    app[STATE] = ProxyState(client=client, router=router, defaults=defaults, listen=listen,
                            metrics=metrics.RequestMetrics(registry), metrics_registry=registry,
                            resume_stats=ResumeStats(), resume=resume,
                            shutdown_timeout=shutdown_timeout, request_stop=request_stop)
    metrics.install(app)
    openai_routes.add_routes(app)
    anthropic_routes.add_routes(app)
    ollama_routes.add_routes(app)
    embedding_routes.add_routes(app)
    rerank_routes.add_routes(app)
    responses_routes.add_routes(app)
    model_routes.add_routes(app)
    admin_routes.add_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


def cache_figures(stats: EngineStats) -> dict[str, Any]:
    """An engine's cache figures as `/stats` shows them: `ssd_state` "off", "ok", or
    "degraded: <code>: <why>; ..." (the wire's state and reason in one string)."""
    out = msgspec.structs.asdict(stats)
    reason = out.pop("ssd_reason")
    if stats.ssd_state == "degraded":
        out["ssd_state"] = f"degraded: {reason}"
    return out


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client = state.client
    engines = []
    for rec in client.engines.values():
        st = rec.status
        engines.append({
            "engine_id": rec.engine_id, "model": rec.model_id, "names": rec.names,
            "state": rec.state, "epoch": rec.epoch, "pid": st.pid if st else None,
            "active_requests": st.active if st else 0, "peak_batch": st.peak_batch if st else 0,
            "batch_cap": st.batch_cap if st else 0, "batch_why": st.batch_why if st else "",
            "waiting_requests": st.waiting if st else 0,
            "group": st.group if st else "", "group_pids": st.group_pids if st else [],
            "steps": st.steps if st else 0, "context_length": st.context_length if st else 0,
            "prompt_tokens_total": st.prompt_tokens_total if st else 0,
            "generated_tokens_total": st.generated_tokens_total if st else 0,
            "error": rec.error, "restarts": rec.child.restarts if rec.child else 0,
            "cache": cache_figures(st.stats) if st else {},
            "last_status_age_s": round(time.monotonic() - rec.last_seen, 3) if st else None})
    router = state.router
    pool = None
    if router.pool is not None:
        pool = {"size": router.pool.size,
                "resident": [{"engine_id": r.engine_id, "in_flight": r.in_flight,
                              "idle_s": round(time.monotonic() - r.last_used, 1),
                              "pinned": r.pinned} for r in router.pool.resident.values()]}
    children = [msgspec.structs.asdict(c) for c in client.children]
    return web.json_response({"proxy": {"pid": os.getpid(), "in_flight": len(client.streams),
                                        "draining": router.draining,
                                        "uptime_s": int(time.time()) - state.started,
                                        "volatile_lines": {
                                            "dropped": state.volatile.dropped,
                                            "requests": state.volatile.requests},
                                        "images": {
                                            "sent_by_hash": client.sent_images.by_hash,
                                            "sent_again_whole": client.sent_images.again},
                                        "resume": {"enabled": state.resume,
                                                   **dataclasses.asdict(state.resume_stats)}},
                              "engines": engines, "children": children, "pool": pool})


async def start_listeners(app: web.Application, inherited: list[int] | None = None
                          ) -> tuple[web.AppRunner, str]:
    """Serve on the listening sockets handed down by the supervisor (`inherited`
    descriptors), or open TCP (and the Unix socket, mode 0600) as the app's state asks; return
    the runner and a description. An address that cannot be used raises ListenError naming
    it, with nothing left open."""
    state = app[STATE]
    listen = state.listen
    listeners = adopt(inherited) if inherited else \
        listen_on(listen.host, listen.port, listen.socket_path)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           max_line_size=listen.max_header, max_field_size=listen.max_header)
    try:
        await runner.setup()
        for sock in listeners.sockets():
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
    except BaseException:
        await runner.cleanup()
        listeners.close()
        raise
    port = listeners.port
    where = [tcp_url(listen.host, port)]
    if listeners.unix is not None:
        where.append(f"unix:{listen.socket_path}")
    state.listening = ListeningAt(port, listen.host,
                                  str(listen.socket_path) if listen.socket_path else None)
    return runner, " ".join(where)


def write_listen_file(run_dir: Path, listening: ListeningAt) -> None:
    """Where clients (and `mlxd` client commands) find the running daemon."""
    tmp = run_dir / "listen.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**dataclasses.asdict(listening), "pid": os.getpid()}))
    os.replace(tmp, run_dir / "listen.json")
