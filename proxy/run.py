"""One generation request from any API dialect: route it to an engine, run it, release the
engine. Dialect modules validate and translate their bodies first (bad input never reaches
the router), then format what `Generation` yields."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from aiohttp import web

from mlxd.protocol.messages import Generate, SamplingParams
from mlxd.proxy.errors import bad_request
from mlxd.proxy.generation import Generation, new_request_id
from mlxd.proxy.model_pool import parse_keep_alive
from mlxd.proxy.openai_schema import check_max_tokens
from mlxd.proxy.router import Router


def keep_alive_seconds(raw: float | str | None) -> float | None:
    try:
        return parse_keep_alive(raw)
    except ValueError as e:
        raise bad_request(str(e), param="keep_alive") from e


@asynccontextmanager
async def generation(request: web.Request, model: str | None, params: SamplingParams,
                     keep_alive: float | None, explicit_max_tokens: int | None, prefix: str,
                     **fields: Any) -> AsyncIterator[Generation]:
    """A started Generation (the engine admitted the request: errors so far are HTTP
    statuses); the engine is released when the block exits, however it exits."""
    app = request.app
    router: Router = app["router"]
    engine = await router.acquire(model)
    gen = None
    try:
        check_max_tokens(explicit_max_tokens,
                         engine.status.context_length if engine.status else 0)
        gen = Generation(app["client"], engine,
                         Generate(request_id=new_request_id(prefix), sampling=params, **fields),
                         resume=app["resume"], load_wait=router.load_wait,
                         stats=app["resume_stats"],
                         metrics=None if fields.get("count_only") else app["metrics"])
        await gen.start()
        yield gen
    finally:
        if gen is not None:
            await gen.close()
        await router.release(engine, keep_alive)
