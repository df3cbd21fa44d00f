"""The requests this proxy is reading and checking: from their headers read to their hand-off
to an engine (or their answer, whichever comes first). Runs in the proxy's event loop.

An idle engine that gets a request waits a few milliseconds for a burst behind it
(`engine/batch/burst.py`), so that a chat app opening several conversations or an agent fanning
out gets them prefilled as one batch. A request that leaves the intake with no other request
in it has no burst behind it that this proxy knows of: it is sent `alone` and the engine starts
it at once instead of waiting out the quiet time (a lone chat message's first token, a few
milliseconds sooner). A request whose headers have not been read yet is not counted: a
burst's first request can be sent alone, and the rest then join the engine's next step."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from aiohttp import web

_open = 0  # requests in the intake now
_mine: ContextVar[list[bool] | None] = ContextVar("intake", default=None)


@web.middleware
async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    global _open
    flag = [True]  # this request is in the intake
    _mine.set(flag)
    _open += 1
    try:
        return await handler(request)
    finally:
        if flag[0]:
            _open -= 1


def leave() -> bool:
    """The request this task handles leaves the intake (it is about to be sent to an engine):
    whether it leaves it empty (no other request is being read or checked)."""
    global _open
    flag = _mine.get()
    if flag is not None and flag[0]:
        flag[0] = False
        _open -= 1
    return _open == 0


def in_intake() -> int:
    """Requests in the intake now (a figure for tests)."""
    return _open
