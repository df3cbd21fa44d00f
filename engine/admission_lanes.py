"""Where requests are prepared (chat template, tokenization, checks, SSD restore): two threads
of their own, never the I/O thread, which must keep answering aborts, flushes and heartbeats.
Small prompts go to one lane and large ones to the other, so a request with a 12 MiB prompt
never holds up a small one. The small lane has up to four threads where the machine has the
cores: a burst of requests is then prepared side by side (tokenizers and the SSD tier's file
checks release the GIL), not one after the other. A small-lane thread that finds more requests
waiting takes them with it (up to BATCH_MAX) and prepares them together (`prompt_batch`: one
chat template and tokenizer call for all), handing each over as soon as it is ready.

A request cancelled while it waits or is being prepared never reaches the MLX thread: the
handover to the runner and a cancellation are decided under one lock.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable

from mlxd.engine.admission import Admitted, Answered, prompt_chars
from mlxd.protocol import stage_trace
from mlxd.protocol.messages import Generate

LARGE_PROMPT_CHARS = 64 * 1024
# a core left to the MLX thread; MLXD_ADMIT_THREADS sets another count (for comparisons)
SMALL_LANE_THREADS = max(1, int(os.environ.get("MLXD_ADMIT_THREADS", "0") or 0)
                         or min(4, (os.cpu_count() or 1) - 1))
BATCH_MAX = 64  # small requests a lane thread takes at once, when they are already waiting


class AdmissionLanes:
    """`prepare(msg)` runs on a lane thread; `deliver(result)` runs under the lanes' lock
    unless the request was cancelled meanwhile, in which case `dropped(msg)` runs instead."""

    def __init__(self, prepare: Callable[[Generate], Admitted | Answered],
                 deliver: Callable[[Admitted | Answered], None],
                 dropped: Callable[[Generate], None],
                 small_threads: int = SMALL_LANE_THREADS,
                 prepare_many: Callable[[list[Generate]], Iterable[Admitted | Answered]]
                 | None = None) -> None:
        """`prepare_many`: how the small lane prepares the requests it finds waiting together
        (a burst's, `prompt_batch`); without it each is prepared on its own."""
        self._prepare = prepare
        self._prepare_many = prepare_many
        self._deliver = deliver
        self._dropped = dropped
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[float, bool]] = {}  # request id -> (when it reached
        #                                                    the engine, on the large lane)
        self._cancelled: set[str] = set()
        self._queues: dict[str, queue.Queue[Generate | None]] = {
            "small": queue.Queue(), "large": queue.Queue()}
        self._threads = {"small": small_threads, "large": 1}
        for lane, q in self._queues.items():
            batch = BATCH_MAX if lane == "small" and prepare_many is not None else 1
            for i in range(self._threads[lane]):
                threading.Thread(target=self._lane, args=(q, batch), daemon=True,
                                 name=f"engine-admit-{lane}" + (f"-{i}" if i else "")).start()

    def submit(self, msg: Generate) -> None:
        if stage_trace.ON:
            stage_trace.stamp_request(msg.request_id, "engine_in", "engine")
        large = prompt_chars(msg) > LARGE_PROMPT_CHARS
        with self._lock:
            self._pending[msg.request_id] = (time.monotonic(), large)
        self._queues["large" if large else "small"].put(msg)

    def cancel(self, request_ids: list[str]) -> None:
        """Requests still waiting or being prepared are dropped before they reach the MLX
        thread (["*"]: all of them); the others are already there (abort them there)."""
        with self._lock:
            ids = self._pending if "*" in request_ids else request_ids
            self._cancelled.update(r for r in ids if r in self._pending)

    def preparing(self, submitted_by: float = math.inf) -> int:
        """Small requests submitted (by monotonic time `submitted_by`) and not yet handed
        over: the MLX thread's burst admission waits for them. A large prompt is not waited
        for: it takes longer to tokenize than any burst window, and its prefill alone longer
        than the small ones' together."""
        with self._lock:
            return sum(1 for t, large in self._pending.values()
                       if not large and t <= submitted_by)

    def stop(self) -> None:
        for lane, q in self._queues.items():
            for _ in range(self._threads[lane]):
                q.put(None)

    def _lane(self, q: queue.Queue[Generate | None], batch: int) -> None:
        while (msg := q.get()) is not None:
            msgs = [msg]
            while len(msgs) < batch:
                try:
                    more = q.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # another thread's stop: left for it
                    q.put(None)
                    break
                msgs.append(more)
            live = [m for m in msgs if m.request_id not in self._cancelled]
            if len(live) > 1 and self._prepare_many is not None:
                results = iter(self._prepare_many(live))
            else:
                results = (self._prepare(m) for m in live)
            taken = {id(m) for m in live}
            for m in msgs:  # one at a time (the lazy path: as each is prepared)
                self._hand_over(m, next(results) if id(m) in taken else None)

    def _hand_over(self, msg: Generate, result: Admitted | Answered | None) -> None:
        rid = msg.request_id
        with self._lock:
            self._pending.pop(rid, None)
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
            if result is not None and not cancelled:
                self._deliver(result)
        if cancelled or result is None:
            self._dropped(msg)
