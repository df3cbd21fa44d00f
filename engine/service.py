"""An engine's lifecycle: start the threads (see `state.py` for who owns what), load the model
into an engine of its kind (`kinds/`) on the calling thread, which then runs its MLX loop,
and stop. What differs between kinds of engine is theirs; this keeps the threads and states.

Used by the engine process (`python -m mlxd.engine`) and, without --isolate, on a thread of the
serving process over inproc:// endpoints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import zmq

from mlxd.engine.admit.lanes import AdmissionLanes, small_lane_threads
from mlxd.engine.admit.prepare import Admitted, Answered, refused
from mlxd.engine.batch import handoff
from mlxd.engine.batch.handoff import StepOutbox
from mlxd.engine.kinds.base import Engine, Host
from mlxd.engine.load import cuda_attention, gil_switch
from mlxd.engine.load.loader import ModelLoadError
from mlxd.engine.stage_clock import request_clock
from mlxd.engine.state import Channels, Registered, StatusTick
from mlxd.engine.wire.io_thread import Handlers, IoThread
from mlxd.engine.wire.output_thread import OutputThread
from mlxd.engine.wire.status import base_status
from mlxd.protocol import exit_codes, faults, heap
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
    SetMemoryShare,
)
from mlxd.protocol.models import model_id
from mlxd.protocol.settings import EngineLaunch

log = logging.getLogger("mlxd.engine")
SHUTDOWN_FLUSH_S = 10.0


class EngineService:
    def __init__(self, launch: EngineLaunch, endpoints: Endpoints, ctx: zmq.Context,
                 supervised: bool,
                 on_state: Callable[[str, str | None], None] | None = None) -> None:
        self.launch = launch
        self.on_state = on_state
        self.state: EngineState = "loading"
        self.error: str | None = None
        # while loading: (task, done, total, unit) of the long step under way, for the status
        self.load_progress: tuple[str, int, int, str] | None = None
        # A step's tokens reach the output thread when the MLX thread next waits on MLX.
        self.ch = Channels(outq=StepOutbox(eager=launch.tuning.eager_handoff))
        self.engine: Engine | None = None  # set once loaded; its `loaded` marks readiness
        self.share = launch.pool_share  # the latest the supervisor gave (it changes: a pool)
        self.clock = request_clock()  # the stage clock's hooks (no-ops when it is off)
        self.lanes = AdmissionLanes(self._prepare, self._deliver, self._dropped,
                                    small_lane_threads(launch.tuning.admit_threads),
                                    prepare_many=self._prepare_many, clock=self.clock)
        self._token_texts: dict[int, str] = {}  # the output thread's cache
        self._storage_epoch: int | None = None  # the storage worker's, from ChildStates
        self.host = Host(launch, supervised, ctx, endpoints, self.ch, self.lanes.preparing,
                         self._load_progress, self.clock)
        self._io = IoThread(ctx, endpoints, launch.engine_id, launch.epoch, supervised, self.ch,
                            Handlers(generate=self.lanes.submit, abort=self._abort,
                                     flush=self._flush, shutdown=lambda _: self.stop(),
                                     children=self._on_children, progress=self._progress,
                                     embed=self._embed, share=self._on_share,
                                     served=lambda: self.engine.served() if self.engine else 0))
        self._out = OutputThread(ctx, endpoints.outputs, launch.engine_id, launch.epoch, self.ch,
                                 self._status, lambda rid: self._abort([rid]), self._token_text)

    # ------------------------------------------------------------------ MLX thread

    def run(self) -> int:
        """Load the model and run the MLX loop on the calling thread; return an exit code."""
        gil_switch.apply(self.launch.tuning.gil_switch_us)
        cuda_attention.apply()  # before the model's first attention
        threads = [threading.Thread(target=t.run, name=name, daemon=True)
                   for t, name in ((self._io, "engine-io"), (self._out, "engine-out"))]
        for t in threads:
            t.start()
        try:
            return self._load_and_serve()
        except Exception as e:  # a bug: isolated, a crash (restarted); in-process, a failed model
            if self.host.supervised:
                raise
            return self._failed(f"unexpected error ({type(e).__name__}: {str(e)[:200]})", e)
        finally:
            self.ch.stop.set()
            self.lanes.stop()
            self.ch.outq.put(StatusTick())
            for t in threads:
                t.join(timeout=5)

    def _load_and_serve(self) -> int:
        launch = self.launch
        t0 = time.monotonic()
        try:
            from mlxd.engine.kinds import open_engine  # checks mlx-lm's version on import
            if not launch.tuning.eager_handoff:
                handoff.install()
            engine = open_engine(self.host)
        except ImportError as e:  # an mlx-lm it was not written for: one line, no retry
            return self._failed(str(e))
        except (ModelLoadError, faults.FaultInjected) as e:  # AdapterError, KvQuantError too
            return self._failed(str(e))
        self.engine = engine
        engine.set_share(self.share)  # one that came during the load
        self.load_progress = None
        log.info("model %s ready in %.1f s (%s)", model_id(launch.model),
                 time.monotonic() - t0, engine.report)
        heap.freeze_startup_heap(launch.tuning.gc_freeze)
        self._set_state("ready")
        self.ch.control_out.put(Ready(launch.engine_id, launch.epoch))
        try:
            engine.run(self.ch.stop)
        finally:
            engine.close()
        return exit_codes.OK

    def _failed(self, why: str, exc: Exception | None = None) -> int:
        log.error("model failed to load: %s", why, exc_info=exc)
        self._set_state("failed", why)
        self.ch.control_out.put(ChildFailed(self.launch.engine_id, self.launch.epoch, why))
        time.sleep(0.2)  # let the I/O threads deliver the failure before the process exits
        return exit_codes.CONFIG_ERROR

    def _load_progress(self, task: str, done: int, total: int, unit: str) -> None:
        self.load_progress = (task, done, total, unit)
        self.ch.outq.put(StatusTick())

    # ------------------------------------------------------------------ stop and flush

    def stop(self, flush_timeout: float = SHUTDOWN_FLUSH_S) -> None:
        """Stop after making the cache durable (bounded by `flush_timeout`). Never blocks:
        it may run in a signal handler on the MLX thread itself."""
        if self.ch.stop.is_set():
            return
        self.ch.stop.set()
        if self.engine is not None:
            self.engine.stop(flush_timeout)

    def _flush(self, msg: FlushCache) -> None:
        if self.engine is not None:
            self.engine.flush(msg)
            return
        self.ch.outq.put(CacheFlushed(self.launch.engine_id, self.launch.epoch, msg.token, 0,
                                      0, 0, "the model is still loading", "loading"))

    # ------------------------------------------------------------------ admission lanes

    def _prepare(self, msg: Generate) -> Admitted | Answered:
        engine = self.engine
        if engine is None:
            return refused(msg.request_id, "the model is still loading", "engine_loading")
        return engine.prepare(msg, time.monotonic())

    def _prepare_many(self, msgs: list[Generate]) -> Iterator[Admitted | Answered]:
        engine = self.engine
        if engine is None:
            return (self._prepare(m) for m in msgs)
        return engine.prepare_many(msgs, time.monotonic())

    def _deliver(self, result: Admitted | Answered) -> None:
        """Under the lanes' lock: the output thread learns of the request before the MLX
        thread can produce its first token."""
        if isinstance(result, Answered):
            self.clock.forget([d.request_id for d in result.deltas[:1]])
            for d in result.deltas:
                self.ch.outq.put(d)
            return
        rid = result.request.request_id
        self.clock.prepared(rid)
        self.ch.outq.put(Registered(rid, result.output, result.notice))
        if self.engine is not None:
            self.engine.admit(result.request)

    def _dropped(self, msg: Generate) -> None:
        self.clock.forget([msg.request_id])
        self.ch.outq.put(Delta(msg.request_id, finish_reason="abort"))

    # ------------------------------------------------------------------ I/O thread's calls

    def _abort(self, request_ids: list[str]) -> None:
        self.lanes.cancel(request_ids)
        if self.engine is not None:  # before the model loads there is nothing to abort
            self.engine.abort(request_ids)

    def _embed(self, msg: Embed) -> None:
        if self.engine is None:
            self.ch.outq.put(refused(msg.request_id, "the model is still loading",
                                     "engine_loading").deltas[0])
        else:
            self.engine.embed(msg)

    def _on_share(self, msg: SetMemoryShare) -> None:
        """The supervisor rebalanced the pool's memory (before the engine exists, the load's
        end applies the latest share)."""
        if msg.epoch != self.launch.epoch:
            return
        self.share = msg.share
        if self.engine is not None:
            self.engine.set_share(msg.share)

    def _on_children(self, msg: ChildStates) -> None:
        storage = next((c for c in msg.children if c.role == "storage"), None)
        if storage is None:
            return
        seen, self._storage_epoch = self._storage_epoch, storage.epoch
        if seen is not None and storage.epoch != seen and self.engine is not None:
            self.engine.storage_restarted()

    def _progress(self) -> tuple[int, bool, float]:
        return self.engine.progress() if self.engine is not None else (0, False, 0.0)

    # ------------------------------------------------------------------ output thread's calls

    def _set_state(self, state: EngineState, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.ch.outq.put(StatusTick())
        if self.on_state is not None:
            self.on_state(state, error)

    def _status(self) -> EngineStatus:
        status = base_status(self.launch, self.state, self.error)
        if self.engine is not None:
            status = self.engine.status(status)
        progress = self.load_progress
        return status if progress is None else msgspec.structs.replace(
            status, load_progress=progress)

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            assert self.engine is not None and self.engine.loaded is not None
            text = self._token_texts[token] = self.engine.loaded.tokenizer.decode([token])
        return text
