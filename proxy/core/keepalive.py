"""Keep-alives for streams that have nothing to send yet: a long prompt prefilling (tens of
seconds to minutes on slow hardware or long agent contexts) would otherwise leave a client
with no byte for longer than its read timeout, and many clients then disconnect and send the
same request again. Runs in the proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def with_pings(items: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """`items` as they come, and None whenever `every` seconds pass without one (`every` 0:
    never). The wait for the next item is never cancelled by a ping: the same pending
    `anext` is awaited again."""
    if every <= 0:
        async for item in items:
            yield item
        return
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
