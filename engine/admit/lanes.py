"""Where requests are prepared (chat template, tokenization, checks, SSD restore): two lanes
of threads of their own, never the I/O thread, which must keep answering aborts, flushes and
heartbeats. Small prompts go to one lane and large ones (and requests with images, whose vision
tower runs there) to the other, so a request with a 12 MiB prompt or a large image never holds
up a small one. The small lane has up to four threads where the
machine has the cores: a burst of requests is then prepared side by side (tokenizers and the
SSD tier's file checks release the GIL), not one after the other. A small-lane thread that
finds more requests waiting takes them with it (up to BATCH_MAX) and prepares them together
(`prompt_batch`: one chat template and tokenizer call for all), handing each over as soon as
it is ready.

A request cancelled while it waits or is being prepared never reaches the MLX thread: the
handover to the runner and a cancellation are decided under one lock.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from mlxd.engine.admit.prepare import Admitted, Answered, prompt_chars
from mlxd.engine.stage_clock import NO_CLOCK, RequestClock
from mlxd.protocol.messages import Generate

log = logging.getLogger("mlxd.engine")

LARGE_PROMPT_CHARS = 64 * 1024


def small_lane_threads(asked: int = 0) -> int:
    """`asked` (the hidden setting `admit_threads`, for comparisons) when positive, else up
    to four, one core left to the MLX thread."""
    return asked if asked > 0 else max(1, min(4, (os.cpu_count() or 1) - 1))


STOP_WAIT_S = 5.0  # for the lane threads to end at shutdown (one may be preparing a prompt)
BATCH_MAX = 64  # small requests a lane thread takes at once, when they are already waiting


class AdmissionLanes:
    """`prepare(msg)` runs on a lane thread; `deliver(result)` runs under the lanes' lock
    unless the request was cancelled meanwhile, in which case `dropped(msg)` runs instead."""

    def __init__(self, prepare: Callable[[Generate], Admitted | Answered],
                 deliver: Callable[[Admitted | Answered], None],
                 dropped: Callable[[Generate], None],
                 small_threads: int = 1,
                 prepare_many: Callable[[list[Generate]], Iterable[Admitted | Answered]]
                 | None = None, clock: RequestClock = NO_CLOCK) -> None:
        """`prepare_many`: how the small lane prepares the requests it finds waiting together
        (a burst's, `prompt_batch`); without it each is prepared on its own."""
        self._prepare = prepare
        self._clock = clock  # the stage clock's hooks at this room's boundaries
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
        self._running: list[threading.Thread] = []
        for lane, q in self._queues.items():
            batch = BATCH_MAX if lane == "small" and prepare_many is not None else 1
            for i in range(self._threads[lane]):
                t = threading.Thread(target=self._lane, args=(q, batch), daemon=True,
                                     name=f"engine-admit-{lane}" + (f"-{i}" if i else ""))
                t.start()
                self._running.append(t)

    def submit(self, msg: Generate) -> None:
        self._clock.received(msg.request_id)
        # A request with images is prepared on the large lane: its vision tower runs there
        # (vision/prompt.py), which small text requests must not queue behind.
        large = prompt_chars(msg) > LARGE_PROMPT_CHARS or bool(msg.images)
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

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Tell the lane threads to end and wait for them (at most `timeout` seconds in all).
        A lane thread that ran MLX work (a vision tower) holds MLX's per-thread stream: left
        running into the interpreter's exit, its teardown raced MLX's own and aborted the
        process ("terminate called without an active exception")."""
        for lane, q in self._queues.items():
            for _ in range(self._threads[lane]):
                q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._running:
            t.join(max(0.0, deadline - time.monotonic()))

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
            for m in live:
                self._clock.lane(m.request_id)
            results = self._results(live)
            taken = {id(m) for m in live}
            for m in msgs:  # one at a time, as each is prepared
                self._hand_over(m, next(results) if id(m) in taken else None)

    def _results(self, live: list[Generate]) -> Iterator[Admitted | Answered | None]:
        """One result per request, in order; None for one that could not be prepared at all
        (it is dropped: its client gets an answer, and the lane thread lives on)."""
        done = 0
        if len(live) > 1 and self._prepare_many is not None:
            try:
                for result in self._prepare_many(live):
                    done += 1
                    yield result
                return
            except Exception:  # the rest, the failing one included, one at a time
                log.exception("%d requests could not be prepared together",
                              len(live) - done)
        for m in live[done:]:
            try:
                yield self._prepare(m)
            except Exception:
                log.exception("request %s could not be prepared", m.request_id)
                yield None

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
