"""One generation request from any API dialect: route it to an engine, run it, release the
engine. Dialect modules validate and translate their bodies first (bad input never reaches
the router), then format what `Generation` yields."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from aiohttp import web

from mlxd.protocol.messages import PROMPT_SIZE_SLACK, EngineStatus, Generate, SamplingParams
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


def check_prompt_fits(fields: dict[str, Any], status: EngineStatus | None) -> None:
    """A prompt that cannot fit the model's context, whatever the tokenizer makes of it, is
    refused here: it never reaches the engine to be tokenized."""
    if status is None or not status.context_length:
        return
    ctx = status.context_length
    ids = fields.get("prompt_token_ids")
    if ids is not None:
        if len(ids) >= ctx:
            raise bad_request(f"the prompt is {len(ids)} tokens, but this model's context is "
                              f"{ctx} tokens", code="context_length_exceeded", param="prompt")
        return
    if not status.max_token_bytes:
        return
    chars = len(fields.get("prompt") or "")
    for m in fields.get("messages") or ():
        content = m.get("content")
        chars += len(content) if isinstance(content, str) else 0
    if chars > ctx * status.max_token_bytes * PROMPT_SIZE_SLACK:
        raise bad_request(f"the prompt is {chars} characters, far more than this model's "
                          f"context of {ctx} tokens can hold", code="context_length_exceeded")


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
        check_prompt_fits(fields, engine.status)
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
