"""Running one request on an engine: deltas in, errors mapped to the API's error envelope."""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

from mlxd.protocol.messages import Delta, Generate
from mlxd.proxy.engine_client import EngineClient, EngineGone, EngineRecord, RequestStream
from mlxd.proxy.errors import APIError, bad_request, unavailable

# Engine error codes that mean the client's request was at fault.
CLIENT_ERROR_CODES = {"context_length_exceeded", "empty_prompt", "invalid_messages",
                      "invalid_token", "invalid_request"}


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _delta_error(d: Delta) -> APIError:
    if d.error_code in CLIENT_ERROR_CODES:
        return bad_request(d.error or "invalid request", code=d.error_code)
    if d.error_code == "engine_loading":
        return unavailable(d.error or "loading", "engine_loading", retry_after=5)
    if d.error_code == "engine_crashed":
        return unavailable(d.error or "the engine crashed", "engine_crashed", retry_after=2)
    return APIError(500, d.error or "the engine failed this request", type="server_error",
                    code=d.error_code or "engine_error")


class Generation:
    """One request's run. `start()` returns once the engine admitted it (errors raised there
    happen before any byte is sent); then iterate `deltas()`."""

    def __init__(self, client: EngineClient, engine: EngineRecord, msg: Generate) -> None:
        self.client = client
        self.engine = engine
        self.msg = msg
        self.stream: RequestStream | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    async def start(self) -> None:
        try:
            self.stream = await self.client.submit(self.engine, self.msg)
        except EngineGone as e:
            raise unavailable(str(e), "engine_unavailable") from e
        first = await self._next()
        if first.finish_reason == "error":
            raise _delta_error(first)
        self.prompt_tokens = first.prompt_tokens
        self._pending: Delta | None = first if (first.text or first.finish_reason) else None

    async def _next(self) -> Delta:
        assert self.stream is not None
        while True:
            try:
                return await asyncio.wait_for(self.stream.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if not self.client.alive(self.stream):
                    self.stream.finished = True
                    self.client.streams.pop(self.stream.request_id, None)
                    raise unavailable(f"the engine serving {self.engine.model_id} crashed "
                                      "while running this request", "engine_crashed") from None

    async def deltas(self) -> AsyncIterator[Delta]:
        assert self.stream is not None
        d = self._pending
        self._pending = None
        while True:
            if d is None:
                d = await self._next()
            if d.finish_reason == "error":
                raise _delta_error(d)
            self.completion_tokens = d.completion_tokens or self.completion_tokens
            self.prompt_tokens = d.prompt_tokens or self.prompt_tokens
            self.cached_tokens = d.cached_tokens or self.cached_tokens
            self.stream.delivered_token_ids.extend(d.token_ids)
            self.stream.delivered_text.append(d.text)
            yield d
            if d.finish_reason is not None:
                return
            d = None

    async def close(self) -> None:
        if self.stream is not None and not self.stream.finished:
            await self.client.abort(self.stream)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
