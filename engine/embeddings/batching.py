"""An engine's embeddings, in both kinds of engine.

The embedding lane (a thread of its own, never the I/O thread) tokenizes each `Embed` and
checks it; the MLX thread embeds what is queued in forward passes across requests
(`passes.py`: up to 64 inputs, and no longer than a step may be where the rate is known; a
causal LM's long input a chunk a pass) and hands each finished request's vectors to the output
thread as one `Embeddings` (float32 bytes). In an embedding engine the MLX thread runs `serve`;
in a generating engine a queued request wakes the runner, which runs one pass a turn of its
loop, after its generation step: its streams go on decoding between the passes.

A request whose client went away (the proxy's `Abort`) is dropped before the next pass: its
inputs not yet embedded never are, and a long input stops within one chunk.

A pass states its pace to the hang watchdog as a generation step does
(`batch/timing/pace.py`: its padded tokens at the last seen seconds per token, first the
warm-up's), so an engine working through an input that cannot be cut (an encoder's) is not
taken for a hung one.
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
from mlxd.engine.embeddings.models import check_token_ids, normalized
from mlxd.engine.embeddings.passes import MAX_STEP_INPUTS, chunk_tokens, pass_tokens, plan_steps
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


class ChunkedEmbedder(Embedder, Protocol):
    """An embedder that takes a long input a chunk a pass (a causal LM, `chunks` true)."""
    chunks: bool

    def begin(self) -> Any: ...

    def feed(self, running: Any, ids: list[int]) -> None: ...

    def pooled(self, running: Any) -> np.ndarray: ...


class PairScorer(Embedder, Protocol):
    """An embedder that can also rerank (a cross-encoder)."""
    ranks: bool

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[list[int]]: ...

    def score(self, batch: list[list[int]]) -> np.ndarray: ...


@dataclass(eq=False)  # compared by identity: two requests may carry equal inputs
class EmbedJob:
    """One request on its way through the MLX thread."""
    request_id: str
    inputs: list[list[int]]
    dimensions: int
    vectors: list[np.ndarray | None] = field(default_factory=list)
    left: int = 0
    failed: bool = False  # failed or dropped: its remaining inputs are never embedded
    rerank: bool = False  # inputs are (query, document) pairs; vectors are their scores


Row = tuple[EmbedJob, int]  # an input: its job and its index there


@dataclass
class LongInput:
    """A causal LM's input longer than a pass may be, embedded a chunk a pass."""
    job: EmbedJob
    index: int
    running: Any = None  # the embedder's state between chunks (its KV caches, the sum so far)
    done: int = 0  # tokens fed
    chunk: int = 0  # the last chunk's tokens: the next is at most twice that, as a prefill's


@dataclass
class EmbedCounters:
    """Advanced on the MLX thread, read by the output thread (plain integers)."""
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    steps: int = 0
    peak_batch: int = 0
    active: int = 0  # requests queued or being embedded
    abandoned: int = 0  # requests dropped because their client went away
    busy: bool = False
    pace_s: float = 0.0  # how long the pass running now should take (the watchdog's patience)
    longest_s: float = 0.0  # the longest pass


