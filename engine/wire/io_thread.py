"""The engine's I/O thread: it owns the request DEALER (from the proxy) and the control DEALER
(to the supervisor), decodes what arrives and hands it on. It never tokenizes or waits for
MLX, so heartbeats, aborts and flushes are answered whatever a request costs to prepare."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from mlxd.engine.state import Channels
from mlxd.protocol import codec, exit_codes
from mlxd.protocol.addresses import Endpoints, identity
from mlxd.protocol.messages import (
    Abort,
    ChildStates,
    Embed,
    FlushCache,
    Generate,
    Heartbeat,
    Hello,
    SetMemoryShare,
    Shutdown,
)

log = logging.getLogger("mlxd.engine")

HEARTBEAT_INTERVAL = 0.5


@dataclass
class Handlers:
    """What the I/O thread does with each message (the lifecycle provides them)."""
    generate: Callable[[Generate], None]
    abort: Callable[[list[str]], None]
    flush: Callable[[FlushCache], None]
    shutdown: Callable[[str], None]
    children: Callable[[ChildStates], None]
    progress: Callable[[], tuple[int, bool, float]]  # step counter, busy, pace (hang watchdog)
    embed: Callable[[Embed], None]
    share: Callable[[SetMemoryShare], None] = lambda _: None  # the memory share changed
    served: Callable[[], int] = lambda: 0  # tokens generated (inputs embedded) in this life


class IoThread:
    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, engine_id: str, epoch: int,
                 supervised: bool, channels: Channels, handlers: Handlers) -> None:
        self.ctx, self.eps = ctx, endpoints
        self.engine_id, self.epoch = engine_id, epoch
        self.supervised = supervised
        self.channels = channels
        self.on = handlers
        self._parent = os.getppid()

    def run(self) -> None:
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.IDENTITY, identity("engine", self.engine_id, self.epoch))
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.eps.requests)
        poller = zmq.Poller()
        poller.register(req, zmq.POLLIN)
        ctl = self._control_socket(poller) if self.supervised else None
        req_codec, ctl_codec, sup_codec = codec.to_engine(), codec.to_child(), codec.to_supervisor()
        next_beat = 0.0
        told_served = False
        try:
            while not self.channels.stop.is_set():
                events = dict(poller.poll(100))
                if req in events:
                    for _ in range(256):  # a burst at a time, then the control side again
                        try:
                            data = req.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_request(req_codec, data)
                if ctl is None:
                    continue
                if ctl in events:
                    self._on_control(ctl_codec, ctl.recv())
                self._send_queued(ctl, sup_codec)
                now = time.monotonic()
                served = self.on.served()
                # The first token served is told at once, not at the next beat: a death
                # soon after it must not count toward the crash-loop breaker.
                if now >= next_beat or (served and not told_served):
                    next_beat = now + HEARTBEAT_INTERVAL
                    told_served = served > 0
                    steps, busy, pace = self.on.progress()
                    ctl.send(sup_codec.encode(Heartbeat(self.engine_id, self.epoch, steps, busy,
                                                        served, pace)))
                    if os.getppid() != self._parent:
                        log.error("supervisor is gone; exiting")
                        os._exit(exit_codes.PARENT_GONE)
        finally:
            req.close()
            if ctl is not None:
                self._send_queued(ctl, sup_codec)  # a last ChildFailed, say
                ctl.close()

    def _control_socket(self, poller: zmq.Poller) -> zmq.Socket:
        ctl = self.ctx.socket(zmq.DEALER)
        ctl.setsockopt(zmq.IDENTITY, identity("engine", self.engine_id, self.epoch))
        ctl.setsockopt(zmq.LINGER, 1000)
        ctl.connect(self.eps.control)
        ctl.send(codec.to_supervisor().encode(
            Hello("engine", self.engine_id, self.epoch, os.getpid())))
        poller.register(ctl, zmq.POLLIN)
        return ctl

    def _send_queued(self, ctl: zmq.Socket, enc: Any) -> None:
        while True:
            try:
                ctl.send(enc.encode(self.channels.control_out.get_nowait()))
            except queue.Empty:
                return

    def _on_request(self, dec: Any, data: bytes) -> None:
        try:
            msg = dec.decode(data)
        except msgspec.DecodeError as e:
            log.warning("dropped an undecodable request: %s", e)
            return
        match msg:
            case Generate():
                self.on.generate(msg)
            case Abort(request_ids=ids):
                self.on.abort(ids)
            case FlushCache():
                self.on.flush(msg)
            case Embed():
                self.on.embed(msg)

    def _on_control(self, dec: Any, data: bytes) -> None:
        try:
            msg = dec.decode(data)
        except msgspec.DecodeError as e:
            log.warning("dropped an undecodable control message: %s", e)
            return
        match msg:
            case Shutdown(reason=reason, outputs_unread=unread):
                log.info("shutdown requested: %s", reason)
                if unread:
                    self.channels.outputs_unread.set()
                self.on.shutdown(reason)
            case ChildStates():
                self.on.children(msg)
            case SetMemoryShare():
                self.on.share(msg)
