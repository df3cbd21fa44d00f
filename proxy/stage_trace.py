"""The proxy's side of the per-token stage clock (see `protocol/stage_trace.py`), used only
when the hidden setting `stage_trace` is on (`MLXD_STAGE_TRACE=DIR`): the engine client stamps
each token's arrival (`arrived`), a streaming route its handler, chunk and write
(`StreamTrace`); a request's records are written when its stream ends. Only the OpenAI routes
carry a `StreamTrace` (the benchmark's dialect); the other dialects' tokens keep their arrival
stamps only until the proxy forgets them with their request."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from aiohttp import web

from mlxd.protocol.messages import Delta
from mlxd.protocol.stage_trace import TokenTrace, TraceFile, flush_requests, now

_file: TraceFile | None = None
# (request id, token index) -> (received, decoded), until its route takes the delta
_arrivals: dict[tuple[str, int], tuple[int, int]] = {}


# when the request being handled had its headers read (`middleware`): its body's read and
# parse are what comes between this and its `proxy_in`
_http_in: ContextVar[int] = ContextVar("http_in", default=0)


@web.middleware
async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Installed only while the clock is on: stamps each request's route as it begins."""
    _http_in.set(now())
    return await handler(request)


def http_in() -> int:
    """The `http_in` stamp of the request this task handles (0 outside a traced route)."""
    return _http_in.get()


def trace_file() -> TraceFile:
    global _file
    if _file is None:
        _file = TraceFile("proxy")
    return _file


def arrived(deltas: list[Delta], received: int) -> None:
    decoded = now()
    if len(_arrivals) > 100_000:  # tokens of dialects that never take them: forget them
        _arrivals.clear()
    for d in deltas:
        if d.token_ids:
            _arrivals[(d.request_id, d.completion_tokens)] = (received, decoded)


class StreamTrace:
    """One streamed response: its tokens' stamps until the write that carries them."""

    def __init__(self) -> None:
        self._open: list[tuple[Delta, dict[str, int], int]] = []
        self._rids: set[str] = set()

    def handler(self, d: Delta) -> dict[str, int] | None:
        got = _arrivals.pop((d.request_id, d.completion_tokens), None) if d.token_ids else None
        if got is None:
            return None
        self._rids.add(d.request_id)
        return {"received": got[0], "decoded": got[1], "handler": now()}

    def built(self, d: Delta, stamps: dict[str, int] | None, chars: int) -> None:
        if stamps is not None:
            stamps["chunk_built"] = now()
            self._open.append((d, stamps, chars))

    def written(self) -> None:
        t = now()
        f = trace_file()
        for d, stamps, chars in self._open:
            stamps["written"] = t
            f.add(TokenTrace(d.request_id, d.completion_tokens, stamps, chars=chars))
        self._open.clear()

    def close(self) -> None:
        for rid in self._rids:  # tokens that never reached a write
            for key in [k for k in _arrivals if k[0] == rid]:
                del _arrivals[key]
        trace_file().flush()
        flush_requests()
