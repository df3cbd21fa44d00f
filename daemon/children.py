"""The supervisor's record of one child process (supervisord-style states)."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

from mlxd.daemon.restart_policy import RestartPolicy
from mlxd.protocol.addresses import identity
from mlxd.protocol.messages import ChildInfo, ChildState, Role
from mlxd.protocol.settings import PoolShare


@dataclass
class Child:
    role: Role
    child_id: str
    model: str  # the model spec, for engines
    argv: list[str]  # `python -m mlxd.<role>`; the launch struct goes on its stdin
    epoch: int = 0
    state: ChildState = "starting"
    proc: asyncio.subprocess.Process | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    reason: str | None = None
    last_exit: str | None = None
    last_error: str | None = None
    last_heartbeat: float | None = None
    restarts: int = 0
    served: bool = False  # an engine that served a token in its current life (its heartbeats)
    removed: bool = False  # unloaded on purpose: not restarted when it exits
    share: PoolShare | None = None  # an engine's part of the memory (memory_share.py), as told

    @property
    def identity(self) -> bytes:
        return identity(self.role, self.child_id, self.epoch)

    @property
    def running(self) -> asyncio.subprocess.Process | None:
        """The child's process while it runs, else None."""
        return self.proc if self.proc is not None and self.proc.returncode is None else None

    @property
    def alive(self) -> bool:
        return self.running is not None

    def info(self, now: float) -> ChildInfo:
        return ChildInfo(
            role=self.role, child_id=self.child_id, model=self.model, epoch=self.epoch,
            state=self.state, pid=self.proc.pid if self.proc else None, restarts=self.restarts,
            last_exit=self.last_exit, last_error=self.last_error, reason=self.reason,
            heartbeat_age_s=round(now - self.last_heartbeat, 3) if self.last_heartbeat else None)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def is_error_line(line: str) -> bool:
    return any(m in line for m in (" ERROR ", " CRITICAL ", "Error:", "Fatal Python error",
                                   "Traceback (most recent call last)", "Exception:"))
