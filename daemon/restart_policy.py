"""When to restart a child that exited: exponential backoff with jitter, and a crash-loop
breaker. Pure logic: no processes here.

A crash loop is a run of deaths with no progress between them. The caller says, with each
exit, whether the life that just ended made progress (for an engine: it became ready and
served at least one token; the supervisor reads that from its heartbeats). A death without
progress extends the current loop: its backoff doubles, and `loop_crashes` of them within
`loop_window` seconds park the child ("failed"). A death after progress ends any loop: the
child is restarted after `base_delay` and never parked for it, however often it happens, since
an engine that serves between deaths still serves (the proxy resumes its streams, and the
poison guard fails the one request that keeps killing it).

The breaker parks what can be broken on its own: a model that dies at every load, or at its
first token. A child without which the daemon serves nobody (the proxy) or keeps nothing (the
storage worker) is never parked: a loop of its crashes only stretches its backoff to
`max_delay`, since parking it for the cool-down would take the whole daemon down with it."""

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
    _loop: deque = field(default_factory=deque)  # times of the current loop's deaths

    def after_exit(self, code: int | None, now: float, rng: random.Random | None = None, *,
                   progressed: bool = False) -> tuple[str, float]:
        """Decide what follows an unexpected exit: ("restart", delay) or ("failed", 0).
        `progressed`: the life that ended made progress (see the module's docstring)."""
        if code == exit_codes.CONFIG_ERROR:
            return "failed", 0.0
        if progressed:
            self._loop.clear()
        self._loop.append(now)
        while self._loop and now - self._loop[0] > self.loop_window:
            self._loop.popleft()
        if self.breaker and len(self._loop) >= self.loop_crashes:
            return "failed", 0.0
        n = len(self._loop) - 1
        delay = min(self.base_delay * (2 ** n), self.max_delay)
        r = (rng or random).uniform(-self.jitter, self.jitter)
        return "restart", max(0.0, delay * (1 + r))

    @property
    def loop_length(self) -> int:
        """Deaths in the current loop (what the breaker counts)."""
        return len(self._loop)

    def reset(self) -> None:
        self._loop.clear()
