"""`GET /health` (runs in the proxy): whether the daemon can serve, with every model's state
beside it.

- `ok` (200): the resident models are ready (or none is resident: a request loads one).
- `degraded` (200 while something can serve, else 503): a resident model failed, is restarting
  or stopped reporting; or the SSD tier cannot write. Other models keep serving.
- `loading` (503): nothing can serve yet, but a model is on its way.
- `draining` (503): shutting down or paused by /admin/drain.

An evicted or unloaded model is `unloaded`, never a fault: the pool works as designed.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mlxd.proxy.state import STATE

LOADING = ("starting", "loading")
FAULTS = ("backoff", "failed", "unresponsive", "stopping", "stopped")


def verdict(models: dict[str, str], draining: bool, ssd_problem: str | None = None
            ) -> tuple[str, int]:
    """(status, HTTP code) from resident models' states (pure)."""
    if draining:
        return "draining", 503
    states = list(models.values())
    can_serve = not states or "ready" in states
    if not can_serve and any(s in LOADING for s in states):
        return "loading", 503
    if any(s in FAULTS for s in states) or ssd_problem:
        return "degraded", 200 if can_serve else 503
    return "ok", 200


async def health(request: web.Request) -> web.Response:
    proxy = request.app[STATE]
    client, router = proxy.client, proxy.router
    resident = router.pool.resident if router.pool is not None else client.engines
    models: dict[str, str] = {}
    listed: dict[str, Any] = {}
    ssd_problem = None
    for rec in client.engines.values():
        if rec.engine_id in resident:
            models[rec.model_id] = rec.state
            stats = rec.status.stats if rec.status else None
            if stats is not None and stats.ssd_state == "degraded":
                ssd_problem = f"{rec.model_id}: SSD tier degraded: {stats.ssd_reason}"
        else:
            listed[rec.model_id] = "failed" if rec.state == "failed" else "unloaded"
    status, code = verdict(models, router.draining, ssd_problem)
    body: dict[str, Any] = {"status": status, "models": {**listed, **models}}
    if ssd_problem:
        body["ssd"] = ssd_problem
    return web.json_response(body, status=code)
