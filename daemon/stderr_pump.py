"""Draining a child's stderr. Whatever a child writes (a megabyte without a newline, binary,
a stack dump), its pipe is read to EOF, so the child can never block in a write to it.

`LineSplitter` is the pure part: bytes in, lines out, each line at most `cap` bytes (head and
tail kept, the cut said). `drain` reads the pipe in chunks (no `readline`, whose limit raises)
and survives anything its line callback does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

LINE_CAP = 8192  # bytes of one forwarded line
TAIL = 1024  # bytes kept from the end of a line that is cut
CHUNK = 65536

log = logging.getLogger("mlxd.supervisor")


class LineSplitter:
    def __init__(self, cap: int = LINE_CAP, tail: int = TAIL) -> None:
        assert 0 < tail < cap
        self._head_cap = cap - tail
        self._tail_cap = tail
        self._head = bytearray()
        self._tail = bytearray()
        self._cut = 0

    def feed(self, data: bytes) -> list[str]:
        """The lines that `data` completes."""
        *complete, rest = data.split(b"\n")
        lines = []
        for piece in complete:
            self._add(piece)
            lines.append(self._take())
        self._add(rest)
        return lines

    def close(self) -> list[str]:
        """At EOF: the last line, if it had no newline."""
        if not self._head and not self._tail:
            return []
        return [self._take()]

    def _add(self, piece: bytes) -> None:
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += piece[:room]
            piece = piece[room:]
        if piece:
            self._tail += piece
            extra = len(self._tail) - self._tail_cap
            if extra > 0:
                self._cut += extra
                del self._tail[:extra]

    def _take(self) -> str:
        head = self._head.decode(errors="replace")
        tail = self._tail.decode(errors="replace")
        line = (f"{head} ... [{self._cut} bytes cut] ... {tail}" if self._cut
                else head + tail).rstrip("\r")
        self._head, self._tail, self._cut = bytearray(), bytearray(), 0
        return line


async def drain(read_fd: int, on_line: Callable[[str], None], what: str) -> None:
    """Read the pipe `read_fd` (ours to close) until EOF, handing each line to `on_line`.

    An exception from `on_line` is logged and draining goes on; only a pipe that cannot be
    read any more (EOF, or an error that the reader would raise for ever) ends it.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=CHUNK)
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        pipe.close()
        raise
    splitter = LineSplitter()
    try:
        while True:
            try:
                chunk = await reader.read(CHUNK)
            except asyncio.CancelledError:
                raise
            except Exception:  # the pipe itself broke: nothing more to drain
                log.exception("reading the stderr of %s failed", what)
                chunk = b""
            for line in splitter.feed(chunk) if chunk else splitter.close():
                try:
                    on_line(line)
                except Exception:  # that line is lost, the pipe still drains
                    log.exception("forwarding a line of %s's stderr failed", what)
            if not chunk:
                return
    finally:
        transport.close()
