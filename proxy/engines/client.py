"""The proxy's side of the engine channel (runs in the proxy): a ROUTER for requests, a PULL
for outputs.

Keeps a record per engine (learned from the engines' own periodic status, so a respawned proxy
finds running engines without asking) and per in-flight request (its queue of deltas and what
has been delivered, which is what a later transparent resume needs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import cast

import zmq
import zmq.asyncio

from mlxd.protocol import codec, stage_trace
from mlxd.protocol.addresses import Endpoints, engine_identity, make_private
from mlxd.protocol.messages import (
    Abort,
    CacheFlushed,
    ChildInfo,
    ChildStates,
    Delta,
    Embed,
    Embeddings,
    EngineStatus,
    FlushCache,
    Generate,
    StepOutput,
)
from mlxd.protocol.models import model_id, model_names
from mlxd.proxy.engines.sent_images import SentImages

log = logging.getLogger("mlxd.proxy")

STALE_AFTER = 5.0  # seconds without a status from a ready engine before it counts as gone
# Supervisor states in which an engine runs nothing (its requests have ended).
DOWN_STATES = ("backoff", "failed", "stopping", "stopped")


@dataclass
class EngineRecord:
    engine_id: str
    spec: str
    names: list[str]
    model_id: str
    epoch: int = -1
    status: EngineStatus | None = None
    last_seen: float = 0.0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    child: ChildInfo | None = None  # the supervisor's view (None without --isolate)
    failed_at: float | None = None  # when an on-demand load failed (the entry expires)
    failed_reason: str | None = None
    min_epoch: int = 0  # supervisor views of older epochs are stale (a reload started)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake whoever waits for this engine's state to change."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> None:
        await asyncio.wait_for(self._changed.wait(), timeout)

    async def next_change(self) -> None:
        """Until the next `notify`."""
        await self._changed.wait()

    @property
    def state(self) -> str:
        if self.failed_at is not None:
            return "failed"
        c = self.child
        if c is not None:
            if c.state in DOWN_STATES:
                return c.state
            if c.epoch > self.epoch or self.status is None:
                return "starting"
        if self.status is None:
            return "starting"
        if self.status.state == "ready" and time.monotonic() - self.last_seen > STALE_AFTER:
            return "unresponsive"
        return self.status.state

    @property
    def error(self) -> str | None:
        if self.failed_reason:
            return self.failed_reason
        if self.child is not None and self.child.reason:
            return self.child.reason
        return self.status.error if self.status else None

    @property
    def identity(self) -> bytes:
        return engine_identity(self.engine_id, self.epoch)


@dataclass
class RequestStream:
    request_id: str
    engine: EngineRecord
    epoch: int
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    finished: bool = False
    # An Embed's answer; its arrival is announced on `queue` by a delta that finishes it
    embeddings: Embeddings | None = None


class EngineGone(Exception):
    pass


class EngineClient:
    def __init__(self, ctx: zmq.asyncio.Context, endpoints: Endpoints,
                 models: dict[str, str]) -> None:
        """`models` maps engine id -> model spec for every configured model."""
        self._ctx = ctx
        self._eps = endpoints
        self.engines: dict[str, EngineRecord] = {
            eid: EngineRecord(eid, spec, model_names(spec), model_id(spec))
            for eid, spec in models.items()}
        self.streams: dict[str, RequestStream] = {}
        self.sent_images = SentImages()  # which images each engine process holds
        self.children: list[ChildInfo] = []
        self._flushes: dict[str, asyncio.Future] = {}
        self._router: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._enc = codec.to_engine()
        self._dec = codec.from_engine()

    async def start(self) -> None:
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self._eps.requests)
        make_private(self._eps.requests)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._eps.outputs)
        make_private(self._eps.outputs)
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-outputs")
        self._watcher = asyncio.create_task(self._watch_streams(), name="stream-watcher")

    @property
    def _requests(self) -> zmq.asyncio.Socket:
        """The request ROUTER (bound by `start`)."""
        assert self._router is not None, "EngineClient.start() was not called"
        return self._router

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        for s in (self._router, self._pull):
            if s is not None:
                s.close()

    # ---------------------------------------------------------------- routing

    def find(self, name: str | None) -> EngineRecord | None:
        if not name:
            return next(iter(self.engines.values()), None)
        for rec in self.engines.values():
            if name in rec.names:
                return rec
        return None

    async def submit(self, engine: EngineRecord, msg: Generate | Embed) -> RequestStream:
        stream = RequestStream(msg.request_id, engine, engine.epoch)
        self.streams[msg.request_id] = stream
        try:
            await self._requests.send_multipart([engine.identity, self._enc.encode(msg)])
        except zmq.ZMQError as e:
            del self.streams[msg.request_id]
            raise EngineGone(f"engine {engine.engine_id} is not reachable: {e}") from e
        return stream

    async def abort(self, stream: RequestStream) -> None:
        self.streams.pop(stream.request_id, None)
        if stream.finished:
            return
        stream.finished = True
        try:
            await self._requests.send_multipart(
                [stream.engine.identity, self._enc.encode(Abort([stream.request_id]))])
        except zmq.ZMQError:
            pass  # the engine is gone; nothing runs to abort

    def alive(self, stream: RequestStream) -> bool:
        """Under the supervisor, its snapshot is the one authority on an engine's death (a
        hung engine is killed by its watchdog, then resumed like a crashed one): a newer epoch
        or a down state. Without it, an engine that stopped reporting counts as gone."""
        rec = stream.engine
        if rec.epoch != stream.epoch:
            return False
        if rec.child is not None:
            return rec.child.epoch == stream.epoch and rec.child.state not in DOWN_STATES
        return rec.state in ("ready", "loading")

    async def _watch_streams(self) -> None:
        """Once a second: end the requests of engines that died without a snapshot saying so,
        so no stream waits forever."""
        while True:
            await asyncio.sleep(1.0)
            for rid, stream in list(self.streams.items()):
                if not self.alive(stream):
                    del self.streams[rid]
                    stream.finished = True
                    stream.queue.put_nowait(Delta(
                        rid, finish_reason="error", error_code="engine_crashed",
                        error=f"the engine serving {stream.engine.model_id} crashed while "
                              "running this request"))

    def record(self, engine_id: str, spec: str) -> EngineRecord:
        rec = self.engines.get(engine_id)
        if rec is None:
            rec = EngineRecord(engine_id, spec, model_names(spec), model_id(spec))
            self.engines[engine_id] = rec
        return rec

    def apply_children(self, msg: ChildStates) -> None:
        """The supervisor's snapshot: engine deaths end their requests at once."""
        for info in msg.children:
            if info.role != "engine":
                continue
            if info.child_id not in self.engines and info.state in ("stopping", "stopped"):
                continue  # an engine on its way out that this proxy forgot or never knew
            rec = self.record(info.child_id, info.model)
            if info.epoch < rec.min_epoch:
                continue
            rec.child = info
            if info.state in DOWN_STATES:
                self.fail_streams(rec, None, f"the engine serving {rec.model_id} stopped while "
                                  f"running this request ({info.last_exit or info.state})")
            elif info.epoch > rec.epoch:
                self.fail_streams(rec, info.epoch, f"the engine serving {rec.model_id} crashed "
                                                   "while running this request")
            self._update_ready(rec)
            rec.notify()
        self.children = list(msg.children)

    def fail_streams(self, rec: EngineRecord, live_epoch: int | None, message: str) -> None:
        """End every request on `rec` that is not on `live_epoch` (None: all of them)."""
        for rid, stream in list(self.streams.items()):
            if stream.engine is rec and stream.epoch != live_epoch:
                del self.streams[rid]
                stream.finished = True
                stream.queue.put_nowait(Delta(rid, finish_reason="error", error=message,
                                              error_code="engine_crashed"))

    async def abort_everything(self, message: str) -> int:
        """End every running request with `message` (code `shutdown`); returns how many."""
        streams = list(self.streams.values())
        for stream in streams:
            self.streams.pop(stream.request_id, None)
            stream.finished = True
            stream.queue.put_nowait(Delta(stream.request_id, finish_reason="error",
                                          error=message, error_code="shutdown"))
        for rec in {s.engine.engine_id: s.engine for s in streams}.values():
            await self._abort_all(rec)
        return len(streams)

    def forget(self, engine_id: str) -> None:
        """Drop an engine's record (an unloaded or expired failed on-demand model)."""
        rec = self.engines.pop(engine_id, None)
        if rec is not None:
            rec.notify()

    @staticmethod
    def _update_ready(rec: EngineRecord) -> None:
        if rec.state in ("ready", "failed"):
            rec.ready.set()
        else:
            rec.ready.clear()

    async def flush(self, rec: EngineRecord, timeout: float) -> CacheFlushed:
        """Ask one engine to make its cache durable; wait for its answer, or until that engine
        dies or is replaced (its unwritten blocks died with its memory: no answer will come)."""
        import uuid
        token = uuid.uuid4().hex
        epoch = rec.epoch
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._flushes[token] = fut
        deadline = time.monotonic() + timeout + 5
        try:
            await self._requests.send_multipart(
                [rec.identity, self._enc.encode(FlushCache(token, timeout))])
            while not fut.done():
                if self._replaced(rec, epoch):
                    return CacheFlushed(rec.engine_id, epoch, token, 0, 0, 0,
                                        f"the engine serving {rec.model_id} stopped or restarted "
                                        "before it answered; what it had not written is lost",
                                        "engine_restarted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer within {timeout + 5:g} s")
                change = asyncio.ensure_future(rec.next_change())
                try:
                    await asyncio.wait((fut, change), timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    change.cancel()
            return cast(CacheFlushed, fut.result())
        except (TimeoutError, zmq.ZMQError) as e:
            return CacheFlushed(rec.engine_id, rec.epoch, token, 0, 0, 0,
                                f"no answer from the engine: {e!r}")
        finally:
            self._flushes.pop(token, None)

    def _replaced(self, rec: EngineRecord, epoch: int) -> bool:
        """Whether the engine process that had `epoch` is gone or going without answering:
        exited, another epoch seen, or its record dropped. A stopping engine still answers
        (it flushes on its way out)."""
        if rec.epoch != epoch or self.engines.get(rec.engine_id) is not rec:
            return True
        child = rec.child
        return child is not None and (child.epoch > epoch or
                                      child.state in ("backoff", "failed", "stopped"))

    def _abort_all_now(self, rec: EngineRecord) -> None:
        assert self._requests is not None
        try:  # pyzmq sends at once when it can: the order with later sends is kept
            sent = self._requests.send_multipart([rec.identity, self._enc.encode(Abort(["*"]))])
        except zmq.ZMQError:
            return
        # pyzmq's asyncio sockets return a Future (typed as an Awaitable): retrieve its
        # exception so a failed send is not reported as never retrieved.
        future = cast("asyncio.Future[None]", sent)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _abort_all(self, rec: EngineRecord) -> None:
        try:
            await self._requests.send_multipart([rec.identity, self._enc.encode(Abort(["*"]))])
        except zmq.ZMQError:
            pass

    # ---------------------------------------------------------------- outputs

    async def _read_outputs(self) -> None:
        pull = self._pull
        assert pull is not None
        while True:
            data = await pull.recv()
            received = stage_trace.now() if stage_trace.ON else 0
            try:
                msg = self._dec.decode(data)
            except Exception:  # noqa: BLE001
                log.warning("dropped an undecodable engine message")
                continue
            match msg:
                case StepOutput(epoch=epoch, deltas=deltas):
                    if received:
                        from mlxd.proxy.stage_trace import arrived
                        arrived(deltas, received)
                    self._on_deltas(epoch, deltas)
                case EngineStatus():
                    self._on_status(msg)
                case CacheFlushed(token=token):
                    fut = self._flushes.pop(token, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                case Embeddings():
                    self._on_embeddings(msg)

    def _on_deltas(self, epoch: int, deltas: list[Delta]) -> None:
        for d in deltas:
            stream = self.streams.get(d.request_id)
            if stream is None or stream.epoch != epoch:
                continue
            if d.finish_reason is not None:
                stream.finished = True
                del self.streams[d.request_id]
            stream.queue.put_nowait(d)

    def _on_embeddings(self, msg: Embeddings) -> None:
        stream = self.streams.get(msg.request_id)
        if stream is None or stream.epoch != msg.epoch:
            return
        stream.embeddings = msg
        stream.finished = True
        del self.streams[msg.request_id]
        stream.queue.put_nowait(Delta(msg.request_id, finish_reason="stop",
                                      prompt_tokens=msg.prompt_tokens))

    def _on_status(self, st: EngineStatus) -> None:
        rec = self.engines.get(st.engine_id)
        if rec is None:
            if st.state in ("stopping", "failed"):
                return  # an engine on its way out that this proxy forgot or never knew
            rec = self.record(st.engine_id, st.model_spec)
        if st.epoch < rec.epoch:
            return  # a stale message from an engine's earlier life
        first_sight = st.epoch != rec.epoch or rec.status is None
        changed = first_sight or rec.status is None or rec.status.state != st.state
        if st.epoch > rec.epoch:
            self.fail_streams(rec, st.epoch, f"the engine serving {rec.model_id} restarted")
        rec.epoch = st.epoch
        rec.status = st
        rec.last_seen = time.monotonic()
        if first_sight and st.active:
            # Rows of an earlier proxy that died: nobody reads them any more. Sent now, before
            # the engine counts as ready here, so it reaches the engine ahead of any request of
            # this proxy (one socket keeps the order) and never aborts one of ours.
            self._abort_all_now(rec)
        self._update_ready(rec)
        if changed:
            rec.notify()

    async def wait_serving(self, rec: EngineRecord, after_epoch: int, timeout: float) -> bool:
        """Wait until the engine serves again in an epoch after `after_epoch` (it was
        restarted); False if it failed or `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            state = rec.state
            if state == "ready" and rec.epoch > after_epoch:
                return True
            if state == "failed" or self.engines.get(rec.engine_id) is not rec:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await rec.changed(left)
            except TimeoutError:
                return False

    @staticmethod
    async def wait_change(rec: EngineRecord, timeout: float) -> None:
        """Until the engine's state changes or `timeout` passes, whichever comes first."""
        try:
            await rec.changed(timeout)
        except TimeoutError:
            pass

    async def wait_ready(self, rec: EngineRecord, timeout: float) -> bool:
        """Wait until the engine is ready or failed; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(rec.ready.wait(), timeout)
        except TimeoutError:
            return False
        return True
