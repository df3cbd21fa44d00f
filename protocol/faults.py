"""Named fault points for tests: a child exits, aborts, hangs or fails at an exact point.

Switched on by the hidden setting `faults` (`MLXD_FAULTS`), which every child gets in its
launch struct, e.g. `MLXD_FAULTS="engine.step=exit@20#0,engine.load=fail"`: at the 20th
step of epoch 0 the engine exits; every load fails. Syntax per entry:
`point=action[@nth][#epoch]`, where `#<N` means every epoch below N.
Actions: exit (os._exit(1)), abort (SIGABRT), kill (SIGKILL itself), hang (sleep forever),
fail (raise FaultInjected, at every hit from the nth), bug (raise a RuntimeError, which no
code expects: a bug), errno:NAME (raise OSError with that
errno, e.g. `storage.write=errno:ENOSPC`, at every hit from the nth: a full, read-only or
vanished disk without privileges), delay (sleep 50 ms at every hit from the nth: a slow
engine; `delay:MS` sleeps MS milliseconds instead: one slow piece of work), spew (write one
1 MiB line straight to stderr, past logging: a runaway child).
Unset, `hit()` is one dict lookup on an empty dict.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

SPEW_BYTES = 1 << 20

_faults: dict[str, tuple[str, int, int | None, bool]] = {}
_counts: dict[str, int] = {}
_epoch: int | None = None
_quiet = threading.local()  # .on: no fault fires or counts on this thread (`quiet()`)


class FaultInjected(Exception):
    pass


def configure(epoch: int | None, spec: str) -> None:
    global _epoch
    _epoch = epoch
    _faults.clear()
    _counts.clear()
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        point, _, rest = entry.partition("=")
        rest, _, ep = rest.partition("#")
        action, _, nth = rest.partition("@")
        below = ep.startswith("<")
        if action.startswith("errno:") and not isinstance(
                getattr(errno, action[len("errno:"):], None), int):
            raise ValueError(f"faults: {entry!r}: unknown errno name")
        if action.startswith("delay:") and not action[len("delay:"):].isdigit():
            raise ValueError(f"faults: {entry!r}: delay:MS takes whole milliseconds")
        _faults[point] = (action, int(nth) if nth else 1, int(ep.lstrip("<")) if ep else None,
                          below)


def armed(point: str) -> bool:
    """Whether a fault is configured at `point` (lets callers skip work to decide on it)."""
    return point in _faults


@contextmanager
def quiet() -> Iterator[None]:
    """On this thread, no fault fires and no hit counts: work that is not what a test aims at
    (an engine's warm-up generation) leaves the counts of `point=action@nth` as they were."""
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = False


def hit(point: str) -> None:
    f = _faults.get(point)
    if f is None or getattr(_quiet, "on", False):
        return
    action, nth, epoch, below = f
    if epoch is not None and _epoch is not None:
        if (below and _epoch >= epoch) or (not below and _epoch != epoch):
            return
    n = _counts.get(point, 0) + 1
    _counts[point] = n
    repeats = action in ("fail", "delay") or action.startswith(("errno:", "delay:"))
    if n != nth and not (repeats and n >= nth):
        return
    if action == "delay":
        time.sleep(0.05)
        return
    if action.startswith("delay:"):
        time.sleep(int(action[len("delay:"):]) / 1000)
        return
    if action == "exit":
        os._exit(1)
    if action == "abort":
        os.abort()
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "spew":
        _write_all(2, b"spew " + b"x" * SPEW_BYTES + b" end\n")
        return
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "fail":
        raise FaultInjected(f"fault injected at {point}")
    if action == "bug":
        raise RuntimeError(f"bug injected at {point}")
    if action.startswith("errno:"):
        code = getattr(errno, action[len("errno:"):])
        raise OSError(code, f"{os.strerror(code)} (fault injected at {point})")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
