"""A process's signals at the end of its event loop. asyncio's `loop.close()` shuts the
self-pipe that its signal handlers write to before it removes those handlers, so a signal that
lands between the two (the supervisor's SIGTERM just after a process group's, a second Ctrl-C) is
written to a closed socket, and Python prints the failed write as a traceback in the log."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable


def ignore_from_now(loop: asyncio.AbstractEventLoop, signals: Iterable[int]) -> None:
    """Hand `signals` from the loop's handlers to SIG_IGN, for a process that is stopping and
    has nothing more to do on them. Blocked while they change hands, so none meets the default
    action (death by the signal) in between; one pending meanwhile is discarded."""
    sigs = set(signals)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
