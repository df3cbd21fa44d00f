"""Hang detection, pure logic. A child is hung when it stops heartbeating, when it is busy but
its progress counter has not moved, or (for a probed child: the proxy) when its health probe
has gone unanswered, each for `timeout` seconds. A hung child gets "abort" (SIGABRT: a stack
dump), then "kill" after KILL_GRACE.

An engine's progress counter moves once per step, and on slow hardware one step can take
longer than the timeout (one prefill chunk of a large model, or at a long context). So an
engine states its pace with each heartbeat (how long a step takes now:
engine/batch/timing/pace.py) and the watchdog waits for progress PACE_FACTOR times that pace when
it exceeds the timeout: a working engine is never taken for a hung one, whatever the model
and hardware, and a hung one is still caught, within a few of its own steps.

The supervisor asks these questions only of children that are ready: a child that is stopping
(the proxy draining on shutdown) is the stop's business, and one that is starting may load a
model for minutes without a beat (a load can hold the GIL). A starting child is judged on one
thing only: a process that stays stopped (SIGSTOP, a debugger) for `timeout` seconds is hung,
whatever it was doing; otherwise a stop during a load would wedge its model for good. Any HTTP
answer counts as an answer (503 while models load included): the probe asks whether the event
loop serves, not whether the daemon is healthy.
"""

from __future__ import annotations

from dataclasses import dataclass

KILL_GRACE = 3.0  # seconds between SIGABRT (stack dump) and SIGKILL
# how many of its own steps an engine may go without progress: room for the next step to run
# longer than the last (a longer context, a larger chunk) before it is called hung
PACE_FACTOR = 3.0


@dataclass
class _Beat:
    progress: int
    busy: bool
    seen_at: float  # last heartbeat
    moved_at: float  # last time progress changed (or the child went idle)
    probed: bool = False
    answered_at: float = 0.0  # last answer to the health probe (probed children)
    aborted_at: float | None = None
    why: str = ""
    pace_s: float = 0.0  # how long a step of this engine takes now (its own figure)


class HangWatchdog:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._beats: dict[str, _Beat] = {}
        self._stopped: dict[str, tuple[float | None, float | None]] = {}  # since, aborted at
        self._stop_why: dict[str, str] = {}

    def forget(self, child_id: str) -> None:
        self._beats.pop(child_id, None)
        self._stopped.pop(child_id, None)
        self._stop_why.pop(child_id, None)

    def watch(self, child_id: str, now: float, probed: bool = False) -> None:
        """The child just became ready: every clock starts now."""
        self._beats[child_id] = _Beat(0, False, now, now, probed, now)
        self._stopped.pop(child_id, None)

    def beat(self, child_id: str, progress: int, busy: bool, now: float,
             pace_s: float = 0.0) -> None:
        b = self._beats.get(child_id)
        if b is None:
            self._beats[child_id] = _Beat(progress, busy, now, now, pace_s=pace_s)
            return
        if progress != b.progress or not busy:
            b.moved_at = now
        b.progress, b.busy, b.seen_at, b.pace_s = progress, busy, now, pace_s

    def answered(self, child_id: str, now: float) -> None:
        b = self._beats.get(child_id)
        if b is not None:
            b.answered_at = now

    def check(self, child_id: str, now: float) -> str | None:
        """None, "abort" (send SIGABRT once) or "kill" (SIGKILL, after the grace period)."""
        if self.timeout <= 0:
            return None
        b = self._beats.get(child_id)
        if b is None:
            return None
        if b.aborted_at is not None:
            return "kill" if now - b.aborted_at >= KILL_GRACE else None
        if now - b.seen_at > self.timeout:
            b.why = f"no heartbeat for {now - b.seen_at:.0f} s"
        elif b.busy and now - b.moved_at > max(self.timeout, PACE_FACTOR * b.pace_s):
            paced = PACE_FACTOR * b.pace_s > self.timeout
            b.why = f"no progress for {now - b.moved_at:.0f} s while busy" + (
                f" (its steps take {b.pace_s:.1f} s)" if paced else "")
        elif b.probed and now - b.answered_at > self.timeout:
            b.why = f"no answer to its health probe for {now - b.answered_at:.0f} s"
        else:
            return None
        b.aborted_at = now
        return "abort"

    def stopped(self, child_id: str, is_stopped: bool, now: float) -> str | None:
        """A child not yet ready, sampled: None, "abort" or "kill" as `check`. Its clock runs
        only while the process is stopped, and starts over when it runs again."""
        if self.timeout <= 0:
            return None
        since, aborted_at = self._stopped.get(child_id, (None, None))
        if aborted_at is not None:
            return "kill" if now - aborted_at >= KILL_GRACE else None
        if not is_stopped:
            self._stopped.pop(child_id, None)
            return None
        if since is None:
            self._stopped[child_id] = (now, None)
            return None
        if now - since <= self.timeout:
            return None
        self._stopped[child_id] = (since, now)
        self._stop_why[child_id] = f"stopped for {now - since:.0f} s while starting"
        return "abort"

    def why(self, child_id: str) -> str:
        """What the last "abort" of this child was for."""
        b = self._beats.get(child_id)
        return b.why if b is not None and b.why else self._stop_why.get(child_id, "")


def probe_timing(timeout: float) -> tuple[float, float]:
    """(interval, per-probe timeout) of the health probe for a hang timeout: several probes
    fit in one hang timeout, so one slow answer never kills a child."""
    per_probe = min(5.0, max(0.2, timeout / 2))
    return min(5.0, max(0.2, timeout / 4)), per_probe
