"""Whether the SSD tier may write now. Pure logic, no clock of its own (callers pass `now`).

Healthy, every block is written. The first refused write degrades the tier: it writes nothing
(blocks are skipped, not failed) until a retry time, then sends one probe block; the probe's
answer decides: written, the tier is healthy again; refused, the wait doubles (1 s up to 60 s).
Answers to writes sent before the tier degraded carry no news and change nothing. So a full,
read-only or vanished disk costs one block write attempt per backoff period, never a busy loop.

Besides, a degraded tier asks the storage worker every `probe_every` seconds (5), traffic or
not, whether the disk could take a block now (`ProbeDisk`: room for one block made and given
back, no block sent); yes recovers the tier at once. So a disk that takes writes again is
noticed within 5 s, however long the block backoff has grown, and an idle tier does not go on
saying it is degraded.

An explicit flush probes at once (`retry_now`); a probe already out when it asked was sent to
the disk as it was before, so its refusal leaves the next probe due at once, not after the
backoff: the flush's own probe decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0
PROBE_EVERY = 5.0  # the disk probe's period while degraded


@dataclass(frozen=True)
class Refusal:
    code: str  # disk_full, read_only, permission_denied, gone, io_error, ... (StoreDone)
    message: str


class Admit(Enum):
    WRITE = "write"  # healthy: queue every missing block
    PROBE = "probe"  # degraded, retry time reached: queue one block
    SKIP = "skip"  # degraded: queue nothing


class Change(Enum):
    DEGRADED = "degraded"
    STILL_DEGRADED = "still degraded"  # a probe was refused
    RECOVERED = "recovered"


class WriteHealth:
    def __init__(self, first: float = BACKOFF_FIRST, most: float = BACKOFF_MAX,
                 probe_every: float = PROBE_EVERY) -> None:
        self.first, self.most, self.probe_every = first, most, probe_every
        self.disk_probe_at = 0.0  # when the next disk probe is due (while degraded)
        self.disk_probe_out = False
        self.refusal: Refusal | None = None
        self.backoff = 0.0
        self.retry_at = 0.0
        self.probe_slot: int | None = None  # the slot of the probe awaiting its answer
        self._recheck = False  # a flush asked while that probe was out

    @property
    def degraded(self) -> bool:
        return self.refusal is not None

    def admit(self, now: float) -> Admit:
        if self.refusal is None:
            return Admit.WRITE
        if self.probe_slot is None and now >= self.retry_at:
            return Admit.PROBE
        return Admit.SKIP

    def probing(self, slot: int) -> None:
        self.probe_slot = slot

    def retry_now(self, now: float) -> None:
        """An explicit flush: the next write may probe at once, whatever the backoff."""
        self.retry_at = min(self.retry_at, now)
        self._recheck = self.probe_slot is not None

    def disk_probe_due(self, now: float) -> bool:
        """Whether to ask the worker if the disk takes writes now: degraded, neither a block
        probe nor a disk probe out, and the disk probe's time come."""
        return self.refusal is not None and self.probe_slot is None \
            and not self.disk_probe_out and now >= self.disk_probe_at

    def disk_probing(self) -> None:
        self.disk_probe_out = True

    def disk_probe_lost(self) -> None:
        """The worker died before answering it (or it could not be sent)."""
        self.disk_probe_out = False

    def disk_answered(self, refusal: Refusal | None, now: float) -> Change | None:
        """A disk probe's answer: `refusal` None when the disk takes writes."""
        self.disk_probe_out = False
        self.disk_probe_at = now + self.probe_every
        if self.refusal is None or refusal is not None:
            return None
        self.refusal, self.backoff = None, 0.0
        return Change.RECOVERED

    def refused(self, now: float) -> bool:
        """Degraded and not allowed to try again yet (and no probe out to decide it)."""
        return self.refusal is not None and self.probe_slot is None and now < self.retry_at

    def retry_in(self, now: float) -> float:
        return max(0.0, self.retry_at - now) if self.refusal is not None else 0.0

    def answered(self, slots: list[int], refusal: Refusal | None, now: float) -> Change | None:
        """A StoreDone for `slots`: `refusal` is None when every block was written."""
        probe = self.probe_slot is not None and self.probe_slot in slots
        if probe:
            self.probe_slot = None
        if refusal is None:
            if probe and self.refusal is not None:
                self.refusal, self.backoff = None, 0.0
                return Change.RECOVERED
            return None
        if self.refusal is None:
            self.refusal, self.backoff, self.retry_at = refusal, self.first, now + self.first
            self.disk_probe_at = now + self.probe_every
            return Change.DEGRADED
        if probe:
            self.backoff = min(2 * self.backoff, self.most)
            self.refusal = refusal
            self.retry_at = now if self._recheck else now + self.backoff
            self._recheck = False
            return Change.STILL_DEGRADED
        return None