class Embedding:
    def __init__(self, embedder: Embedder, outq: queue.Queue[Any], engine_id: str, epoch: int,
                 wake: Callable[[], None] | None = None, token_s: float | None = None,
                 target_s: float = 0.0) -> None:
        """`token_s`: seconds per token measured before the first pass (a generating engine's
        warm-up), or None (`warm_up` measures its own); `target_s`: how long a pass may be
        where it can be cut (`chunking.step_target`; 0: bounded by tokens alone)."""
        self.embedder = embedder
        self.outq = outq
        self.engine_id, self.epoch = engine_id, epoch
        self.wake = wake or (lambda: None)
        self.target_s = target_s
        self.counters = EmbedCounters()
        self._pace = PassPace(embedder.width, token_s)
        # `active`, the requests in the engine and those abandoned move on three threads
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._abandoned: set[str] = set()  # of `_live`: their clients went away
        self._requests: queue.Queue[Embed | None] = queue.Queue()
        self._ready: queue.Queue[EmbedJob] = queue.Queue()  # lane -> MLX thread
        # the MLX thread's: inputs waiting, in arrival order, and a long input part-way through
        self._rows: list[Row] = []
        self._long: LongInput | None = None
        threading.Thread(target=self._lane, name="engine-embed", daemon=True).start()

    # ------------------------------------------------------------------ I/O thread

    def submit(self, msg: Embed) -> None:
        with self._lock:
            self.counters.active += 1
            self._live.add(msg.request_id)
        self._requests.put(msg)

    def abort(self, request_ids: list[str]) -> None:
        """The clients of these requests went away: what is not embedded yet never is. (Ids
        this engine is not embedding, finished ones among them, are ignored.)"""
        with self._lock:
            self._abandoned.update(r for r in request_ids if r in self._live)

    def stop(self) -> None:
        self._requests.put(None)

    def _ended(self, request_id: str) -> bool:
        """The request left the engine (answered, failed or dropped); False if it already had."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._live.discard(request_id)
            self._abandoned.discard(request_id)
            self.counters.active -= 1
            return True

    def _is_abandoned(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._abandoned

    # ------------------------------------------------------------------ embedding lane

    def _lane(self) -> None:
        while (msg := self._requests.get()) is not None:
            if self._is_abandoned(msg.request_id):
                self._drop(msg.request_id)
                continue
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
        if self._ended(request_id):
            self.outq.put(Delta(request_id, finish_reason="error", error=error,
                                error_code=code))

    def _drop(self, request_id: str) -> None:
        """An abandoned request leaves without an answer: no one reads it."""
        if self._ended(request_id):
            self.counters.abandoned += 1
            log.info("embedding request %s dropped: its client went away", request_id)

    # ------------------------------------------------------------------ MLX thread

    def serve(self, stop: threading.Event) -> None:
        """An embedding engine's MLX loop: embed whatever is queued until `stop` is set."""
        while not stop.is_set():
            if self.run_pass():
                continue
            try:
                job = self._ready.get(timeout=0.5)
            except queue.Empty:
                continue
            self._rows.extend((job, i) for i in range(len(job.inputs)))

    def run_pending(self, on_step: Callable[[], None] = lambda: None) -> None:
        """Embed everything queued (drivers: tests, benchmarks)."""
        while self.run_pass(on_step):
            pass

    def run_pass(self, on_step: Callable[[], None] = lambda: None) -> bool:
        """One forward pass over what is queued, if anything is; `on_step` hears it. True
        while more is left to embed."""
        while True:
            try:
                job = self._ready.get_nowait()
            except queue.Empty:
                break
            self._rows.extend((job, i) for i in range(len(job.inputs)))
        self._drop_abandoned()
        work = self._next_pass()
        if work is None:
            return False
        if isinstance(work, LongInput):
            if self._embed_chunk(work):
                self._long = None
        else:
            self._embed_step(work)
        on_step()
        return bool(self._long or self._rows or not self._ready.empty())

    def _next_pass(self) -> list[Row] | LongInput | None:
        """What the next pass embeds, planned at the rate the last pass showed: the first of
        the passes `plan_steps` makes of the next MAX_STEP_INPUTS waiting inputs (the rest
        wait, to be planned again), or a long input of a causal LM, a chunk a pass."""
        if self._long is not None or not self._rows:
            return self._long
        window = self._rows[:MAX_STEP_INPUTS]
        rerank = window[0][0].rerank  # pairs are scored, not embedded: passes of their own
        rows = [r for r in window if r[0].rerank == rerank]
        most = pass_tokens(self.target_s, self._pace.token_s_at(
            max(len(job.inputs[i]) for job, i in rows)))  # the first pass holds the longest
        if not rerank and getattr(self.embedder, "chunks", False):
            for at, (job, i) in enumerate(self._rows[:MAX_STEP_INPUTS]):
                if not job.rerank and len(job.inputs[i]) > most:
                    del self._rows[at]
                    self._long = LongInput(job, i)
                    return self._long
        first = plan_steps([len(job.inputs[i]) for job, i in rows], max_tokens=most)[0]
        chosen = [rows[k] for k in first]
        taken = {(id(job), i) for job, i in chosen}
        self._rows = [(job, i) for job, i in self._rows if (id(job), i) not in taken]
        return chosen

    def _drop_abandoned(self) -> None:
        with self._lock:
            gone = set(self._abandoned)
        if not gone:
            return
        jobs = {id(job): job for job, _ in self._rows if job.request_id in gone}
        if self._long is not None and self._long.job.request_id in gone:
            jobs[id(self._long.job)] = self._long.job
        for job in jobs.values():
            job.failed = True
            self._drop(job.request_id)
        self._forget_failed()

    def _forget_failed(self) -> None:
        """Inputs of failed or dropped jobs leave the queue (a long one its caches too)."""
        self._rows = [(job, i) for job, i in self._rows if not job.failed]
        if self._long is not None and self._long.job.failed:
            self._long = None

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

    def _timed_pass(self, rows: list[Row], padded: int, longest: int,
                    run: Callable[[], Any]) -> Any:
        """`run()` as a pass of `padded` tokens reaching `longest`: paced for the watchdog,
        timed for the next pace; None if it failed (its jobs failed with it)."""
        c = self.counters
        c.pace_s = self._pace.starting_pass(padded, longest)
        c.busy = True
        t0 = time.perf_counter()
        try:
            faults.hit("engine.embed")
            out = run()
            took = time.perf_counter() - t0
            self._pace.ended_pass(took, padded, longest)
            c.longest_s = max(c.longest_s, took)
        except ClientError as e:
            self._fail_jobs(rows, str(e), e.code)
            return None
        except Exception as e:  # the requests fail, the engine serves on
            log.exception("an embedding step failed")
            self._fail_jobs(rows, f"embedding failed: {str(e)[:500]}", "engine_error")
            return None
        finally:
            c.busy = False
        c.steps += 1
        return out

    def _embed_step(self, rows: list[Row]) -> None:
        batch = [job.inputs[i] for job, i in rows]
        vectors = self._timed_pass(rows, _padded_tokens(batch), max(len(x) for x in batch),
                                   lambda: self._forward(batch, rerank=rows[0][0].rerank))
        if vectors is None:
            return
        c = self.counters
        c.peak_batch = max(c.peak_batch, len(rows))
        for (job, i), vector in zip(rows, vectors, strict=True):
            self._embedded(job, i, vector)

    def _embed_chunk(self, long: LongInput) -> bool:
        """The next chunk of a long input; True once it is done (embedded, or failed)."""
        embedder = cast(ChunkedEmbedder, self.embedder)
        ids = long.job.inputs[long.index]
        size = chunk_tokens(self.target_s, self._pace.token_s_at(long.done))
        piece = ids[long.done:long.done + (min(size, 2 * long.chunk) if long.chunk else size)]
        long.chunk = len(piece)

        def feed() -> bool:
            if long.running is None:
                long.running = embedder.begin()
            embedder.feed(long.running, piece)
            return True
        if self._timed_pass([(long.job, long.index)], len(piece), long.done + len(piece),
                            feed) is None:
            return True
        long.done += len(piece)
        self.counters.peak_batch = max(self.counters.peak_batch, 1)
        if long.done < len(ids):
            return False
        self._embedded(long.job, long.index, embedder.pooled(long.running))
        long.running = None  # its caches go now, not when the plan is next rebuilt
        return True

    def _embedded(self, job: EmbedJob, i: int, vector: np.ndarray) -> None:
        job.vectors[i] = vector
        job.left -= 1
        if job.left == 0 and not job.failed:
            self._finish(job)

    def _fail_jobs(self, rows: list[Row], error: str, code: str) -> None:
        jobs = {id(job): job for job, _ in rows if not job.failed}
        for job in jobs.values():
            job.failed = True
            self._fail(job.request_id, error, code)
        self._forget_failed()

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
        if self._ended(job.request_id):
            self.outq.put(Embeddings(self.engine_id, self.epoch, job.request_id,
                                     matrix.shape[0], matrix.shape[1],
                                     matrix.astype("<f4").tobytes(), tokens))

    # ------------------------------------------------------------------ output thread

    def status(self, status: EngineStatus, model_dir: Path | None) -> EngineStatus:
        """The engine's status with the embedding figures; `model_dir` set for an embedding
        engine (then these are all it does)."""
        c = self.counters
        stats = msgspec.structs.replace(
            status.stats, embed_requests=c.requests, embed_inputs=c.inputs,
            embed_tokens=c.tokens, embed_steps=c.steps, embed_peak_batch=c.peak_batch,
            embed_abandoned=c.abandoned,
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
