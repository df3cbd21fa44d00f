"""A generating engine, whatever its kind (`kinds/`): what every kind that generates shares,
built around the kind once its model is loaded. The MLX thread drives the kind's runner
(`batch/runner.py`) over the RAM prefix cache and the SSD tier (`kv/`), within the KV budget
(`batch/budget.py`); embeddings of the model's hidden states run between generation steps;
flushes copy blocks on the MLX thread between steps and wait on a thread of their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlxd.engine.admit import prompt_batch
from mlxd.engine.admit.prepare import Admitted, Answered, refused
from mlxd.engine.batch.budget import Budget, ceiling, rebudget
from mlxd.engine.batch.handoff import ReleasingInbox, StepOutbox
from mlxd.engine.batch.messages import AbortRequest, AddRequest, Call, StopRunner
from mlxd.engine.batch.runner import Runner
from mlxd.engine.batch.sizing import measure_budget
from mlxd.engine.batch.timing.chunking import step_target
from mlxd.engine.embeddings.batching import Embedding
from mlxd.engine.embeddings.models import CausalLMEmbedder
from mlxd.engine.kinds.base import EngineKind, Host, Lookup
from mlxd.engine.kv import quant
from mlxd.engine.kv.prefix_cache import RestoredPrefix
from mlxd.engine.kv.ssd_tier import SsdTier, open_ssd_tier
from mlxd.engine.load.loader import load_draft, loaded_model, vocab_size
from mlxd.engine.load.warm_up import WarmUp, warm_up
from mlxd.engine.speculative.step import Speculator
from mlxd.engine.stage_clock import NO_CLOCK
from mlxd.engine.state import LoadedModel, StatusTick
from mlxd.engine.wire.status import generating_status
from mlxd.protocol.messages import CacheFlushed, Embed, EngineStatus, FlushCache, Generate
from mlxd.protocol.settings import PROMPT_CACHE_GROUP_GB, PoolShare

log = logging.getLogger("mlxd.engine")


class GeneratingEngine:
    def __init__(self, kind: EngineKind, host: Host, loaded: LoadedModel, runner: Runner,
                 ssd: SsdTier | None, budget: Budget, embedding: Embedding | None,
                 report: str) -> None:
        self.kind, self.host, self.loaded = kind, host, loaded
        self.runner, self.ssd, self.budget = runner, ssd, budget
        self.embedding = embedding
        self.report = report  # how the load went, for the "ready" line
        self.share = host.launch.pool_share
        self.features = kind.features
        self.lookup = Lookup(self._restore, runner.cache.peek)

    @classmethod
    def open(cls, kind: EngineKind, host: Host, model_dir: Path) -> GeneratingEngine:
        """Load the kind's model and build the engine around it, on the MLX thread."""
        launch, settings = host.launch, host.launch.settings
        t0 = time.monotonic()
        weights = kind.load(model_dir, host.progress)
        features = kind.features
        model, tokenizer, config = weights.model, weights.tokenizer, weights.config
        quant.install_for(model, settings, alone=features.kv_quant)
        draft = (load_draft(settings.draft_model, Path(launch.cache_dir), settings.dtype,
                            model, host.progress)
                 if features.speculative and settings.draft_model else None)
        loaded = loaded_model(tokenizer, config)
        loaded_s = time.monotonic() - t0
        stream = generation_stream(launch.tuning.gen_stream)
        warm = settings.warm_up and features.warm_up
        warmed = warm_up(model, loaded, stream, settings) if warm else WarmUp(0.0)
        probe = kind.probe_model(model, loaded)
        ssd = open_ssd_tier(launch, probe, host.ctx, host.endpoints.storage,
                            kind.ssd_namespace())
        persist = ssd.persist_all if ssd is not None else None

        def evicted(entry: Any) -> None:  # RAM eviction persists an entry before it drops it
            if persist is not None and not entry.persisted:
                persist([entry])
        runner_class = kind.runner_class()
        cache_bytes = settings.prompt_cache_bytes
        if cache_bytes is None and not runner_class.auto_cache:
            cache_bytes = int(PROMPT_CACHE_GROUP_GB * 2**30)
        budget = measure_budget(probe, settings.batch, stream, cache_bytes, launch.pool_share,
                                settings.engine_memory)
        log.info("batch: %s", budget.why)
        outbox = host.channels.outq
        runner = runner_class(
            model, sorted(loaded.eos_ids), batch_size=ceiling(settings.batch),
            prefill_step=settings.prefill_step, outbox=outbox, stream=stream, budget=budget,
            context=loaded.context_length, preparing=host.preparing,
            cache_bytes=budget.cache_bytes,
            persist=persist,
            on_evict=evicted if persist else None,
            checkpoint_every=settings.generation_checkpoint,
            speculator=Speculator(settings.num_draft_tokens, draft, settings.prefill_step)
            if features.speculative else None, tuning=launch.tuning, clock=host.clock,
            step_target_s=step_target(launch.hang_timeout), token_s=warmed.token_s)
        if isinstance(outbox, StepOutbox) and not outbox.eager:
            runner.inbox = ReleasingInbox(outbox)  # idle: held tokens go out
        report = (f"loaded in {loaded_s:.1f} s" + (f", warmed up in {warmed.seconds:.1f} s" if warm
                                                   else "") + f"; context {loaded.context_length}")
        engine = cls(kind, host, loaded, runner, ssd, budget, None, report)
        if features.embeddings:  # they run between generation steps
            engine.embedding = Embedding(
                CausalLMEmbedder(model, tokenizer, loaded.context_length,
                                 vocab_size(config), stream),
                outbox, launch.engine_id, launch.epoch,
                wake=lambda: runner.inbox.put(Call(Runner.wake_between)),
                token_s=warmed.token_s, target_s=step_target(launch.hang_timeout))
            runner.between = engine._embed_pass
        return engine

    # ------------------------------------------------------------------ admission lanes

    def prepare(self, msg: Generate, received_at: float) -> Admitted | Answered:
        return self.kind.prepare(msg, self.loaded, self._lookup_for(msg), received_at)

    def _lookup_for(self, msg: Generate) -> Lookup:
        """The tiers as this request asks them: under the stage clock, its tokens are done
        when it asks, and the tiers' answer stamped when it comes."""
        clock = self.host.clock
        if clock is NO_CLOCK:
            return self.lookup
        rid = msg.request_id

        def restore(prompt: list[int]) -> RestoredPrefix | None:
            clock.tokenized(rid)
            try:
                return self._restore(prompt)
            finally:
                clock.tiers_asked(rid)
        return Lookup(restore, self.lookup.peek)

    def prepare_many(self, msgs: list[Generate], received_at: float
                     ) -> Iterator[Admitted | Answered]:
        """Requests a lane found waiting together: their chat prompts tokenized in one call
        where they can be (`prompt_batch`), each then prepared as on its own, in order."""
        if not (self.features.prompt_batch and self.host.launch.tuning.prompt_batch):
            yield from (self.prepare(m, received_at) for m in msgs)
            return
        for msg, tokens in zip(msgs, prompt_batch.chat_tokens(msgs, self.loaded), strict=True):
            yield self.kind.prepare(msg, self.loaded, self._lookup_for(msg), received_at,
                                    tokens)

    def _restore(self, prompt: list[int]) -> RestoredPrefix | None:
        if self.ssd is None or not self.features.restore_from_ssd:
            return None
        return self.ssd.reader.better_than_ram(prompt, self.runner.cache.peek(prompt))

    def admit(self, request: AddRequest) -> None:
        self.runner.inbox.put(request)

    # ------------------------------------------------------------------ the I/O thread's calls

    def abort(self, request_ids: list[str]) -> None:
        if self.embedding is not None:
            self.embedding.abort(request_ids)
        for rid in request_ids:
            self.runner.inbox.put(AbortRequest(rid))

    def embed(self, msg: Embed) -> None:
        if self.embedding is None:
            self.host.channels.outq.put(refused(msg.request_id, "a sharded engine does not "
                                                "embed").deltas[0])
        else:
            self.embedding.submit(msg)

    def set_share(self, share: PoolShare) -> None:
        """The supervisor rebalanced the pool's memory: the MLX thread re-derives the
        budget from the figures measured at load (one line in the log per change)."""
        self.share = share
        self.runner.inbox.put(Call(self._apply_share))

    def _apply_share(self, runner: Runner) -> None:
        old, share = self.budget, self.share
        if old.sizing is None or abs(old.share - share.fraction) < 1e-9:
            return
        self.budget = new = rebudget(old, share)
        runner.set_budget(new)
        log.info("memory share %.0f%% -> %.0f%% (%d other engine(s)): KV budget %.1f -> "
                 "%.1f MiB, prefix cache %.1f MiB; %s", 100 * old.share, 100 * new.share,
                 share.others, old.kv_bytes / 2**20, new.kv_bytes / 2**20,
                 new.cache_bytes / 2**20, runner.counters.batch_why)
        self.host.channels.outq.put(StatusTick())

    def storage_restarted(self) -> None:
        if self.ssd is not None:
            log.warning("the storage worker restarted; its unanswered writes are requeued")
            self.ssd.worker_restarted()

    def progress(self) -> tuple[int, bool, float]:
        c = self.runner.counters
        if self.embedding is not None and self.embedding.counters.busy:  # a pass between steps
            return c.steps, True, max(c.pace_s, self.embedding.counters.pace_s)
        return c.steps, c.busy, c.pace_s

    def served(self) -> int:
        embedded = self.embedding.counters.inputs if self.embedding is not None else 0
        return self.runner.counters.generated_tokens + embedded

    def status(self, status: EngineStatus) -> EngineStatus:
        status = generating_status(status, self.loaded, self.runner, self.ssd)
        if self.embedding is not None:
            status = self.embedding.status(status, None)
        return self.kind.status(status)

    # ------------------------------------------------------------------ the MLX thread

    def run(self, stop: threading.Event) -> None:
        if not stop.is_set():  # a stop during the load: nothing to run
            self.runner.run()

    def _embed_pass(self) -> bool:
        """One embedding pass, after a generation step (the runner's `between`); it counts as
        a step (progress, for the hang watchdog). True while more are queued."""
        def stepped() -> None:
            self.runner.counters.steps += 1
        return self.embedding is not None and self.embedding.run_pass(stepped)

    def close(self) -> None:
        if self.embedding is not None:
            self.embedding.stop()
        if self.ssd is not None:
            self.ssd.close()
        self.kind.close()

    # ------------------------------------------------------------------ stop and flush

    def stop(self, flush_timeout: float) -> None:
        if self.ssd is not None and flush_timeout > 0:
            self._flush_async("shutdown", flush_timeout, then_stop=True)
        else:
            self.runner.inbox.put(StopRunner())

    def flush(self, msg: FlushCache) -> None:
        if self.ssd is None:
            launch = self.host.launch
            self.host.channels.outq.put(CacheFlushed(launch.engine_id, launch.epoch, msg.token,
                                                     0, 0, 0, "the SSD tier is off", "ssd_off"))
        else:
            self._flush_async(msg.token, msg.timeout)

    def _flush_async(self, token: str, timeout: float, then_stop: bool = False) -> None:
        threading.Thread(target=self._flush, args=(token, timeout, then_stop),
                         name="engine-flush", daemon=True).start()

    def _flush(self, token: str, timeout: float, then_stop: bool) -> None:
        """On a flush thread: the copies run on the MLX thread as `Call`s, in rounds."""
        runner, ssd, launch = self.runner, self.ssd, self.host.launch
        assert ssd is not None
        deadline = time.monotonic() + timeout

        def run_on_mlx(fn: Callable[[], int]) -> int | None:
            box: list[int] = []
            done = threading.Event()

            def call(_: Runner) -> None:
                box.append(fn())
                done.set()

            runner.inbox.put(Call(call))
            done.wait(max(0.0, deadline - time.monotonic()))
            return box[0] if box else None

        try:
            r = ssd.flush(run_on_mlx, runner.cache.entries, timeout)
            if r.error_code is not None:
                log.warning("%s flush: the KV cache is not durable (%s): %s", token,
                            r.error_code, r.error)
            self.host.channels.outq.put(CacheFlushed(
                launch.engine_id, launch.epoch, token, r.written, r.failed, ssd.queue_depth,
                r.error, r.error_code, r.unwritten))
        finally:
            if then_stop:
                runner.inbox.put(StopRunner())


def generation_stream(which: str) -> Any:
    """The stream the engine decodes on: one of its own (the default), or (the hidden setting
    `gen_stream` default, for benchmarks/decode_stream.py) the device's default stream, as
    mlx_lm.server decodes on."""
    import mlx.core as mx
    if which == "default":
        return mx.default_stream(mx.default_device())
    return mx.new_stream(mx.default_device())
