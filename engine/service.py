"""Engine glue: the MLX thread (the caller's), an I/O thread that owns the request and control
sockets, and an output thread that detokenizes and sends one message per step.

Used by the engine process (`python -m mlxd.engine`) and, without --isolate, on a thread of the
serving process over inproc:// endpoints.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec
import zmq

from mlxd.engine import admission
from mlxd.engine.admission import ClientError
from mlxd.engine.admission_lanes import AdmissionLanes
from mlxd.engine.output import RequestOutput
from mlxd.engine.runner import (AbortRequest, AddRequest, Call, RequestStarted, RequestsRemoved,
                                Runner, StepTokens, StopRunner)
from mlxd.protocol import codec, exit_codes, faults
from mlxd.protocol.addresses import Endpoints, engine_identity
from mlxd.protocol.messages import (Abort, CacheFlushed, ChildFailed, ChildStates, Delta,
                                    EngineStatus,
                                    FlushCache, Generate, Heartbeat, Hello, Ready, Shutdown,
                                    StepOutput, TokenLogprob)
from mlxd.protocol.models import model_id, model_names

log = logging.getLogger("mlxd.engine")

STATUS_INTERVAL = 0.5


@dataclass
class EngineSettings:
    engine_id: str
    epoch: int
    model: str
    cache_dir: Path
    batch_size: int = 8
    prefill_step: int = 512
    dtype: str = "auto"
    prompt_cache_gb: float = 4.0
    run_dir: Path | None = None  # for shared-memory names
    ssd_root: Path | None = None  # None: no SSD tier
    block_tokens: int = 256
    kv_slots: int = 16
    ssd_verify: bool = True
    generation_checkpoint: int = 0


class _StatusTick:
    pass


class EngineService:
    def __init__(self, settings: EngineSettings, endpoints: Endpoints, ctx: zmq.Context,
                 supervised: bool,
                 on_state: Callable[[str, str | None], None] | None = None) -> None:
        self.s = settings
        self.eps = endpoints
        self.ctx = ctx
        self.supervised = supervised
        self.on_state = on_state
        self.state = "loading"
        self.error: str | None = None
        self.stop_event = threading.Event()
        self.runner: Runner | None = None
        self.tokenizer: Any = None
        self.context_length = 0
        self._token_texts: dict[int, str] = {}
        self.eos_ids: frozenset[int] = frozenset()
        self.outq: "queue.Queue[Any]" = queue.Queue()
        self.ssd: Any = None  # SsdTier when the SSD tier is on
        self.outputs: dict[str, RequestOutput] = {}
        self.max_token_bytes = 0  # the longest token's bytes: bounds how much text fits
        self.lanes = AdmissionLanes(self._prepare, self._hand_over, self._dropped)
        self.identity = engine_identity(settings.engine_id, settings.epoch)
        self._parent = os.getppid()
        self._threads: list[threading.Thread] = []
        self._ctl_out: "queue.Queue[Any]" = queue.Queue()  # control messages for the I/O thread
        self._storage_epoch: int | None = None  # the storage worker's, from ChildStates

    # ------------------------------------------------------------------ MLX thread

    def run(self) -> int:
        """Load the model and run the MLX loop on the calling thread; return an exit code."""
        for target, name in ((self._io_loop, "engine-io"), (self._output_loop, "engine-out")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        try:
            code = self._load_and_serve()
        finally:
            self.stop_event.set()
            self.lanes.stop()
            self.outq.put(_StatusTick())
            for t in self._threads:
                t.join(timeout=5)
        return code

    def _load_and_serve(self) -> int:
        import mlx.core as mx
        from mlxd.engine.model_loader import ModelLoadError, context_length, load_model
        t0 = time.monotonic()
        try:
            faults.hit("engine.load")
            model, tokenizer, config = load_model(self.s.model, self.s.cache_dir, self.s.dtype)
        except (ModelLoadError, faults.FaultInjected) as e:
            log.error("model failed to load: %s", e)
            self._set_state("failed", str(e))
            self._send_control(ChildFailed(self.s.engine_id, self.s.epoch, str(e)))
            time.sleep(0.2)  # let the I/O threads deliver the failure before the process exits
            return exit_codes.CONFIG_ERROR
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.context_length = context_length(config, tokenizer)
        self.max_token_bytes = admission.max_token_bytes(tokenizer)
        from mlxd.engine.constraints import TokenizerCache
        self.grammar_tokenizer = TokenizerCache(
            tokenizer._tokenizer, int(config.get("vocab_size") or len(tokenizer)),
            sorted(self.eos_ids))
        self.tokenizer = tokenizer  # last: admission lanes take it as the sign of readiness
        stream = mx.new_stream(mx.default_device())
        self.ssd = self._open_ssd(model, config)
        persist = self.ssd.persist if self.ssd is not None else None
        self.runner = Runner(model, sorted(self.eos_ids), batch_size=self.s.batch_size,
                             prefill_step=self.s.prefill_step, outbox=self.outq, stream=stream,
                             cache_bytes=int(self.s.prompt_cache_gb * 2**30),
                             on_entry=persist,
                             on_evict=(lambda e: None if e.persisted else persist(e))
                             if persist else None,
                             checkpoint_every=self.s.generation_checkpoint,
                             on_checkpoint=persist)
        log.info("model %s loaded in %.1f s (context %d)", model_id(self.s.model),
                 time.monotonic() - t0, self.context_length)
        self._set_state("ready")
        self._send_control(Ready(self.s.engine_id, self.s.epoch))
        try:
            if not self.stop_event.is_set():  # a stop during the load: nothing to run
                self.runner.run()
        finally:
            if self.ssd is not None:
                self.ssd.close()
        return exit_codes.OK

    def _open_ssd(self, model: Any, config: dict) -> Any:
        if self.s.ssd_root is None or self.s.run_dir is None or not self.eps.storage:
            return None
        from mlxd.engine.model_loader import resolve_model_dir
        from mlxd.engine.ssd_tier import SsdTier, weights_digest
        from mlxd.storage_worker.block_format import Layout
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache
        probe = make_prompt_cache(model)
        if not all(type(c) is KVCache for c in probe):
            log.info("this model's cache is not a plain KV cache: no SSD tier")
            return None
        model(mx.array([[0]]), cache=probe)
        k, v = probe[0].keys, probe[0].values
        dtype = str(k.dtype).split(".")[-1]
        layout = Layout(len(probe), k.shape[1], k.shape[3], v.shape[3], dtype)
        digest = weights_digest(resolve_model_dir(self.s.model, self.s.cache_dir))
        description = (f"v1|{model_id(self.s.model)}|{digest}|{dtype}|{self.s.block_tokens}|"
                       f"mlx {mx.__version__}|{layout}")
        try:
            return SsdTier(root=self.s.ssd_root, layout=layout, description=description,
                           block_tokens=self.s.block_tokens, run_dir=self.s.run_dir,
                           engine_id=self.s.engine_id, epoch=self.s.epoch, slots=self.s.kv_slots,
                           verify=self.s.ssd_verify, ctx=self.ctx, endpoint=self.eps.storage)
        except OSError as e:
            log.error("no SSD tier: cannot create shared memory: %s", e)
            return None

    def stop(self, flush_timeout: float = 10.0) -> None:
        """Stop after making the cache durable (bounded by `flush_timeout`). Never blocks:
        it may run in a signal handler on the MLX thread itself."""
        if self.stop_event.is_set():
            return
        self.stop_event.set()
        if self.runner is None:
            return
        if self.ssd is not None and flush_timeout > 0:
            self._flush_async("shutdown", flush_timeout, then_stop=True)
        else:
            self.runner.inbox.put(StopRunner())

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
            runner.inbox.put(Call(lambda r: (box.append(fn()), done.set())))
            done.wait(max(0.0, deadline - time.monotonic()))
            return box[0] if box else None

        try:
            r = self.ssd.flush(run_on_mlx, runner.cache.entries, timeout)
            if r.error_code is not None:
                log.warning("%s flush: the KV cache is not durable (%s): %s", token,
                            r.error_code, r.error)
            self.outq.put(CacheFlushed(self.s.engine_id, self.s.epoch, token, r.written, r.failed,
                                       self.ssd.queue_depth, r.error, r.error_code, r.unwritten))
        finally:
            if then_stop:
                runner.inbox.put(StopRunner())

    # ------------------------------------------------------------------ I/O thread

    def _io_loop(self) -> None:
        req_codec = codec.to_engine()
        ctl_codec = codec.to_child()
        sup_codec = codec.to_supervisor()
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.IDENTITY, self.identity)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.eps.requests)
        poller = zmq.Poller()
        poller.register(req, zmq.POLLIN)
        ctl = None
        if self.supervised:
            ctl = self.ctx.socket(zmq.DEALER)
            ctl.setsockopt(zmq.IDENTITY, f"engine:{self.s.engine_id}:{self.s.epoch}".encode())
            ctl.setsockopt(zmq.LINGER, 1000)
            ctl.connect(self.eps.control)
            ctl.send(sup_codec.encode(Hello("engine", self.s.engine_id, self.s.epoch, os.getpid())))
            poller.register(ctl, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self.stop_event.is_set():
                events = dict(poller.poll(100))
                if req in events:
                    for _ in range(256):
                        try:
                            data = req.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_request(req_codec, data)
                if ctl is not None:
                    if ctl in events:
                        msg = ctl_codec.decode(ctl.recv())
                        if isinstance(msg, Shutdown):
                            log.info("shutdown requested: %s", msg.reason)
                            self.stop()
                        elif isinstance(msg, ChildStates):
                            self._on_children(msg)
                    while True:
                        try:
                            ctl.send(sup_codec.encode(self._ctl_out.get_nowait()))
                        except queue.Empty:
                            break
                    now = time.monotonic()
                    if now >= next_beat:
                        next_beat = now + STATUS_INTERVAL
                        c = self.runner.counters if self.runner else None
                        ctl.send(sup_codec.encode(Heartbeat(
                            self.s.engine_id, self.s.epoch, c.steps if c else 0,
                            bool(c and c.busy))))
                        if os.getppid() != self._parent:
                            log.error("supervisor is gone; exiting")
                            os._exit(exit_codes.PARENT_GONE)
        finally:
            req.close()
            if ctl is not None:
                ctl.close()

    def _on_children(self, msg: ChildStates) -> None:
        storage = next((c for c in msg.children if c.role == "storage"), None)
        if storage is None:
            return
        seen, self._storage_epoch = self._storage_epoch, storage.epoch
        if seen is not None and storage.epoch != seen and self.ssd is not None:
            log.warning("the storage worker restarted; its unanswered writes are requeued")
            self.ssd.worker_restarted()

    def _send_control(self, msg: Any) -> None:
        self._ctl_out.put(msg)

    def _on_request(self, req_codec: Any, data: bytes) -> None:
        try:
            msg = req_codec.decode(data)
        except msgspec.DecodeError as e:
            log.warning("dropped an undecodable request: %s", e)
            return
        if isinstance(msg, Abort):
            rids = list(self.outputs) + self.lanes.pending() if "*" in msg.request_ids \
                else msg.request_ids
            self.lanes.cancel(rids)
            for rid in rids:
                self._to_runner(AbortRequest(rid))
            return
        if isinstance(msg, FlushCache):
            if self.runner is None or self.ssd is None:
                self.outq.put(CacheFlushed(self.s.engine_id, self.s.epoch, msg.token, 0, 0, 0,
                                           "the model is still loading" if self.ssd else
                                           "the SSD tier is off",
                                           "loading" if self.ssd else "ssd_off"))
            else:
                self._flush_async(msg.token, msg.timeout)
            return
        if isinstance(msg, Generate):
            self.lanes.submit(msg)  # prepared on an admission lane, never on this thread

    # ------------------------------------------------------------------ admission lanes

    def _prepare(self, msg: Generate) -> tuple[RequestOutput, AddRequest] | None:
        """On an admission lane: the request's output state and runner command, or None
        when it was answered here (a client error, a count, nothing left to generate)."""
        try:
            return self._admit(msg, time.monotonic())
        except ClientError as e:
            self.outq.put(Delta(msg.request_id, finish_reason="error", error=str(e),
                                error_code=e.code))
        except Exception as e:  # noqa: BLE001 - a bad request must never hurt the engine
            log.exception("request %s could not be prepared", msg.request_id)
            self.outq.put(Delta(msg.request_id, finish_reason="error",
                                error=f"invalid request: {str(e)[:500]}",
                                error_code="invalid_request"))
        return None

    def _hand_over(self, msg: Generate, prepared: tuple[RequestOutput, AddRequest]) -> None:
        out, add = prepared
        self.outputs[msg.request_id] = out
        # Admission notice first: the proxy may now start its response (errors came before).
        self.outq.put(Delta(msg.request_id, prompt_tokens=out.prompt_tokens))
        self._to_runner(add)

    def _dropped(self, msg: Generate) -> None:
        self.outq.put(Delta(msg.request_id, finish_reason="abort"))

    def _admit(self, msg: Generate, received_at: float
               ) -> tuple[RequestOutput, AddRequest] | None:
        from mlxd.engine.sampling import make_request_sampler
        if self.tokenizer is None:
            raise ClientError("the model is still loading", "engine_loading")
        admission.check_prompt_size(msg, self.context_length, self.max_token_bytes)
        prompt = admission.prompt_tokens(self.tokenizer, msg)
        if msg.count_only:
            self.outq.put(Delta(msg.request_id, prompt_tokens=len(prompt)))
            self.outq.put(Delta(msg.request_id, finish_reason="length", prompt_tokens=len(prompt)))
            return None
        room = admission.room_for(prompt, self.context_length)
        p = msg.sampling
        max_tokens = max(1, min(p.max_tokens, room))
        resumed = list(msg.resume_token_ids)
        out = admission.request_output(self.tokenizer, msg, prompt, self.eos_ids)
        if resumed:
            out.prime(resumed, msg.resume_text_len)
            max_tokens -= len(resumed)
            prompt = prompt + resumed
            if max_tokens < 1:  # it had delivered everything but the finish
                self.outq.put(Delta(msg.request_id, prompt_tokens=out.prompt_tokens))
                self.outq.put(Delta(msg.request_id, finish_reason="length",
                                    prompt_tokens=out.prompt_tokens,
                                    completion_tokens=out.completion_tokens))
                return None
        processors = admission.processors(msg, self.grammar_tokenizer, resumed)
        restored = self._restore(prompt)
        return out, AddRequest(msg.request_id, prompt, max_tokens,
                               make_request_sampler(p, start_position=len(resumed)),
                               processors,
                               restored=(*restored, self.ssd.layout.dtype) if restored else None,
                               received_at=received_at, logprobs=p.logprobs)

    def _restore(self, prompt: list[int]) -> tuple[int, list] | None:
        """KV for the prompt's longest prefix on SSD, if it beats the RAM tier. Whatever goes
        wrong with the disk is a miss: the request is served by prefilling."""
        if self.ssd is None or self.runner is None:
            return None
        try:
            in_ram = self.runner.cache.peek(prompt)
            on_ssd = self.ssd.available(prompt)
            if on_ssd > in_ram:
                return self.ssd.restore(prompt, in_ram)
            if on_ssd == 0:
                self.ssd.stats.misses += 1
        except Exception as e:  # noqa: BLE001
            log.warning("SSD lookup failed, serving without it: %s", e)
            self.ssd.stats.misses += 1
        return None

    def _to_runner(self, cmd: Any) -> None:
        if self.runner is not None:  # before the model loads there is nothing to abort
            self.runner.inbox.put(cmd)

    # ------------------------------------------------------------------ output thread

    def _set_state(self, state: str, error: str | None = None) -> None:
        self.state = state
        self.error = error
        self.outq.put(_StatusTick())
        if self.on_state is not None:
            self.on_state(state, error)

    def _status(self) -> EngineStatus:
        c = self.runner.counters if self.runner else None
        return EngineStatus(
            engine_id=self.s.engine_id, epoch=self.s.epoch, pid=os.getpid(),
            model_id=model_id(self.s.model), model_names=model_names(self.s.model),
            state=self.state, active=c.active if c else 0, peak_batch=c.peak_batch if c else 0,
            steps=c.steps if c else 0, context_length=self.context_length, error=self.error,
            prompt_tokens_total=c.prompt_tokens if c else 0,
            generated_tokens_total=c.generated_tokens if c else 0, model_spec=self.s.model,
            cache=self._cache_stats(), max_token_bytes=self.max_token_bytes)

    def _cache_stats(self) -> dict[str, float]:
        r = self.runner
        if r is None:
            return {}
        c, st = r.counters, r.cache.stats
        return {"ram_bytes": r.cache.nbytes, "ram_entries": len(r.cache),
                "ram_capacity_bytes": r.cache.max_bytes, "ram_hits": st.hits,
                "ram_misses": st.misses, "ram_evictions": st.evictions,
                "prompt_tokens": c.prompt_tokens, "prefilled_tokens": c.prefilled_tokens,
                "cached_tokens": c.cached_tokens, "checkpoints": c.checkpoints,
                "checkpoint_s": round(c.checkpoint_s, 4), "step_s": round(c.step_s, 4),
                "first_tokens": c.first_tokens, "to_admit_s": round(c.to_admit_s, 4),
                "to_first_token_s": round(c.to_first_token_s, 4),
                **self._mlx_memory(), **self._ssd_stats()}

    @staticmethod
    def _mlx_memory() -> dict[str, int]:
        """MLX's own allocator: arrays alive, and freed buffers it keeps for reuse."""
        import mlx.core as mx
        return {"mlx_active_bytes": mx.get_active_memory(),
                "mlx_cache_bytes": mx.get_cache_memory()}

    def _ssd_stats(self) -> dict[str, Any]:
        if self.ssd is None:
            return {"ssd_state": "off"}
        st = self.ssd.stats
        return {**self.ssd.state(),  # ssd_state, ssd_error_code, ssd_retry_in_s, ...
                "ssd_hits": st.hits, "ssd_misses": st.misses,
                "ssd_restored_tokens": st.restored_tokens, "ssd_blocks_queued": st.blocks_queued,
                "ssd_blocks_written": st.blocks_written, "ssd_blocks_existed": st.blocks_existed,
                "ssd_bytes_written": st.bytes_written, "ssd_write_failures": st.write_failures,
                "ssd_skipped_no_slot": st.skipped_no_slot, "ssd_bad_blocks": st.bad_blocks,
                "ssd_bytes": st.disk_bytes, "ssd_blocks": st.disk_blocks,
                "ssd_evicted": st.evicted, "ssd_write_queue": self.ssd.queue_depth}

    def _output_loop(self) -> None:
        out_codec = codec.from_engine()
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        # A PUSH with no proxy connected blocks; never let a dead proxy stall this thread.
        push.setsockopt(zmq.SNDTIMEO, 1000)
        push.connect(self.eps.outputs)

        def send(msg: Any) -> None:
            try:
                push.send(out_codec.encode(msg))
            except zmq.Again:
                log.warning("no proxy is reading engine output; dropped a message")

        self._send_now = send

        next_status = 0.0
        try:
            while True:
                try:
                    item = self.outq.get(timeout=STATUS_INTERVAL)
                except queue.Empty:
                    item = None
                deltas: list[Delta] = []
                while item is not None:
                    self._collect(item, deltas)
                    try:
                        item = self.outq.get_nowait()
                    except queue.Empty:
                        item = None
                if deltas:
                    send(StepOutput(self.s.engine_id, self.s.epoch, deltas))
                now = time.monotonic()
                finished = any(d.finish_reason is not None for d in deltas)
                if now >= next_status or finished or self.stop_event.is_set():
                    next_status = now + STATUS_INTERVAL
                    send(self._status())
                if self.stop_event.is_set() and self.outq.empty():
                    return
        finally:
            push.close()

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _collect(self, item: Any, deltas: list[Delta]) -> None:
        if isinstance(item, StepTokens):
            for rid, token, finish in item.rows:
                out = self.outputs.get(rid)
                if out is None:
                    continue
                delta = out.add(token, finish)
                if delta is None:
                    continue
                if item.logprobs and rid in item.logprobs and delta.token_ids:
                    lp, top = item.logprobs[rid]
                    delta.logprobs = [TokenLogprob(self._token_text(token), lp,
                                                   [(self._token_text(i), v) for i, v in top])]
                deltas.append(delta)
                if delta.finish_reason is not None:
                    del self.outputs[rid]
                    if finish is None:  # a stop string ended it: free the row
                        self.runner.inbox.put(AbortRequest(rid))
        elif isinstance(item, RequestsRemoved):
            for rid in item.request_ids:
                out = self.outputs.pop(rid, None)
                if out is not None:
                    deltas.append(Delta(rid, finish_reason="error" if item.error else "abort",
                                        prompt_tokens=out.prompt_tokens,
                                        completion_tokens=out.completion_tokens,
                                        error=item.error,
                                        error_code="engine_error" if item.error else None))
        elif isinstance(item, RequestStarted):
            out = self.outputs.get(item.request_id)
            if out is not None:
                out.cached_tokens = item.cached_tokens
        elif isinstance(item, Delta):
            deltas.append(item)
        elif isinstance(item, CacheFlushed):
            self._send_now(item)
