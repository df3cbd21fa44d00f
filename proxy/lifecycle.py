"""Draining: stop taking requests, let the running ones finish (up to a deadline, then abort
them with code `shutdown`), and make the KV cache durable. Used on SIGTERM and by
`POST /admin/drain`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from mlxd.proxy.engine_client import EngineClient
from mlxd.proxy.router import Router

ABORT_MESSAGE = ("mlxd is shutting down and this request did not finish within the shutdown "
                 "timeout; it was aborted")


async def flush_all(client: EngineClient, timeout: float = 120.0) -> dict[str, Any]:
    """Every queued KV write of every ready engine made durable."""
    ready = [r for r in client.engines.values() if r.state == "ready"]
    results = await asyncio.gather(*(client.flush(r, timeout) for r in ready))
    engines = [{"model": r.model_id, "written": f.written, "failed": f.failed,
                "pending": f.pending, "error": f.error} for r, f in zip(ready, results)]
    return {"written": sum(f.written for f in results), "failed": sum(f.failed for f in results),
            "pending": sum(f.pending for f in results), "engines": engines}


async def drain(app: web.Application, timeout: float, flush: bool) -> dict[str, Any]:
    router: Router = app["router"]
    client: EngineClient = app["client"]
    router.draining = True
    started = time.monotonic()
    in_flight = router.active
    finished = await router.wait_none_active(timeout)
    aborted = 0
    if not finished:
        aborted = await client.abort_everything(ABORT_MESSAGE)
        await router.wait_none_active(5.0)  # handlers write their error events and return
    result: dict[str, Any] = {"drained": True, "in_flight_at_start": in_flight,
                              "aborted": aborted,
                              "waited_s": round(time.monotonic() - started, 3)}
    if flush:
        result["flushed"] = await flush_all(client)
    return result
