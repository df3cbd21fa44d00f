"""Logging set-up shared by every mlxd process: each line names its role, model and epoch.

Every record is bounded at the source: a message longer than MESSAGE_CAP characters keeps its
head and tail, and so does each line of a traceback, so a client's string (a 100,000-character
model name, a huge prompt in an exception) never becomes a log line that a reader chokes on.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
from types import TracebackType

MESSAGE_CAP = 4096  # characters of one record's message
TRACEBACK_LINE_CAP = 1024  # characters of one line of a traceback or stack
TRACEBACK_CAP = 16384  # characters of a whole traceback


def shorten(text: str, limit: int) -> str:
    """`text` if it fits in `limit` characters, else its head and tail with the cut said."""
    if len(text) <= limit:
        return text
    note = f" ... [{len(text) - limit} characters cut] ... "
    keep = max(limit - len(note), 2)
    head = keep * 3 // 4
    return text[:head] + note + text[len(text) - (keep - head):]


def _shorten_lines(text: str) -> str:
    return shorten("\n".join(shorten(line, TRACEBACK_LINE_CAP) for line in text.split("\n")),
                   TRACEBACK_CAP)


ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


class BoundedFormatter(logging.Formatter):
    """A Formatter whose every record is bounded: message, traceback and stack alike."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = shorten(record.message, MESSAGE_CAP)
        return super().formatMessage(record)

    def formatException(self, ei: ExcInfo) -> str:
        return _shorten_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _shorten_lines(super().formatStack(stack_info))


def setup_logging(level: str, tag: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(BoundedFormatter(f"%(asctime)s {tag}[%(process)d] %(levelname)s "
                                          f"%(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        handlers=[handler], force=True)


def child_process_setup(level: str, tag: str) -> None:
    """For a supervised child: a Ctrl-C in the terminal reaches the whole process group, but
    only the supervisor decides how children stop; SIGABRT dumps every thread's stack."""
    setup_logging(level, tag)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(file=sys.stderr, all_threads=True)
