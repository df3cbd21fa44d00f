"""Which requests may join the running rows now: the KV budget's gate (`budget.py`
decides whether one more fits; this keeps the books). Requests wait in arrival order and a
request is never passed by a later one, so none waits for ever. Pure bookkeeping, run on the
MLX thread: the runner offers new requests, releases ended ones and asks what the cap is.
"""

from __future__ import annotations

from collections import deque

from mlxd.engine.batch.budget import Budget, explain, may_admit, reserved_tokens
from mlxd.engine.batch.messages import AddRequest


class KvGate:
    def __init__(self, batch_size: int, budget: Budget | None, context: int) -> None:
        """`budget` None: no memory rule, `batch_size` rows at most (the generator's own)."""
        self.batch_size = batch_size
        self.budget = budget
        self.context = context
        self.held: deque[AddRequest] = deque()  # waiting for room, in arrival order
        self.reserved: dict[str, int] = {}  # request id -> KV tokens it may come to hold
        self.reserved_total = 0
        self._last_reserved = 0  # the latest admitted request's: the typical size at idle
        self.room_changed = False  # reservations were released since the gate last looked

    def admit(self, adds: list[AddRequest]) -> list[AddRequest]:
        """The requests that may join the running rows now, oldest first (the held ones
        before `adds`); the rest are held."""
        self.held.extend(adds)
        self.room_changed = False
        admitted = []
        while self.held:
            add = self.held[0]
            shape = self.budget.sizing.shape if self.budget and self.budget.sizing else None
            need = reserved_tokens(len(add.prompt), add.max_tokens, self.context, shape)
            if self.budget is not None and not may_admit(
                    self.budget, len(self.reserved), self.reserved_total, need):
                break
            self.held.popleft()
            self.reserved[add.request_id] = need
            self.reserved_total += need
            self._last_reserved = need
            admitted.append(add)
        return admitted

    def release(self, request_ids: list[str]) -> None:
        """Rows that ended (or never started): their reservations go back."""
        for rid in request_ids:
            self.reserved_total -= self.reserved.pop(rid, 0)
        self.room_changed = True

    def drop_held(self, gone: set[str]) -> None:
        """Held requests that were aborted leave the queue."""
        if self.held:
            self.held = deque(a for a in self.held if a.request_id not in gone)

    def clear(self, held: bool) -> list[str]:
        """Every reservation released; with `held`, the held requests dropped too (their ids
        returned)."""
        dropped = [a.request_id for a in self.held] if held else []
        if held:
            self.held.clear()
        self.reserved.clear()
        self.reserved_total = 0
        self.room_changed = True
        return dropped

    def set_budget(self, budget: Budget) -> None:
        """A new budget: running rows go on; the next look admits by the new one."""
        self.budget = budget
        self.room_changed = True

    def cap(self) -> tuple[int, str]:
        """Rows the budget allows now, and why (for /stats)."""
        if self.budget is None:
            return self.batch_size, f"--batch {self.batch_size}"
        running = len(self.reserved)
        typical = (self.reserved_total // running if running
                   else self._last_reserved or self.context or 4096)
        return explain(self.budget, running, self.reserved_total, typical)
