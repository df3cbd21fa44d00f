"""Where requests are prepared (chat template, tokenization, checks, SSD restore): two threads
of their own, never the I/O thread, which must keep answering aborts, flushes and heartbeats.
Small prompts go to one lane and large ones to the other, so a request with a 12 MiB prompt
never holds up a small one (tokenizers release the GIL while they work).

A request cancelled while it waits or is being prepared never reaches the MLX thread: the
handover to the runner and a cancellation are decided under one lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from mlxd.engine.admission import Admitted, Answered, prompt_chars
from mlxd.protocol import stage_trace
from mlxd.protocol.messages import Generate

LARGE_PROMPT_CHARS = 64 * 1024


class AdmissionLanes:
    """`prepare(msg)` runs on a lane thread; `deliver(result)` runs under the lanes' lock
    unless the request was cancelled meanwhile, in which case `dropped(msg)` runs instead."""

    def __init__(self, prepare: Callable[[Generate], Admitted | Answered],
                 deliver: Callable[[Admitted | Answered], None],
                 dropped: Callable[[Generate], None]) -> None:
        self._prepare = prepare
        self._deliver = deliver
        self._dropped = dropped
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()
        self._queues: dict[str, queue.Queue[Generate | None]] = {
            "small": queue.Queue(), "large": queue.Queue()}
        for lane, q in self._queues.items():
            threading.Thread(target=self._lane, args=(q,), name=f"engine-admit-{lane}",
                             daemon=True).start()

    def submit(self, msg: Generate) -> None:
        if stage_trace.ON:
            stage_trace.stamp_request(msg.request_id, "engine_in", "engine")
        with self._lock:
            self._pending.add(msg.request_id)
        lane = "large" if prompt_chars(msg) > LARGE_PROMPT_CHARS else "small"
        self._queues[lane].put(msg)

    def cancel(self, request_ids: list[str]) -> None:
        """Requests still waiting or being prepared are dropped before they reach the MLX
        thread (["*"]: all of them); the others are already there (abort them there)."""
        with self._lock:
            ids = self._pending if "*" in request_ids else request_ids
            self._cancelled.update(r for r in ids if r in self._pending)

    def preparing(self) -> int:
        """Requests submitted and not yet handed over (read by the MLX thread's burst
        admission; a set's length is read whole)."""
        return len(self._pending)

    def stop(self) -> None:
        for q in self._queues.values():
            q.put(None)

    def _lane(self, q: queue.Queue[Generate | None]) -> None:
        while (msg := q.get()) is not None:
            rid = msg.request_id
            result = None if rid in self._cancelled else self._prepare(msg)
            with self._lock:
                self._pending.discard(rid)
                cancelled = rid in self._cancelled
                self._cancelled.discard(rid)
                if result is not None and not cancelled:
                    self._deliver(result)
            if cancelled:
                self._dropped(msg)
