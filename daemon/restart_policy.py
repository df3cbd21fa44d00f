"""When to restart a child that exited: exponential backoff with jitter, and a crash-loop
breaker. Pure logic: no processes here.

The breaker parks what can be broken on its own: a model that dies at every load. A child
without which the daemon serves nobody (the proxy) or keeps nothing (the storage worker) is
never parked: a loop of its crashes only stretches its backoff to `max_delay`, since parking
it for the cool-down would take the whole daemon down with it."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from mlxd.protocol import exit_codes


@dataclass
class RestartPolicy:
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.2
    loop_crashes: int = 5
    loop_window: float = 60.0
    breaker: bool = True  # False: a crash loop is never "failed" (config errors still are)
    _crashes: deque = field(default_factory=deque)

    def after_exit(self, code: int | None, now: float,
                   rng: random.Random | None = None) -> tuple[str, float]:
        """Decide what follows an unexpected exit: ("restart", delay) or ("failed", 0)."""
        if code == exit_codes.CONFIG_ERROR:
            return "failed", 0.0
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.loop_window:
            self._crashes.popleft()
        if self.breaker and len(self._crashes) >= self.loop_crashes:
            return "failed", 0.0
        n = len(self._crashes) - 1
        delay = min(self.base_delay * (2 ** n), self.max_delay)
        r = (rng or random).uniform(-self.jitter, self.jitter)
        return "restart", max(0.0, delay * (1 + r))

    def reset(self) -> None:
        self._crashes.clear()
