"""/admin/* (runs in the proxy): model load, unload and crash-loop reset; cache flush; drain and
shutdown. Served on the Unix socket, or on TCP with the API key (see security.py)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from mlxd.proxy import lifecycle
from mlxd.proxy.bounds import ModelName, Seconds, decode_body
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.lifecycle import flush_all
from mlxd.proxy.state import STATE


class ModelBody(msgspec.Struct):
    model: ModelName


async def _model(request: web.Request) -> str:
    try:
        return decode_body(await request.read(), ModelBody).model
    except APIError as e:
        raise bad_request(f'expected {{"model": "..."}}: {e.message}', param=e.param) from e


async def load(request: web.Request) -> web.Response:
    rec = await request.app[STATE].router.load(await _model(request))
    return web.json_response({"model": rec.model_id, "state": rec.state})


async def unload(request: web.Request) -> web.Response:
    rec = await request.app[STATE].router.unload(await _model(request))
    return web.json_response({"model": rec.model_id, "state": "unloading"})


async def reset(request: web.Request) -> web.Response:
    rec = await request.app[STATE].router.reset(await _model(request))
    return web.json_response({"model": rec.model_id, "state": "resetting"})


async def flush_cache(request: web.Request) -> web.Response:
    """Returns once every queued KV write of every ready engine is durable (200), or promptly
    with 507 (the disk refused: full, read-only, gone) or 503 (timed out, no answer) and the
    counts, `error` and each engine's `error_code`."""
    result = await flush_all(request.app[STATE].client)
    status = lifecycle.flush_status(result)
    return web.json_response(result, status=status,
                             headers={"Retry-After": "5"} if status == 503 else None)


class DrainBody(msgspec.Struct, forbid_unknown_fields=True):
    timeout: Seconds | None = None


async def drain(request: web.Request) -> web.Response:
    """Stop taking requests, wait for the running ones (then abort them), flush; answers when
    drained. The daemon keeps running, refusing new work with 503 until /admin/undrain."""
    raw = await request.read()
    try:
        body = decode_body(raw, DrainBody) if raw.strip() else DrainBody()
    except APIError as e:
        raise bad_request(f'expected {{"timeout": seconds}} or no body: {e.message}',
                          param=e.param) from e
    if body.timeout is not None and body.timeout < 0:
        raise bad_request("timeout must be >= 0", param="timeout")
    state = request.app[STATE]
    timeout = state.shutdown_timeout if body.timeout is None else body.timeout
    return web.json_response(await lifecycle.drain(state, timeout, flush=True))


async def undrain(request: web.Request) -> web.Response:
    request.app[STATE].router.draining = False
    return web.json_response({"draining": False})


async def shutdown(request: web.Request) -> web.Response:
    """Stop the daemon as SIGTERM would (drain, flush, exit 0)."""
    request.app[STATE].request_stop()
    return web.json_response({"stopping": True}, status=202)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/cache/flush", flush_cache)
    app.router.add_post("/admin/models/load", load)
    app.router.add_post("/admin/models/unload", unload)
    app.router.add_post("/admin/models/reset", reset)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/undrain", undrain)
    app.router.add_post("/admin/shutdown", shutdown)
