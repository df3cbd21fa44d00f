"""Hang detection from heartbeats: an engine that is busy but whose progress counter has not
moved for `timeout` seconds, or that has stopped heartbeating, is hung. Pure logic."""

from __future__ import annotations

from dataclasses import dataclass

KILL_GRACE = 3.0  # seconds between SIGABRT (stack dump) and SIGKILL


@dataclass
class _Beat:
    progress: int
    busy: bool
    seen_at: float  # last heartbeat
    moved_at: float  # last time progress changed (or the engine went idle)
    aborted_at: float | None = None


class HangWatchdog:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._beats: dict[str, _Beat] = {}

    def forget(self, child_id: str) -> None:
        self._beats.pop(child_id, None)

    def beat(self, child_id: str, progress: int, busy: bool, now: float) -> None:
        b = self._beats.get(child_id)
        if b is None:
            self._beats[child_id] = _Beat(progress, busy, now, now)
            return
        if progress != b.progress or not busy:
            b.moved_at = now
        b.progress, b.busy, b.seen_at = progress, busy, now

    def check(self, child_id: str, now: float) -> str | None:
        """None, "abort" (send SIGABRT once) or "kill" (SIGKILL, after the grace period)."""
        if self.timeout <= 0:
            return None
        b = self._beats.get(child_id)
        if b is None:
            return None
        if b.aborted_at is not None:
            return "kill" if now - b.aborted_at >= KILL_GRACE else None
        silent = now - b.seen_at > self.timeout
        stuck = b.busy and now - b.moved_at > self.timeout
        if silent or stuck:
            b.aborted_at = now
            return "abort"
        return None
