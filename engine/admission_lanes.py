"""Where requests are prepared (chat template, tokenization, checks, SSD restore): two threads
of their own, never the I/O thread, which must keep answering aborts, flushes and heartbeats.
Small prompts go to one lane and large ones to the other, so a request with a 12 MiB prompt
never holds up a small one (tokenizers release the GIL while they work).

A request cancelled while it waits or is being prepared never reaches the MLX thread: the
handover to the runner and a cancellation are decided under one lock.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, TypeVar

from mlxd.engine.admission import prompt_chars
from mlxd.protocol.messages import Generate

log = logging.getLogger("mlxd.engine")

LARGE_PROMPT_CHARS = 64 * 1024

T = TypeVar("T")


class AdmissionLanes(Generic[T]):
    """`prepare(msg)` runs on a lane thread and returns what to hand over (or None when it
    answered the request itself); `hand_over(msg, item)` runs under the lane lock unless the
    request was cancelled meanwhile, in which case `dropped(msg)` runs instead."""

    def __init__(self, prepare: Callable[[Generate], T | None],
                 hand_over: Callable[[Generate, T], None],
                 dropped: Callable[[Generate], None]) -> None:
        self._prepare = prepare
        self._hand_over = hand_over
        self._dropped = dropped
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._cancelled: set[str] = set()
        self._queues = {"small": queue.Queue(), "large": queue.Queue()}  # type: dict[str, queue.Queue[Generate | None]]
        self._threads = [threading.Thread(target=self._lane, args=(q,), name=f"engine-admit-{k}",
                                          daemon=True) for k, q in self._queues.items()]
        for t in self._threads:
            t.start()

    def submit(self, msg: Generate) -> None:
        with self._lock:
            self._pending.add(msg.request_id)
        lane = "large" if prompt_chars(msg) > LARGE_PROMPT_CHARS else "small"
        self._queues[lane].put(msg)

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def cancel(self, request_ids: list[str]) -> None:
        """Requests still waiting or being prepared are dropped before they reach the MLX
        thread; the others are already there (abort them there)."""
        with self._lock:
            self._cancelled.update(r for r in request_ids if r in self._pending)

    def stop(self) -> None:
        for q in self._queues.values():
            q.put(None)

    def _lane(self, q: "queue.Queue[Generate | None]") -> None:
        while True:
            msg = q.get()
            if msg is None:
                return
            rid = msg.request_id
            item = None
            try:
                if rid not in self._cancelled:
                    item = self._prepare(msg)
            except Exception:  # noqa: BLE001 - `prepare` answers errors itself; never die
                log.exception("preparing request %s failed", rid)
            with self._lock:
                self._pending.discard(rid)
                cancelled = rid in self._cancelled
                self._cancelled.discard(rid)
                if item is not None and not cancelled:
                    self._hand_over(msg, item)
            if cancelled:
                self._dropped(msg)
