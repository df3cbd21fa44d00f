"""/admin/*: explicit model load, unload and crash-loop reset."""

from __future__ import annotations

import msgspec
from aiohttp import web

from mlxd.proxy.errors import bad_request
from mlxd.proxy.router import Router


class ModelBody(msgspec.Struct):
    model: str


async def _model(request: web.Request) -> str:
    try:
        return msgspec.json.decode(await request.read(), type=ModelBody).model
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise bad_request(f'expected {{"model": "..."}}: {e}') from e


async def load(request: web.Request) -> web.Response:
    router: Router = request.app["router"]
    rec = await router.load(await _model(request))
    return web.json_response({"model": rec.model_id, "state": rec.state})


async def unload(request: web.Request) -> web.Response:
    router: Router = request.app["router"]
    rec = await router.unload(await _model(request))
    return web.json_response({"model": rec.model_id, "state": "unloading"})


async def reset(request: web.Request) -> web.Response:
    router: Router = request.app["router"]
    rec = await router.reset(await _model(request))
    return web.json_response({"model": rec.model_id, "state": "resetting"})


async def flush_cache(request: web.Request) -> web.Response:
    """Returns once every queued KV write of every ready engine is durable."""
    import asyncio
    client = request.app["client"]
    ready = [r for r in client.engines.values() if r.state == "ready"]
    results = await asyncio.gather(*(client.flush(r, 120.0) for r in ready))
    engines = [{"model": r.model_id, "written": f.written, "failed": f.failed,
                "pending": f.pending, "error": f.error} for r, f in zip(ready, results)]
    return web.json_response({
        "written": sum(f.written for f in results), "failed": sum(f.failed for f in results),
        "pending": sum(f.pending for f in results), "engines": engines})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/cache/flush", flush_cache)
    app.router.add_post("/admin/models/load", load)
    app.router.add_post("/admin/models/unload", unload)
    app.router.add_post("/admin/models/reset", reset)
