"""When the MLX thread hands a step's tokens to the output thread: at the next moment it lets
go of the GIL for MLX, not at once.

A step's tokens put on the output queue as soon as they are read back would wake the output
thread while the MLX thread goes on in Python (the runner's loop, then the next step's graph
build, both holding the GIL). The woken thread then competes for the GIL with the very work the
next token waits on, and on a busy machine its wake-up preempts the MLX thread, while it gets
the GIL only when the next step's `mx.async_eval` releases it anyway (`benchmarks/stage_costs.py`
compares both; figures: benchmarks/HISTORY.md section 14).

So `StepOutbox` holds a step's `StepTokens` (no wake-up) until the MLX thread next calls into
MLX from mlx-lm's generate module or the speculative step (`mx.async_eval` / `mx.eval`, which
release the GIL while the device works), takes a command from its inbox (work before its next
step: admissions, aborts, embeddings, a flush's copies) or blocks on it (idle): the output thread
wakes exactly when the GIL is free, and its detokenizing, encoding and sending overlap the
device's work instead of the next step's Python. A row's `RequestStarted` is held the same
way: otherwise an admission loop of 64 requests wakes the output thread 64 times, each wake-up
taking the GIL from the loop (`benchmarks/burst.py`; figures: benchmarks/HISTORY.md section 22).
A put of anything else from the MLX thread releases what is held first, so the output thread
sees the MLX thread's items in order.
Items put by other threads (admission, flushes, embeddings) go through at once.

A step that carries a row's first token (its `RequestStarted` went before) or a row's end is
put at once: holding it would add one graph build to the time to first token and to the
request's end, while for the tokens between the delay changes nothing a user sees (the same
interval, shifted).

The hidden setting `eager_handoff` (`MLXD_EAGER_HANDOFF=1`) puts every step at once, for
benchmarks/stage_costs.py's comparison of the two (the default's figures: benchmarks/RESULTS.md,
"Per-stage costs of a stream").
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from mlxd.engine.batch.messages import RequestStarted, StepTokens
from mlxd.protocol import stage_trace

_outboxes: list[StepOutbox] = []  # the process's deferring outboxes (one per engine)


class StepOutbox(queue.Queue):
    """The output queue, deferring the MLX thread's `StepTokens` unless `eager` (see the
    module text). The first thread to put a `StepTokens` is the MLX thread. Under the stage
    clock, a step's tokens carry its stamps, the put and the hand-off (the wake-up)."""

    def __init__(self, eager: bool = False) -> None:
        super().__init__()
        self.eager = eager
        self._held: list[Any] = []  # the MLX thread's alone
        self._mlx_thread: int | None = None
        self._fresh: set[str] = set()  # rows started whose first token has not gone out
        self._trace: Any = None
        if stage_trace.ON:
            from mlxd.engine import stage_clock as engine_trace
            self._trace = engine_trace
        if not eager:
            _outboxes.append(self)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        me = threading.get_ident()
        if isinstance(item, StepTokens):
            if self._trace is not None:
                item.trace = {**self._trace.last_step,  # type: ignore[attr-defined]
                              "put": stage_trace.now()}
            if self._mlx_thread is None:
                self._mlx_thread = me
            if not self.eager and me == self._mlx_thread and not self._urgent(item):
                self._held.append(item)
                return
            if self._held and me == self._mlx_thread:
                self.release()
            if self._trace is not None:
                item.trace["handed_off"] = stage_trace.now()  # type: ignore[attr-defined]
        else:
            if isinstance(item, RequestStarted):
                self._fresh.add(item.request_id)
                if not self.eager and me == self._mlx_thread:
                    self._held.append(item)  # an admission loop: no wake-up per request
                    return
            if self._held and me == self._mlx_thread:
                self.release()
        super().put(item, block, timeout)

    def _urgent(self, step: StepTokens) -> bool:
        """Whether the step starts or ends a row (which then is no longer fresh)."""
        urgent = False
        for rid, _, finish in step.rows:
            if rid in self._fresh:
                self._fresh.discard(rid)
                urgent = True
            elif finish is not None:
                urgent = True
        return urgent

    def release(self) -> None:
        """Put what the MLX thread holds (called on the MLX thread only)."""
        if self._held:
            held, self._held = self._held, []
            for item in held:
                if self._trace is not None and isinstance(item, StepTokens):
                    item.trace["handed_off"] = stage_trace.now()  # type: ignore[attr-defined]
                super().put(item)

    def close(self) -> None:
        self.release()
        if self in _outboxes:
            _outboxes.remove(self)


class ReleasingInbox(queue.Queue):
    """The runner's inbox: before the MLX thread blocks on it (idle), and when it takes a
    command (an admission, an abort, a `Call` such as embeddings or a flush's copies: work
    before its next step), held tokens go out."""

    def __init__(self, outbox: StepOutbox) -> None:
        super().__init__()
        self._outbox = outbox

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block:
            self._outbox.release()
        item = super().get(block, timeout)  # (queue.Empty: no command, the next step follows)
        self._outbox.release()
        return item


def _release_all() -> None:
    me = threading.get_ident()
    for box in _outboxes:
        if box._held and box._mlx_thread == me:
            box.release()


def install() -> None:
    """Release held tokens before every device wait of mlx-lm's generator and of the
    speculative step (through mlx-lm's one door; once per process)."""
    from mlxd.engine.mlx_lm_internals import on_device_wait
    on_device_wait(_release_all)
