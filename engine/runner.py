"""The MLX thread: drives mlx-lm's BatchGenerator with continuous batching.

It does MLX work and little else: it takes commands from its inbox, runs one generator step,
and hands the step's raw token IDs to the output thread in one queue put.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlxd.protocol import faults

log = logging.getLogger("mlxd.engine")


@dataclass
class AddRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampler: Callable[[mx.array], mx.array]
    processors: list


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class StopRunner:
    pass


@dataclass
class StepTokens:
    """One step: (request_id, token, finish_reason) for every row that produced a token."""
    rows: list[tuple[str, int, str | None]]


@dataclass
class RequestsRemoved:
    request_ids: list[str]
    error: str | None = None


@dataclass
class RunnerCounters:
    steps: int = 0  # advanced by every step: the hang watchdog's progress counter
    peak_batch: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    active: int = 0
    busy: bool = False
    last_step_at: float = field(default_factory=time.monotonic)


class Runner:
    def __init__(self, model: Any, eos_ids: list[int], *, batch_size: int, prefill_step: int,
                 outbox: "queue.Queue[Any]", stream: Any = None) -> None:
        self._model = model
        self._batch_size = batch_size
        self._prefill_step = prefill_step
        self._stream = stream
        self._stop_sequences = StopSequences([[e] for e in eos_ids])
        self.inbox: "queue.Queue[Any]" = queue.Queue()
        self._outbox = outbox
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        self.counters = RunnerCounters()
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._model,
            completion_batch_size=self._batch_size,
            prefill_batch_size=self._batch_size,
            prefill_step_size=self._prefill_step,
            stream=self._stream,
        )

    def run(self) -> None:
        try:
            while self._handle_commands(block=not self._uid_to_rid):
                if self._uid_to_rid:
                    self._step()
        finally:
            self._gen.close()

    def _handle_commands(self, block: bool) -> bool:
        try:
            cmd = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        adds: list[AddRequest] = []
        aborts: list[str] = []
        while True:
            if isinstance(cmd, StopRunner):
                self._fail_all("engine stopping")
                return False
            if isinstance(cmd, AddRequest):
                adds.append(cmd)
            elif isinstance(cmd, AbortRequest):
                aborts.append(cmd.request_id)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
        if adds:
            uids = self._gen.insert(
                [a.prompt for a in adds],
                max_tokens=[a.max_tokens for a in adds],
                samplers=[a.sampler for a in adds],
                logits_processors=[a.processors for a in adds],
                stop_sequences=[self._stop_sequences] * len(adds),
            )
            for uid, add in zip(uids, adds):
                self._uid_to_rid[uid] = add.request_id
                self._rid_to_uid[add.request_id] = uid
                self.counters.prompt_tokens += len(add.prompt)
        if aborts:
            uids = [self._rid_to_uid.pop(r) for r in aborts if r in self._rid_to_uid]
            for uid in uids:
                del self._uid_to_rid[uid]
            if uids:
                self._gen.remove(uids)
            self._outbox.put(RequestsRemoved(aborts))
        self.counters.active = len(self._uid_to_rid)
        self.counters.busy = bool(self._uid_to_rid)
        return True

    def _step(self) -> None:
        faults.hit("engine.step")
        try:
            _, responses = self._gen.next()
        except Exception as e:  # noqa: BLE001 - a failed step must not take the engine down
            log.exception("generation step failed; failing its requests")
            self._fail_all(f"generation step failed: {e}")
            self._gen.close()
            self._gen = self._new_generator()
            return
        c = self.counters
        c.steps += 1
        c.last_step_at = time.monotonic()
        if not responses:
            return
        rows = []
        for r in responses:
            rid = self._uid_to_rid.get(r.uid)
            if rid is None:
                continue
            rows.append((rid, r.token, r.finish_reason))
            if r.finish_reason is not None:
                del self._uid_to_rid[r.uid]
                del self._rid_to_uid[rid]
        c.generated_tokens += len(rows)
        c.peak_batch = max(c.peak_batch, len(responses))
        c.active = len(self._uid_to_rid)
        c.busy = bool(self._uid_to_rid)
        self._outbox.put(StepTokens(rows))

    def _fail_all(self, message: str) -> None:
        rids = list(self._rid_to_uid)
        if self._uid_to_rid:
            self._gen.remove(list(self._uid_to_rid))
        self._uid_to_rid.clear()
        self._rid_to_uid.clear()
        self.counters.active = 0
        self.counters.busy = False
        if rids:
            self._outbox.put(RequestsRemoved(rids, error=message))
