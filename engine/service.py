"""An engine's lifecycle: load the model, start the threads (see `state.py` for who owns
what), run the MLX loop on the calling thread, flush the KV cache and stop.

Used by the engine process (`python -m mlxd.engine`) and, without --isolate, on a thread of the
serving process over inproc:// endpoints.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

from mlxd.engine.admit import prepare as admission
from mlxd.engine.admit import prompt_batch
from mlxd.engine.admit.lanes import AdmissionLanes
from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.engine.batch import handoff as step_handoff
from mlxd.engine.batch.budget import ceiling
from mlxd.engine.batch.handoff import ReleasingInbox, StepOutbox
from mlxd.engine.batch.messages import AbortRequest, Call, RequestsRemoved, StepTokens, StopRunner
from mlxd.engine.batch.runner import Runner
from mlxd.engine.embeddings.batching import Embedding
from mlxd.engine.kv.prefix_cache import RestoredPrefix
from mlxd.engine.load import cuda_attention, gil_switch
from mlxd.engine.state import Channels, LoadedModel, Registered, StatusTick
from mlxd.engine.wire.io_thread import Handlers, IoThread
from mlxd.engine.wire.output_thread import OutputThread
from mlxd.engine.wire.status import engine_status
from mlxd.protocol import exit_codes, faults, heap, stage_trace
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.messages import (
    CacheFlushed,
    ChildFailed,
    ChildStates,
    Delta,
    Embed,
    EngineState,
    EngineStatus,
    FlushCache,
    Generate,
    Ready,
    SamplingParams,
    SetMemoryShare,
)
from mlxd.protocol.models import adapters_of, model_id
from mlxd.protocol.settings import EngineLaunch

log = logging.getLogger("mlxd.engine")

SHUTDOWN_FLUSH_S = 10.0
# The warm-up: a greedy chat request (the chat template rendered), then a sampled plain prompt
# (the other sampler path), each alone in the batch as a first request usually is (on a GPU
# kernels are built per shape), each a prefill and a few decode steps. The prompts are short:
# on a CPU a prefill costs seconds. A template that refuses a system message gets the user's
# alone; a model without one gets the plain prompt.
WARM_UP_TOKENS = 2  # a prefill, then one decode step
WARM_UP_CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                 [{"role": "user", "content": "Hi!"}]]
WARM_UP_PROMPT = "Hi"
WARM_UP_SAMPLING = [SamplingParams(max_tokens=WARM_UP_TOKENS),
                    SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=WARM_UP_TOKENS)]


class EngineService:
    def __init__(self, launch: EngineLaunch, endpoints: Endpoints, ctx: zmq.Context,
                 supervised: bool,
                 on_state: Callable[[str, str | None], None] | None = None) -> None:
        self.launch = launch
        self.eps = endpoints
        self.ctx = ctx
        self.on_state = on_state
        self.state: EngineState = "loading"
        self.error: str | None = None
        # while loading: (task, done, total, unit) of the long step under way, for the status
        self.load_progress: tuple[str, int, int, str] | None = None
        # A step's tokens reach the output thread when the MLX thread next waits on MLX.
        self._outbox = StepOutbox()
        self.ch = Channels(outq=self._outbox)
        if not self._outbox.eager:
            step_handoff.install()
        self.model: LoadedModel | None = None  # set once loaded, read-only after
        self.runner: Runner | None = None
        self.ssd: Any = None  # ssd_tier.SsdTier when the SSD tier is on
        self.embedding: Embedding | None = None  # set once loaded
        self.embedding_model_dir: Path | None = None  # set if the model only embeds
        self.vision: Any = None  # vision_engine.VisionAdmission for a vision model
        self.lora: Any = None  # lora.LoraSet when adapters are registered on this base
        self.group: Any = None  # group_leader.GroupLeader: rank 0 of a sharded engine
        self.supervised = supervised
        self.share = launch.pool_share  # the latest the supervisor gave (it changes: a pool)
        self.budget: Any = None  # batch_budget.Budget in force, once measured
        self.lanes = AdmissionLanes(self._prepare, self._deliver, self._dropped,
                                    prepare_many=self._prepare_many if prompt_batch.ON else None)
        self._token_texts: dict[int, str] = {}  # the output thread's cache
        self._storage_epoch: int | None = None  # the storage worker's, from ChildStates
        self._io = IoThread(ctx, endpoints, launch.engine_id, launch.epoch, supervised, self.ch,
                            Handlers(generate=self.lanes.submit, abort=self._abort,
                                     flush=self._flush_request, shutdown=lambda _: self.stop(),
                                     children=self._on_children, progress=self._progress,
                                     embed=self._embed, share=self._on_share))
        self._out = OutputThread(ctx, endpoints.outputs, launch.engine_id, launch.epoch, self.ch,
                                 self._status, lambda: self.runner.inbox if self.runner else None,
                                 self._token_text)

    # ------------------------------------------------------------------ MLX thread

    def run(self) -> int:
        """Load the model and run the MLX loop on the calling thread; return an exit code."""
        gil_switch.apply()
        cuda_attention.apply()
        threads = [threading.Thread(target=t.run, name=name, daemon=True)
                   for t, name in ((self._io, "engine-io"), (self._out, "engine-out"))]
        for t in threads:
            t.start()
        try:
            return self._load_and_serve()
        finally:
            self.ch.stop.set()
            self.lanes.stop()
            if self.embedding is not None:
                self.embedding.stop()
            self.ch.outq.put(StatusTick())
            for t in threads:
                t.join(timeout=5)

    def _load_and_serve(self) -> int:
        import mlx.core as mx

        from mlxd.engine.batch.sizing import measure_budget
        from mlxd.engine.embeddings.models import (
            CausalLMEmbedder,
            load_encoder,
            model_kind,
        )
        from mlxd.engine.kinds.text.lora import AdapterError, apply_adapters
        from mlxd.engine.kinds.vision.model import is_vision_dir, load_vision
        from mlxd.engine.kinds.vision.prompt import VisionAdmission
        from mlxd.engine.kv import quant as kv_quant
        from mlxd.engine.kv.ssd_tier import open_ssd_tier
        from mlxd.engine.load.loader import ModelLoadError, load_model, resolve_model_dir
        launch, settings = self.launch, self.launch.settings
        t0 = time.monotonic()
        try:
            faults.hit("engine.load")
            model_dir = resolve_model_dir(launch.model, Path(launch.cache_dir),
                                          self._load_progress)
            if model_kind(model_dir) == "embed":  # an engine of its own kind: it only embeds
                stream = mx.new_stream(mx.default_device())
                embedding = Embedding(load_encoder(model_dir, settings.dtype, stream),
                                      self.ch.outq, launch.engine_id, launch.epoch)
                return self._serve_embeddings(embedding, model_dir, t0)
            if is_vision_dir(model_dir):  # through mlx-vlm: the text engine, with images
                model, tokenizer, config, parts = load_vision(model_dir, settings.dtype)
                self.vision = VisionAdmission(parts, lambda p: self.runner.cache.peek(p)
                                              if self.runner is not None else 0)
            elif launch.group:  # rank 0 of a sharded engine: it starts and joins the group
                from mlxd.engine.kinds.group.leader import start_group
                self.group = start_group(launch, model_dir, self.supervised)
                model, tokenizer, config = self.group.load()
            else:
                model, tokenizer, config = load_model(str(model_dir), Path(launch.cache_dir),
                                                      settings.dtype, self._load_progress)
            adapters = adapters_of(settings.adapter, launch.model)
            if adapters and (launch.group or getattr(self, "vision", None) is not None):
                raise AdapterError("LoRA adapters apply to text models served by one engine "
                                   "(not to a sharded or a vision model)")
            self.lora = apply_adapters(model, adapters)
            kv_quant.install_for(model, settings, alone=not launch.group
                                 and getattr(self, "vision", None) is None)
            draft = self._load_draft(model) if settings.speculative and settings.draft_model \
                and self.group is None else None
        except (ModelLoadError, AdapterError, faults.FaultInjected) as e:
            log.error("model failed to load: %s", e)
            self._set_state("failed", str(e))
            self.ch.control_out.put(ChildFailed(launch.engine_id, launch.epoch, str(e)))
            time.sleep(0.2)  # let the I/O threads deliver the failure before the process exits
            return exit_codes.CONFIG_ERROR
        loaded = _loaded(tokenizer, config)
        loaded_s = time.monotonic() - t0
        stream = generation_stream()
        warm_up = settings.warm_up and self.group is None  # a group: no lone forward
        warm_s = self._warm_up(model, loaded, stream) if warm_up else 0.0
        probe = model if self.group is None else self.group.probe_model(model, loaded)
        self.ssd = open_ssd_tier(launch, probe, self.ctx, self.eps.storage)
        persist = self.ssd.persist_all if self.ssd is not None else None
        cache_bytes = int(settings.prompt_cache * 2**30)
        budget = measure_budget(probe, settings.batch, stream, cache_bytes, launch.pool_share)
        log.info("batch: %s", budget.why)
        runner = Runner if self.group is None else self.group.runner_class()
        self.runner = runner(model, sorted(loaded.eos_ids), batch_size=ceiling(settings.batch),
                             prefill_step=settings.prefill_step, outbox=self.ch.outq,
                             stream=stream, budget=budget, context=loaded.context_length,
                             preparing=self.lanes.preparing, cache_bytes=cache_bytes,
                             persist=persist,
                             on_evict=(lambda e: None if e.persisted else persist([e]))
                             if persist else None,
                             checkpoint_every=settings.generation_checkpoint,
                             speculator=self._speculator(draft))
        if not self._outbox.eager:
            self.runner.inbox = ReleasingInbox(self._outbox)  # idle: held tokens go out
        self.budget = budget
        self.runner.inbox.put(Call(self._apply_share))  # one that came during the load
        inbox = self.runner.inbox  # embeddings run between generation steps
        self.embedding = Embedding(
            CausalLMEmbedder(model, tokenizer, loaded.context_length,
                             int(config.get("vocab_size") or 0), stream),
            self.ch.outq, launch.engine_id, launch.epoch,
            wake=lambda: inbox.put(Call(self._run_embeddings)))
        self.model = loaded  # admission lanes take this as the sign of readiness
        self.load_progress = None
        log.info("model %s ready in %.1f s (loaded in %.1f s%s; context %d)",
                 model_id(launch.model), time.monotonic() - t0, loaded_s,
                 f", warmed up in {warm_s:.1f} s" if settings.warm_up else "",
                 loaded.context_length)
        heap.freeze_startup_heap()
        self._set_state("ready")
        self.ch.control_out.put(Ready(launch.engine_id, launch.epoch))
        try:
            if not self.ch.stop.is_set():  # a stop during the load: nothing to run
                self.runner.run()
        finally:
            if self.ssd is not None:
                self.ssd.close()
            if self.group is not None:
                self.group.close()
        return exit_codes.OK

    def _load_draft(self, model: Any) -> Any:
        """--draft-model, loaded as the served model is; its vocabulary must be the model's."""
        import mlx.core as mx

        from mlxd.engine.load.loader import ModelLoadError, load_model
        settings = self.launch.settings
        assert settings.draft_model is not None
        draft, _, _ = load_model(settings.draft_model, Path(self.launch.cache_dir),
                                 settings.dtype, self._load_progress)
        probe = mx.array([[0]])
        ours, theirs = model(probe).shape[-1], draft(probe).shape[-1]
        if ours != theirs:
            raise ModelLoadError(f"--draft-model {settings.draft_model} has a vocabulary of "
                                 f"{theirs} tokens, the model {ours}: it cannot draft for it")
        return draft

    def _speculator(self, draft: Any) -> Any:
        """Speculative decoding for rows decoding alone (--speculative), where the engine can
        verify drafts: not a sharded group (its followers repeat plain steps), nor rows with
        LoRA adapters or images (their forward passes take more than tokens)."""
        from mlxd.engine.speculative.step import Speculator
        settings = self.launch.settings
        if not settings.speculative or self.group is not None or self.lora is not None \
                or getattr(self, "vision", None) is not None:
            return None
        return Speculator(settings.num_draft_tokens, draft, settings.prefill_step)

    def _serve_embeddings(self, embedding: Embedding, model_dir: Path, t0: float) -> int:
        """An embedding model's engine: no generation, no KV tiers; the MLX thread embeds."""
        self.embedding, self.embedding_model_dir = embedding, model_dir
        self.load_progress = None
        log.info("embedding model %s ready in %.1f s", model_id(self.launch.model),
                 time.monotonic() - t0)
        heap.freeze_startup_heap()
        self._set_state("ready")
        self.ch.control_out.put(Ready(self.launch.engine_id, self.launch.epoch))
        embedding.serve(self.ch.stop)
        return exit_codes.OK

    def _run_embeddings(self, runner: Runner) -> None:
        """On the MLX thread, between generation steps; each forward pass counts as a step
        (progress, for the hang watchdog)."""
        def stepped() -> None:
            runner.counters.steps += 1
        if self.embedding is not None:
            self.embedding.run_pending(stepped)

    def _load_progress(self, task: str, done: int, total: int, unit: str) -> None:
        self.load_progress = (task, done, total, unit)
        self.ch.outq.put(StatusTick())

    def _warm_up(self, model: Any, loaded: LoadedModel, stream: Any) -> float:
        """One short generation through the real path before the engine says it is ready:
        admission (chat template, tokenizer, sampler), the MLX thread's generator (prefill and
        decode kernels compiled or JIT-built, buffers allocated) and each row's output state
        (detokenizer, stop strings). It runs in a runner of its own, with no RAM or SSD tier
        and its own counters, so no cache content and no figure users see is touched; fault
        points neither fire nor count. A failure is logged: the engine serves anyway."""
        t0 = time.monotonic()
        try:
            with faults.quiet():
                problem = _warm_up(model, loaded, stream, self.launch.settings)
        except Exception as e:  # noqa: BLE001  a model that cannot warm up may still serve
            problem = f"{type(e).__name__}: {e}"
        if problem is not None:
            log.warning("warm-up failed (the first request will be slower): %s", problem)
        return time.monotonic() - t0

    # ------------------------------------------------------------------ stop and flush

    def stop(self, flush_timeout: float = SHUTDOWN_FLUSH_S) -> None:
        """Stop after making the cache durable (bounded by `flush_timeout`). Never blocks:
        it may run in a signal handler on the MLX thread itself."""
        if self.ch.stop.is_set():
            return
        self.ch.stop.set()
        if self.runner is None:
            return
        if self.ssd is not None and flush_timeout > 0:
            self._flush_async("shutdown", flush_timeout, then_stop=True)
        else:
            self.runner.inbox.put(StopRunner())

    def _flush_request(self, msg: FlushCache) -> None:
        if self.runner is None or self.ssd is None:
            self.ch.outq.put(CacheFlushed(
                self.launch.engine_id, self.launch.epoch, msg.token, 0, 0, 0,
                "the model is still loading" if self.ssd else "the SSD tier is off",
                "loading" if self.ssd else "ssd_off"))
        else:
            self._flush_async(msg.token, msg.timeout)

    def _flush_async(self, token: str, timeout: float, then_stop: bool = False) -> None:
        threading.Thread(target=self._flush, args=(token, timeout, then_stop),
                         name="engine-flush", daemon=True).start()

    def _flush(self, token: str, timeout: float, then_stop: bool) -> None:
        runner = self.runner
        assert runner is not None and self.ssd is not None
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
            r = self.ssd.flush(run_on_mlx, runner.cache.entries, timeout)
            if r.error_code is not None:
                log.warning("%s flush: the KV cache is not durable (%s): %s", token,
                            r.error_code, r.error)
            self.ch.outq.put(CacheFlushed(self.launch.engine_id, self.launch.epoch, token,
                                          r.written, r.failed, self.ssd.queue_depth, r.error,
                                          r.error_code, r.unwritten))
        finally:
            if then_stop:
                runner.inbox.put(StopRunner())

    # ------------------------------------------------------------------ admission lanes

    def _prepare(self, msg: Generate) -> Admitted | Answered:
        if self.group is not None:  # a sharded engine: what its followers repeat is noted
            return self.group.prepare(msg, self.model, time.monotonic())
        if self.embedding_model_dir is not None:
            return Answered([Delta(msg.request_id, finish_reason="error", error_code=
                                   "invalid_request", error=f"{model_id(self.launch.model)} is "
                                   "an embedding model: it does not generate text")])
        if self.vision is not None:
            return self.vision.prepare(msg, self.model, self._restore, time.monotonic())
        if msg.images:
            return Answered([Delta(msg.request_id, finish_reason="error", error_code=
                                   "invalid_request", error=f"{model_id(self.launch.model)} "
                                   "does not take images")])
        if msg.adapter:
            return self._prepare_adapter(msg)
        return admission.prepare(msg, self.model, self._restore, time.monotonic())

    def _prepare_many(self, msgs: list[Generate]) -> Iterator[Admitted | Answered]:
        """Requests a lane found waiting together: their chat prompts tokenized in one call
        where they can be (`prompt_batch`), each then prepared as on its own, in order."""
        model = self.model
        if (model is None or self.group is not None or self.vision is not None
                or self.embedding_model_dir is not None):
            yield from (self._prepare(m) for m in msgs)
            return
        if stage_trace.ON:
            for m in msgs:
                stage_trace.stamp_request(m.request_id, "lane", "engine")
        for msg, tokens in zip(msgs, prompt_batch.chat_tokens(msgs, model), strict=True):
            yield (self._prepare(msg) if tokens is None else
                   admission.prepare(msg, model, self._restore, time.monotonic(), tokens))

    def _prepare_adapter(self, msg: Generate) -> Admitted | Answered:
        """An adapter's request: its prompt's first token marked with the adapter (see
        lora.py), so that its rows run the adapter and its cache keys are the adapter's."""
        from mlxd.engine.kinds.text.lora import mark_prompt, unmarked_processors
        index = self.lora.index(msg.adapter) if self.lora is not None else None
        if index is None:
            return Answered([Delta(msg.request_id, finish_reason="error", error_code=
                                   "invalid_request", error=f"{model_id(self.launch.model)} "
                                   f"has no adapter {msg.adapter[:200]!r}")])
        vocab = self.lora.vocab
        result = admission.prepare(
            msg, self.model, lambda p: self._restore(mark_prompt(p, index, vocab)),
            time.monotonic())
        if isinstance(result, Admitted):
            result.request.prompt = mark_prompt(result.request.prompt, index, vocab)
            result.request.processors = unmarked_processors(result.request.processors, vocab)
        return result

    def _restore(self, prompt: list[int]) -> RestoredPrefix | None:
        if self.ssd is None or self.runner is None or self.group is not None:
            return None
        return self.ssd.reader.better_than_ram(prompt, self.runner.cache.peek(prompt))

    def _deliver(self, result: Admitted | Answered) -> None:
        """Under the lanes' lock: the output thread learns of the request before the MLX
        thread can produce its first token."""
        if isinstance(result, Answered):
            if stage_trace.ON and result.deltas:
                stage_trace.forget_request(result.deltas[0].request_id)
            for d in result.deltas:
                self.ch.outq.put(d)
            return
        rid = result.request.request_id
        if stage_trace.ON:
            stage_trace.stamp_request(rid, "prepared", "engine")
        self.ch.outq.put(Registered(rid, result.output, result.notice))
        if self.runner is not None:
            self.runner.inbox.put(result.request)

    def _dropped(self, msg: Generate) -> None:
        if stage_trace.ON:
            stage_trace.forget_request(msg.request_id)
        self.ch.outq.put(Delta(msg.request_id, finish_reason="abort"))

    # ------------------------------------------------------------------ I/O thread's calls

    def _abort(self, request_ids: list[str]) -> None:
        self.lanes.cancel(request_ids)
        if self.runner is not None:  # before the model loads there is nothing to abort
            for rid in request_ids:
                self.runner.inbox.put(AbortRequest(rid))

    def _embed(self, msg: Embed) -> None:
        if self.group is not None:
            self.ch.outq.put(Delta(msg.request_id, finish_reason="error", error_code=
                                   "invalid_request", error="a sharded engine does not embed"))
        elif self.embedding is None:
            self.ch.outq.put(Delta(msg.request_id, finish_reason="error",
                                   error="the model is still loading", error_code="engine_loading"))
        else:
            self.embedding.submit(msg)

    def _on_share(self, msg: SetMemoryShare) -> None:
        """The supervisor rebalanced the pool's memory: the MLX thread re-derives the budget
        (before the runner exists, the load's end applies the latest share)."""
        if msg.epoch != self.launch.epoch:
            return
        self.share = msg.share
        if self.runner is not None:
            self.runner.inbox.put(Call(self._apply_share))

    def _apply_share(self, runner: Runner) -> None:
        """On the MLX thread: the budget for the latest share, from the figures measured at
        load; one line in the log per change."""
        from mlxd.engine.batch.budget import rebudget
        old, share = self.budget, self.share
        if old is None or old.sizing is None or abs(old.share - share.fraction) < 1e-9:
            return
        self.budget = new = rebudget(old, share)
        runner.set_budget(new)
        log.info("memory share %.0f%% -> %.0f%% (%d other engine(s)): KV budget %.1f -> "
                 "%.1f MiB, prefix cache %.1f MiB; %s", 100 * old.share, 100 * new.share,
                 share.others, old.kv_bytes / 2**20, new.kv_bytes / 2**20,
                 new.cache_bytes / 2**20, runner.counters.batch_why)
        self.ch.outq.put(StatusTick())

    def _on_children(self, msg: ChildStates) -> None:
        storage = next((c for c in msg.children if c.role == "storage"), None)
        if storage is None:
            return
        seen, self._storage_epoch = self._storage_epoch, storage.epoch
        if seen is not None and storage.epoch != seen and self.ssd is not None:
            log.warning("the storage worker restarted; its unanswered writes are requeued")
            self.ssd.worker_restarted()

    def _progress(self) -> tuple[int, bool]:
        if self.embedding_model_dir is not None and self.embedding is not None:
            return self.embedding.progress()
        c = self.runner.counters if self.runner is not None else None
        return (c.steps, c.busy) if c is not None else (0, False)

    # ------------------------------------------------------------------ output thread's calls

    def _set_state(self, state: EngineState, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.ch.outq.put(StatusTick())
        if self.on_state is not None:
            self.on_state(state, error)

    def _status(self) -> EngineStatus:
        launch = self.launch
        status = engine_status(launch.engine_id, launch.epoch, launch.model, self.state,
                               self.error, self.model, self.runner, self.ssd)
        if self.embedding is not None:
            status = self.embedding.status(status, self.embedding_model_dir)
        if self.vision is not None:
            status = msgspec.structs.replace(status, capabilities=[*status.capabilities,
                                                                   "vision"])
        if launch.group:
            status = msgspec.structs.replace(status, group=launch.group, group_pids=[
                p.pid for p in (self.group.procs if self.group is not None else [])])
        progress = self.load_progress
        return status if progress is None else msgspec.structs.replace(
            status, load_progress=progress)

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            assert self.model is not None
            text = self._token_texts[token] = self.model.tokenizer.decode([token])
        return text


class _WarmUpOutbox(queue.Queue):
    """The warm-up runner's outbox: each row's tokens go through its output state, as the
    output thread would send them; once every row is done the runner is told to stop."""

    def __init__(self, outputs: dict[str, Any]) -> None:
        super().__init__()
        self.outputs = outputs
        self.inbox: queue.Queue[Any] | None = None  # the runner's, once it exists
        self.error: str | None = None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, StepTokens):
            for rid, token, finish in item.rows:
                out = self.outputs.get(rid)
                if out is None:
                    continue
                delta = out.add(token, finish)
                if finish is not None or (delta is not None and delta.finish_reason):
                    del self.outputs[rid]
        elif isinstance(item, RequestsRemoved):
            self.error = self.error or item.error
            for rid in item.request_ids:
                self.outputs.pop(rid, None)
        if not self.outputs and self.inbox is not None:
            self.inbox.put(StopRunner())


