"""The aiohttp application and its listeners (loopback TCP and a Unix socket)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
from aiohttp import web

from mlxd.proxy import (admin_routes, anthropic_routes, metrics, ollama_routes, openai_routes,
                        security)
from mlxd.proxy.health import health
from mlxd.proxy.engine_client import EngineClient
from mlxd.proxy.router import Router
from mlxd.proxy.errors import error_middleware
from mlxd.proxy.generation import ResumeStats
from mlxd.proxy.openai_schema import Defaults


@dataclass
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    socket_path: Path | None = None
    max_body: int = 16 * 1024 * 1024
    max_header: int = 8190
    access: security.AccessSettings = field(default_factory=security.AccessSettings)


def make_app(client: EngineClient, router: Router, defaults: Defaults, listen: ListenSettings,
             shutdown_timeout: float = 15.0,
             request_stop: Callable[[], None] = lambda: None) -> web.Application:
    app = web.Application(client_max_size=listen.max_body, middlewares=[
        error_middleware, metrics.middleware, security.middleware(listen.access)])
    app.on_response_prepare.append(security.cors_signal(listen.access))
    app["client"] = client
    app["router"] = router
    app["defaults"] = defaults
    app["max_body"] = listen.max_body
    app["max_header"] = listen.max_header
    app["started"] = int(time.time())
    app["resume"] = False
    app["resume_stats"] = ResumeStats()
    app["shutdown_timeout"] = shutdown_timeout
    app["request_stop"] = request_stop
    metrics.install(app)
    openai_routes.add_routes(app)
    anthropic_routes.add_routes(app)
    ollama_routes.add_routes(app)
    admin_routes.add_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


async def stats(request: web.Request) -> web.Response:
    client: EngineClient = request.app["client"]
    engines = []
    for rec in client.engines.values():
        st = rec.status
        engines.append({
            "engine_id": rec.engine_id, "model": rec.model_id, "names": rec.names,
            "state": rec.state, "epoch": rec.epoch, "pid": st.pid if st else None,
            "active_requests": st.active if st else 0, "peak_batch": st.peak_batch if st else 0,
            "steps": st.steps if st else 0, "context_length": st.context_length if st else 0,
            "prompt_tokens_total": st.prompt_tokens_total if st else 0,
            "generated_tokens_total": st.generated_tokens_total if st else 0,
            "error": rec.error, "restarts": rec.child.restarts if rec.child else 0,
            "cache": msgspec.structs.asdict(st.stats) if st else {},
            "last_status_age_s": round(time.monotonic() - rec.last_seen, 3) if st else None})
    router: Router = request.app["router"]
    pool = None
    if router.pool is not None:
        pool = {"size": router.pool.size,
                "resident": [{"engine_id": r.engine_id, "in_flight": r.in_flight,
                              "idle_s": round(time.monotonic() - r.last_used, 1),
                              "pinned": r.pinned} for r in router.pool.resident.values()]}
    children = [msgspec.structs.asdict(c) for c in client.children]
    rs = request.app["resume_stats"]
    return web.json_response({"proxy": {"pid": os.getpid(), "in_flight": len(client.streams),
                                        "draining": router.draining,
                                        "uptime_s": int(time.time()) - request.app["started"],
                                        "resume": {"enabled": request.app["resume"],
                                                   **dataclasses.asdict(rs)}},
                              "engines": engines, "children": children, "pool": pool})


async def start_listeners(app: web.Application, listen: ListenSettings) -> tuple[web.AppRunner, str]:
    """Start TCP (and the Unix socket, mode 0600); return the runner and a description.
    An address that cannot be used raises ListenError naming it, with nothing left open."""
    from mlxd.proxy.listen_address import ListenError, claim_unix_path, describe_os_error, tcp_url
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           max_line_size=listen.max_header, max_field_size=listen.max_header)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, listen.host, listen.port).start()
        except OSError as e:  # socket.gaierror (a bad host name) included
            raise ListenError(f"cannot listen on {tcp_url(listen.host, listen.port)}: "
                              f"{describe_os_error(e)}") from None
        port = next(a[1] for a in runner.addresses if isinstance(a, tuple))  # real if 0 asked
        where = [tcp_url(listen.host, port)]
        if listen.socket_path is not None:
            path = listen.socket_path
            claim_unix_path(path)
            old = os.umask(0o177)
            try:
                await web.UnixSite(runner, str(path)).start()
            except OSError as e:
                raise ListenError(f"cannot listen on unix:{path}: {describe_os_error(e)}") \
                    from None
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            where.append(f"unix:{path}")
    except BaseException:
        await runner.cleanup()
        raise
    app["listening"] = {"port": port, "host": listen.host,
                        "socket": str(listen.socket_path) if listen.socket_path else None}
    return runner, " ".join(where)


def write_listen_file(run_dir: Path, app: web.Application) -> None:
    """Where clients (and `mlxd` client commands) find the running daemon."""
    tmp = run_dir / "listen.json.tmp"
    tmp.write_text(json.dumps({**app["listening"], "pid": os.getpid()}))
    os.replace(tmp, run_dir / "listen.json")
