"""An engine's embeddings, in both kinds of engine.

The embedding lane (a thread of its own, never the I/O thread) tokenizes each `Embed` and
checks it; the MLX thread embeds what is queued in forward passes of up to 64 inputs, across
requests, and hands each finished request's vectors to the output thread as one `Embeddings`
(float32 bytes). In an embedding engine the MLX thread runs `serve`; in a generating engine a
queued request wakes the runner with a `Call`, which embeds between generation steps.

A forward pass is bounded by inputs and tokens, not by time: on slow hardware (a large model
on a small Mac; the default model on this project's CPU) one pass of 32k padded tokens can take
minutes. So a pass states its pace to the hang watchdog as a generation step does
(`batch/timing/pace.py`: its padded tokens at the last seen seconds per token, first the
warm-up's), and a working engine is not taken for a hung one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import msgspec
import numpy as np

from mlxd.engine.admit.prepare import ClientError
from mlxd.engine.batch.timing.pace import PassPace
from mlxd.engine.embeddings.models import MAX_STEP_INPUTS, check_token_ids, normalized, plan_steps
from mlxd.protocol import faults
from mlxd.protocol.messages import Delta, Embed, Embeddings, EngineStatus

log = logging.getLogger("mlxd.engine")

WARM_UP_WORDS = 64  # the warm-up's longer input, in words (about as many tokens)


class Embedder(Protocol):
    max_tokens: int
    vocab: int
    width: int  # the hidden size (how a pass's cost grows with its length: PassPace)
    dimensions: int  # 0 until the first forward pass

    def tokenize(self, texts: list[str], truncate: bool) -> list[list[int]]: ...

    def forward(self, batch: list[list[int]]) -> np.ndarray: ...


class PairScorer(Embedder, Protocol):
    """An embedder that can also rerank (a cross-encoder)."""
    ranks: bool

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[list[int]]: ...

    def score(self, batch: list[list[int]]) -> np.ndarray: ...


@dataclass
class EmbedJob:
    """One request on its way through the MLX thread."""
    request_id: str
    inputs: list[list[int]]
    dimensions: int
    vectors: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0
    failed: bool = False
    rerank: bool = False  # inputs are (query, document) pairs; vectors are their scores


@dataclass
class EmbedCounters:
    """Advanced on the MLX thread, read by the output thread (plain integers)."""
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    steps: int = 0
    peak_batch: int = 0
    active: int = 0  # requests queued or being embedded
    busy: bool = False
    pace_s: float = 0.0  # how long the pass running now should take (the watchdog's patience)
    longest_s: float = 0.0  # the longest pass


class Embedding:
    def __init__(self, embedder: Embedder, outq: queue.Queue[Any], engine_id: str, epoch: int,
                 wake: Callable[[], None] | None = None, token_s: float | None = None) -> None:
        """`token_s`: seconds per token measured before the first pass (a generating engine's
        warm-up), or None (`warm_up` measures its own)."""
        self.embedder = embedder
        self.outq = outq
        self.engine_id, self.epoch = engine_id, epoch
        self.wake = wake or (lambda: None)
        self.counters = EmbedCounters()
        self._pace = PassPace(embedder.width, token_s)
        self._active_lock = threading.Lock()  # `active` moves on three threads
        self._requests: queue.Queue[Embed | None] = queue.Queue()
        self._ready: queue.Queue[EmbedJob] = queue.Queue()  # lane -> MLX thread
        self._rows: list[tuple[EmbedJob, int]] = []  # the MLX thread's, in arrival order
        threading.Thread(target=self._lane, name="engine-embed", daemon=True).start()

    # ------------------------------------------------------------------ I/O thread

    def submit(self, msg: Embed) -> None:
        self._count_active(1)
        self._requests.put(msg)

    def _count_active(self, n: int) -> None:
        with self._active_lock:
            self.counters.active += n

    def stop(self) -> None:
        self._requests.put(None)

    # ------------------------------------------------------------------ embedding lane

    def _lane(self) -> None:
        while (msg := self._requests.get()) is not None:
            try:
                job = self._prepare(msg)
            except ClientError as e:
                self._fail(msg.request_id, str(e), e.code)
                continue
            except Exception as e:  # a bad request must never hurt the engine
                log.exception("embedding request %s could not be prepared", msg.request_id)
                self._fail(msg.request_id, f"invalid request: {str(e)[:500]}", "invalid_request")
                continue
            self._ready.put(job)
            self.wake()

    def _prepare(self, msg: Embed) -> EmbedJob:
        e = self.embedder
        if msg.query is not None:
            return self._prepare_pairs(msg)
        if msg.input_token_ids:
            inputs = check_token_ids(msg.input_token_ids, e.vocab, e.max_tokens, msg.truncate)
        else:
            for i, text in enumerate(msg.inputs):
                if not text:
                    raise ClientError(f"input[{i}] is empty", "invalid_request")
            inputs = e.tokenize(list(msg.inputs), msg.truncate)
        if not inputs:
            raise ClientError("there is nothing to embed", "invalid_request")
        if e.dimensions and msg.dimensions > e.dimensions:
            raise _too_many_dimensions(msg.dimensions, e.dimensions)
        return EmbedJob(msg.request_id, inputs, msg.dimensions, [None] * len(inputs),
                        len(inputs))

    def _prepare_pairs(self, msg: Embed) -> EmbedJob:
        e = self.embedder
        if not getattr(e, "ranks", False) or msg.query is None:  # the proxy checks it first
            raise ClientError("this model cannot rerank (it is not a cross-encoder)",
                              "invalid_request")
        if not msg.inputs:
            raise ClientError("there are no documents to rank", "invalid_request")
        inputs = cast(PairScorer, e).tokenize_pairs(msg.query, list(msg.inputs))
        return EmbedJob(msg.request_id, inputs, 0, [None] * len(inputs), len(inputs),
                        rerank=True)

    def _fail(self, request_id: str, error: str, code: str) -> None:
        self._count_active(-1)
        self.outq.put(Delta(request_id, finish_reason="error", error=error, error_code=code))

    # ------------------------------------------------------------------ MLX thread

    def serve(self, stop: threading.Event) -> None:
        """An embedding engine's MLX loop: embed whatever is queued until `stop` is set."""
        while not stop.is_set():
            try:
                job = self._ready.get(timeout=0.5)
            except queue.Empty:
                continue
            self._rows.extend((job, i) for i in range(len(job.inputs)))
            self.run_pending()

    def run_pending(self, on_step: Callable[[], None] = lambda: None) -> None:
        """Embed every queued input, up to MAX_STEP_INPUTS per forward pass; requests that
        arrive meanwhile join the next pass. `on_step` hears each pass."""
        while True:
            while True:
                try:
                    job = self._ready.get_nowait()
                except queue.Empty:
                    break
                self._rows.extend((job, i) for i in range(len(job.inputs)))
            if not self._rows:
                return
            window, self._rows = self._rows[:MAX_STEP_INPUTS], self._rows[MAX_STEP_INPUTS:]
            for rerank in (False, True):  # pairs are scored, not embedded: passes of their own
                rows = [r for r in window if r[0].rerank == rerank]
                for step in plan_steps([len(job.inputs[i]) for job, i in rows]):
                    self._embed_step([rows[k] for k in step])
                    on_step()

    def warm_up(self) -> float | None:
        """Two short passes on the MLX thread before serving: the kernels are built and the
        seconds per padded token measured (the pace's first figure). None if that failed."""
        text = " ".join(["warm"] * WARM_UP_WORDS)
        rates: list[float] = []
        try:
            batch = self.embedder.tokenize([text, text[:len(text) // 2]], truncate=True)
            for _ in range(2):
                t0 = time.perf_counter()
                self._forward(batch, rerank=bool(getattr(self.embedder, "ranks", False)))
                rates.append((time.perf_counter() - t0) / _padded_tokens(batch))
        except Exception as e:  # noqa: BLE001  a model that cannot warm up may still serve
            log.warning("embedding warm-up failed (the first request will be slower): %s", e)
            return None
        # its inputs are short enough to count as length 0 (`PassPace.seen` stays 0)
        self._pace.token_s = min(rates)
        return self._pace.token_s

    def _forward(self, batch: list[list[int]], rerank: bool) -> np.ndarray:
        if rerank:
            return cast(PairScorer, self.embedder).score(batch)
        return self.embedder.forward(batch)

    def _embed_step(self, rows: list[tuple[EmbedJob, int]]) -> None:
        c = self.counters
        batch = [job.inputs[i] for job, i in rows]
        padded, longest = _padded_tokens(batch), max(len(x) for x in batch)
        c.pace_s = self._pace.starting_pass(padded, longest)
        c.busy = True
        t0 = time.perf_counter()
        try:
            faults.hit("engine.embed")
            vectors = self._forward(batch, rerank=rows[0][0].rerank)
            took = time.perf_counter() - t0
            self._pace.ended_pass(took, padded, longest)
            c.longest_s = max(c.longest_s, took)
        except ClientError as e:
            self._fail_jobs(rows, str(e), e.code)
            return
        except Exception as e:  # the requests fail, the engine serves on
            log.exception("an embedding step failed")
            self._fail_jobs(rows, f"embedding failed: {str(e)[:500]}", "engine_error")
            return
        finally:
            c.busy = False
        c.steps += 1
        c.peak_batch = max(c.peak_batch, len(rows))
        for (job, i), vector in zip(rows, vectors, strict=True):
            job.vectors[i] = vector
            job.left -= 1
            if job.left == 0 and not job.failed:
                self._finish(job)

    def _fail_jobs(self, rows: list[tuple[EmbedJob, int]], error: str, code: str) -> None:
        jobs = {id(job): job for job, _ in rows if not job.failed}
        for job in jobs.values():
            job.failed = True
            self._fail(job.request_id, error, code)
        self._rows = [(job, i) for job, i in self._rows if not job.failed]

    def _finish(self, job: EmbedJob) -> None:
        matrix = np.stack([v for v in job.vectors if v is not None])
        if job.dimensions:
            if job.dimensions > matrix.shape[1]:
                e = _too_many_dimensions(job.dimensions, matrix.shape[1])
                self._fail(job.request_id, str(e), e.code)
                return
            matrix = normalized(matrix[:, :job.dimensions])
        c = self.counters
        tokens = sum(len(x) for x in job.inputs)
        c.requests += 1
        c.inputs += len(job.inputs)
        c.tokens += tokens
        self._count_active(-1)
        self.outq.put(Embeddings(self.engine_id, self.epoch, job.request_id, matrix.shape[0],
                                 matrix.shape[1], matrix.astype("<f4").tobytes(), tokens))

    # ------------------------------------------------------------------ output thread

    def status(self, status: EngineStatus, model_dir: Path | None) -> EngineStatus:
        """The engine's status with the embedding figures; `model_dir` set for an embedding
        engine (then these are all it does)."""
        c = self.counters
        stats = msgspec.structs.replace(
            status.stats, embed_requests=c.requests, embed_inputs=c.inputs,
            embed_tokens=c.tokens, embed_steps=c.steps, embed_peak_batch=c.peak_batch,
            longest_step_s=round(max(status.stats.longest_step_s, c.longest_s), 4),
            pace_s=round(max(status.stats.pace_s, c.pace_s), 4))
        if model_dir is None:
            return msgspec.structs.replace(status, stats=stats)
        return msgspec.structs.replace(
            status, stats=stats, active=c.active, steps=c.steps, peak_batch=c.peak_batch,
            prompt_tokens_total=c.tokens, context_length=self.embedder.max_tokens,
            model_dir=str(model_dir), capabilities=["embedding", "rerank"]
            if getattr(self.embedder, "ranks", False) else ["embedding"])

    def progress(self) -> tuple[int, bool, float]:
        """The hang watchdog's view of an embedding engine: passes taken, whether one runs,
        and how long it should take."""
        c = self.counters
        return c.steps, c.busy, c.pace_s


def _padded_tokens(batch: list[list[int]]) -> int:
    """What a forward pass over `batch` computes: every input padded to the longest."""
    return len(batch) * max((len(x) for x in batch), default=0)


def _too_many_dimensions(asked: int, has: int) -> ClientError:
    return ClientError(f"`dimensions` is {asked}, but this model's vectors have {has}",
                       "invalid_request")
