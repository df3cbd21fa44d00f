"""Logging for every mlxd process: one line per event, in one format, each line naming the
process it comes from (`supervisor`, `proxy#0`, `engine:MODEL#1`, `storage#0`; `mlxd` for the
one-process server).

    text: 2026-12-01 03:00:00.123 proxy#0 INFO listening on http://127.0.0.1:8080
    json: {"time": "2026-12-01T03:00:00.123+00:00", "level": "INFO", "process": "proxy#0",
           "pid": 4242, "message": "listening on http://127.0.0.1:8080"}

A `Record` is one event; `render` writes it in either format and `parse` reads either back, so
the supervisor can forward a child's lines in the daemon's format whatever the child wrote
(a formatted record, or raw output such as a stack dump, which it wraps in a record of its own).
Long work reports progress as records with a `Progress`; a `Console` whose stream is a terminal
draws them as one bar updated in place, and writes the final one as an ordinary line.

Every record is bounded at the source: a message longer than MESSAGE_CAP characters keeps its
head and tail, and so does each line of a traceback, so a client's string (a 100,000-character
model name, a huge prompt in an exception) never becomes a log line that a reader chokes on.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from types import TracebackType
from typing import Literal, TextIO

MESSAGE_CAP = 4096  # characters of one record's message
TRACEBACK_LINE_CAP = 1024  # characters of one line of a traceback or stack
TRACEBACK_CAP = 16384  # characters of a whole traceback
BAR_WIDTH = 24  # characters of a progress bar's track
PROGRESS_INTERVAL_S = 0.5  # a task shorter than this logs no progress; else one record per
PLAIN_PROGRESS_S = 5.0  # where no bar can be drawn: one progress line per task this often

LogFormat = Literal["text", "json"]
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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


def process_name(role: str, epoch: int, model_id: str = "") -> str:
    """How a child names itself in the logs: `proxy#0`, `engine:MODEL#1`, `storage#0`."""
    return f"{role}:{model_id}#{epoch}" if role == "engine" else f"{role}#{epoch}"


# ---------------------------------------------------------------- records: render and parse

@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    unit: str

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total > 0 else 0.0

    @property
    def finished(self) -> bool:
        return self.total > 0 and self.done >= self.total


@dataclass(frozen=True)
class Record:
    time: float  # seconds since the epoch
    process: str
    pid: int
    level: str
    message: str  # for a progress record: the task ("converting X")
    progress: Progress | None = None

    @property
    def text(self) -> str:
        """The message as a person reads it (a progress record says how far it is)."""
        p = self.progress
        if p is None:
            return self.message
        return f"{self.message}: {p.fraction:.0%} ({p.done}/{p.total} {p.unit})"


_TEXT_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (\S+) "
                        r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)\Z", re.S)
_PROGRESS_TEXT = re.compile(r"(.*): \d+% \((\d+)/(\d+) ([^)]*)\)\Z", re.S)
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _text_time(t: float) -> str:
    return time.strftime(_TIME_FORMAT, time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def render(rec: Record, fmt: LogFormat) -> str:
    """One line for json; for text one line, unless the message itself has several (a
    traceback), which follow it as they are."""
    if fmt == "json":
        obj: dict = {"time": datetime.fromtimestamp(rec.time).astimezone().isoformat(
                         timespec="milliseconds"),
                     "level": rec.level, "process": rec.process, "pid": rec.pid,
                     "message": rec.message}
        if rec.progress is not None:
            p = rec.progress
            obj["progress"] = {"done": p.done, "total": p.total, "unit": p.unit}
        return json.dumps(obj, ensure_ascii=False)
    return f"{_text_time(rec.time)} {rec.process} {rec.level} {rec.text}"


def parse(line: str, pid: int = 0) -> Record | None:
    """A line `render` wrote (either format), or None for anything else. A text line does not
    carry the pid: `pid` is used."""
    if line.startswith("{"):
        try:
            obj = json.loads(line)
            t = datetime.fromisoformat(obj["time"]).timestamp()
            p = obj.get("progress")
            return Record(t, str(obj["process"]), int(obj.get("pid") or pid), str(obj["level"]),
                          str(obj["message"]),
                          Progress(int(p["done"]), int(p["total"]), str(p["unit"]))
                          if isinstance(p, dict) else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
    m = _TEXT_LINE.match(line)
    if m is None:
        return None
    stamp, process, level, message = m.groups()
    t = time.mktime(time.strptime(stamp[:-4], _TIME_FORMAT)) + int(stamp[-3:]) / 1000
    progress = None
    if (pm := _PROGRESS_TEXT.match(message)) is not None:
        message = pm.group(1)
        progress = Progress(int(pm.group(2)), int(pm.group(3)), pm.group(4))
    return Record(t, process, pid, level, message, progress)


# ---------------------------------------------------------------- the console

class Console:
    """Where a process's log lines go (its stderr). A terminal gets progress as one bar
    redrawn in place (text format); anything else gets progress lines at most every
    PLAIN_PROGRESS_S per task, unless `forwarded` (a supervised child's stderr, which the
    supervisor reads: it decides). Thread-safe: the one-process server logs from several
    threads."""

    def __init__(self, stream: TextIO, fmt: LogFormat, tty: bool | None = None,
                 forwarded: bool = False) -> None:
        self.stream = stream
        self.fmt = fmt
        if tty is None:
            tty = not forwarded and _is_terminal(stream)
        self.bars = tty and fmt == "text"
        self.forwarded = forwarded
        self._lock = threading.Lock()
        self._bar_shown = False
        self._plain_progress: dict[tuple[str, str], float] = {}  # (process, task) -> when

    def write(self, rec: Record) -> None:
        with self._lock:
            p = rec.progress
            if p is not None and not p.finished:
                if self.bars:
                    self._out("\r\x1b[2K" + bar_line(rec))
                    self._bar_shown = True
                    return
                if not self.forwarded:
                    key, now = (rec.process, rec.message), time.monotonic()
                    if now - self._plain_progress.get(key, -PLAIN_PROGRESS_S) \
                            < PLAIN_PROGRESS_S:
                        return
                    self._plain_progress[key] = now
            if self._bar_shown:
                self._out("\r\x1b[2K")
                self._bar_shown = False
            self._out(render(rec, self.fmt) + "\n")

    def verdict(self, process: str, message: str) -> None:
        """The daemon's last words when it stops for a reason (a taken port): `mlxd: REASON`
        as a command's error in text, an ERROR record in json."""
        if self.fmt == "json":
            self.write(Record(time.time(), process, os.getpid(), "ERROR", message))
        else:
            with self._lock:
                if self._bar_shown:
                    self._out("\r\x1b[2K")
                    self._bar_shown = False
                self._out(f"mlxd: {message}\n")

    def _out(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr: logging must not kill us
            pass


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def bar_line(rec: Record) -> str:
    p = rec.progress
    assert p is not None
    filled = int(p.fraction * BAR_WIDTH)
    return (f"{_text_time(rec.time)} {rec.process} {rec.message} "
            f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {p.fraction:4.0%} "
            f"{p.done}/{p.total} {p.unit}")


class ChildLines:
    """A child's stderr, line by line, as records in the daemon's format: a line the child
    formatted is taken as it is (re-rendered if the child wrote the other format); anything
    else (a stack dump, a library's warning) becomes a record of that child. A raw line takes
    the level of the child's last record (the lines of a traceback follow their record)."""

    def __init__(self, process: str, pid: int) -> None:
        self.process = process
        self.pid = pid
        self._level = "INFO"

    def record(self, line: str, error_line: bool = False) -> Record:
        rec = parse(line, self.pid)
        if rec is not None:
            self._level = rec.level
            return rec if rec.pid else replace(rec, pid=self.pid)
        level = "ERROR" if error_line else self._level
        return Record(time.time(), self.process, self.pid, level, line)


# ---------------------------------------------------------------- logging set-up

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


class ConsoleHandler(logging.Handler):
    """Python logging into a Console: the message (with its traceback or stack, bounded)
    becomes a Record of this process."""

    def __init__(self, console: Console, process: str) -> None:
        super().__init__()
        self.console = console
        self.process = process
        self.setFormatter(BoundedFormatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            progress = getattr(record, "progress", None)
            self.console.write(Record(record.created, self.process, record.process or 0,
                                      record.levelname, message,
                                      progress if isinstance(progress, Progress) else None))
        except Exception:  # noqa: BLE001  logging's own contract: report, never raise
            self.handleError(record)


_console: Console | None = None


def console() -> Console:
    """This process's console (stderr, text) unless `setup_logging` chose another."""
    global _console
    if _console is None:
        _console = Console(sys.stderr, "text")
    return _console


def setup_logging(level: str, process: str, fmt: LogFormat = "text",
                  forwarded: bool = False) -> Console:
    global _console
    _console = Console(sys.stderr, fmt, forwarded=forwarded)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        handlers=[ConsoleHandler(_console, process)], force=True)
    return _console


def child_process_setup(level: str, process: str, fmt: LogFormat = "text") -> None:
    """For a supervised child: a Ctrl-C in the terminal reaches the whole process group, but
    only the supervisor decides how children stop; SIGABRT dumps every thread's stack."""
    setup_logging(level, process, fmt, forwarded=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(file=sys.stderr, all_threads=True)


class ProgressLog:
    """Progress of one task. Log records only when the task lasts: none in its first
    PROGRESS_INTERVAL_S, then at most one per interval, and the last one (a quick task logs
    none). `on_update` hears the first and last update, and the others at
    most once per interval (an engine's status carries it)."""

    def __init__(self, log: logging.Logger, task: str, total: int, unit: str,
                 on_update: Callable[[str, int, int, str], None] | None = None) -> None:
        self.log = log
        self.task = task
        self.total = max(total, 0)
        self.unit = unit
        self.on_update = on_update
        self._start: float | None = None
        self._told = self._logged = -1.0  # when on_update / the log last heard

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = now
        final = done >= self.total
        if self.on_update is not None and (final or self._told < 0
                                           or now - self._told >= PROGRESS_INTERVAL_S):
            self._told = now
            self.on_update(self.task, done, self.total, self.unit)
        lasted = now - self._start >= PROGRESS_INTERVAL_S
        due = lasted and (self._logged < 0 or now - self._logged >= PROGRESS_INTERVAL_S)
        if (final and (lasted or self._logged >= 0)) or (not final and due):
            self._logged = now
            self.log.info("%s", self.task,
                          extra={"progress": Progress(done, self.total, self.unit)})