def _warm_up(model: Any, loaded: LoadedModel, stream: Any, settings: Any) -> str | None:
    """Run the warm-up generations on this (the MLX) thread; what went wrong, or None."""
    for i, sampling in enumerate(WARM_UP_SAMPLING):
        rid = f"warm-up-{i}"
        tries = [Generate(rid, sampling, messages=m) for m in WARM_UP_CHATS] if i == 0 else []
        tries.append(Generate(rid, sampling, prompt=WARM_UP_PROMPT))
        for msg in tries:
            result = admission.prepare(msg, loaded, lambda _: None, 0.0)
            if isinstance(result, Admitted):
                break
        if isinstance(result, Answered):
            return "; ".join(d.error or "" for d in result.deltas)
        outbox = _WarmUpOutbox({rid: result.output})
        runner = Runner(model, sorted(loaded.eos_ids), batch_size=ceiling(settings.batch),
                        prefill_step=settings.prefill_step, outbox=outbox, stream=stream)
        outbox.inbox = runner.inbox
        runner.inbox.put(result.request)
        runner.run()
        if outbox.error is not None:
            return outbox.error
    return None


def _loaded(tokenizer: Any, config: dict) -> LoadedModel:
    from mlxd.engine.grammar.processor import TokenizerCache
    from mlxd.engine.load.loader import context_length
    from mlxd.engine.mlx_lm_internals import hf_tokenizer
    eos = frozenset(tokenizer.eos_token_ids)
    return LoadedModel(tokenizer=tokenizer, context_length=context_length(config, tokenizer),
                       eos_ids=eos, max_token_bytes=admission.max_token_bytes(tokenizer),
                       grammar_tokenizer=TokenizerCache(
                           hf_tokenizer(tokenizer), int(config.get("vocab_size") or len(tokenizer)),
                           sorted(eos)))


def generation_stream() -> Any:
    """The stream the engine decodes on: one of its own (the default), or with
    MLXD_GEN_STREAM=default the device's default stream, as mlx_lm.server decodes on (a
    comparison for benchmarks/decode_stream.py, RESULTS.md section 19)."""
    import mlx.core as mx
    if os.environ.get("MLXD_GEN_STREAM", "") == "default":
        return mx.default_stream(mx.default_device())
    return mx.new_stream(mx.default_device())
