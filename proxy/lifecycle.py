"""Draining: stop taking requests, let the running ones finish (up to a deadline, then abort
them with code `shutdown`), and make the KV cache durable. Used on SIGTERM and by
`POST /admin/drain`. Runs in the proxy."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mlxd.proxy.engines.client import EngineClient
from mlxd.proxy.state import ProxyState

ABORT_MESSAGE = ("mlxd is shutting down and this request did not finish within the shutdown "
                 "timeout; it was aborted")


# Engine answers that mean "nothing to make durable", not a failure.
NOTHING_TO_FLUSH = frozenset({"ssd_off", "loading"})
# Codes that say the disk refused the writes: the cache cannot be stored (HTTP 507).
DISK_REFUSALS = frozenset({"disk_full", "read_only", "permission_denied", "gone", "io_error"})


async def flush_all(client: EngineClient, timeout: float = 120.0) -> dict[str, Any]:
    """Every queued KV write of every ready engine made durable, or why not: `durable` is
    false and `error` names the first engine's code and reason when any engine's cache is not
    durable; each engine's entry carries its own `error_code` and `error`."""
    ready = [r for r in client.engines.values() if r.state == "ready"]
    results = await asyncio.gather(*(client.flush(r, timeout) for r in ready))
    engines = []
    failures = []
    for r, f in zip(ready, results, strict=True):
        # EngineClient.flush's own fallback (no answer in time) carries a reason but no code
        code = f.error_code or ("no_answer" if f.error else None)
        engines.append({"model": r.model_id, "written": f.written, "failed": f.failed,
                        "pending": f.pending, "unwritten": f.unwritten, "error_code": code,
                        "error": f.error})
        if code is not None and code not in NOTHING_TO_FLUSH:
            failures.append((r.model_id, code, f.error))
    result: dict[str, Any] = {
        "durable": not failures,
        "written": sum(f.written for f in results), "failed": sum(f.failed for f in results),
        "pending": sum(f.pending for f in results), "engines": engines}
    if failures:
        model, code, reason = failures[0]
        result["error"] = {"message": f"the KV cache is not durable: {model}: {reason}",
                           "type": "server_error", "param": None, "code": code}
    return result


def flush_status(result: dict[str, Any]) -> int:
    """HTTP status for a flush result: 200 durable; 507 when a disk refused the writes;
    503 otherwise (timed out, no answer, the storage worker gone: worth retrying)."""
    if result["durable"]:
        return 200
    codes = {e["error_code"] for e in result["engines"]}
    return 507 if codes & DISK_REFUSALS else 503


async def drain(state: ProxyState, timeout: float, flush: bool) -> dict[str, Any]:
    router, client = state.router, state.client
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
