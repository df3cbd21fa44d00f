"""The engine's output thread: it owns the PUSH socket to the proxy and every request's output
state. Each time it wakes it turns everything queued (token ids of one or more MLX steps,
admissions, answers) into text deltas, and sends them as one `StepOutput`; it sends the
engine's status every half second and whenever a request finishes."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import zmq

from mlxd.engine.batch.messages import RequestsRemoved, RequestStarted, StepTokens
from mlxd.engine.state import Channels, Registered, StatusTick
from mlxd.engine.wire.output import RequestOutput
from mlxd.protocol import codec, stage_trace
from mlxd.protocol.messages import (
    CacheFlushed,
    Delta,
    Embeddings,
    EngineStatus,
    StepOutput,
    TokenLogprob,
)

log = logging.getLogger("mlxd.engine")

STATUS_INTERVAL = 0.5


class OutputThread:
    def __init__(self, ctx: zmq.Context, endpoint: str, engine_id: str, epoch: int,
                 channels: Channels, status: Callable[[], EngineStatus],
                 end_row: Callable[[str], None],
                 token_text: Callable[[int], str]) -> None:
        self.ctx, self.endpoint = ctx, endpoint
        self.engine_id, self.epoch = engine_id, epoch
        self.channels = channels
        self.status = status
        self.end_row = end_row  # a request its stop string ended: its row is freed
        self.token_text = token_text
        self.outputs: dict[str, RequestOutput] = {}  # this thread's alone
        self.trace: Any = None  # stage_clock.OutputTrace under the stage clock
        if stage_trace.ON:
            from mlxd.engine.stage_clock import attach
            self.trace = attach()

    def run(self) -> None:
        enc = codec.from_engine()
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        # A PUSH with no proxy connected blocks; never let a dead proxy stall this thread.
        push.setsockopt(zmq.SNDTIMEO, 1000)
        push.connect(self.endpoint)

        def send(msg: Any) -> None:
            send_bytes(enc.encode(msg))

        def send_bytes(data: bytes) -> None:
            try:
                push.send(data)
            except zmq.Again:
                log.warning("no proxy is reading engine output; dropped a message")

        outq, stop = self.channels.outq, self.channels.stop
        next_status = 0.0
        try:
            while True:
                deltas: list[Delta] = []
                try:
                    item = outq.get(timeout=STATUS_INTERVAL)
                    while True:
                        if isinstance(item, (CacheFlushed, Embeddings)):
                            send(item)
                        else:
                            self._collect(item, deltas)
                        item = outq.get_nowait()
                except queue.Empty:
                    pass
                finished = any(d.finish_reason is not None for d in deltas)
                if deltas and self.trace is not None:
                    data = enc.encode(StepOutput(self.engine_id, self.epoch, deltas))
                    encoded = stage_trace.now()
                    send_bytes(data)
                    self.trace.sent(encoded, stage_trace.now(), finished)
                elif deltas:
                    send(StepOutput(self.engine_id, self.epoch, deltas))
                now = time.monotonic()
                if now >= next_status or finished or stop.is_set():
                    next_status = now + STATUS_INTERVAL
                    send(self.status())
                if stop.is_set() and outq.empty():
                    return
        finally:
            push.close(linger=0 if self.channels.outputs_unread.is_set() else None)

    def _collect(self, item: Any, deltas: list[Delta]) -> None:
        match item:
            case StepTokens():
                self._tokens(item, deltas)
            case Registered(request_id=rid, output=out, notice=notice):
                self.outputs[rid] = out
                deltas.append(notice)
            case RequestStarted(request_id=rid, cached_tokens=cached):
                if (started := self.outputs.get(rid)) is not None:
                    started.cached_tokens = cached
            case RequestsRemoved(request_ids=rids, error=error):
                for rid in rids:
                    if (removed := self.outputs.pop(rid, None)) is not None:
                        deltas.append(Delta(rid, finish_reason="error" if error else "abort",
                                            prompt_tokens=removed.prompt_tokens,
                                            completion_tokens=removed.completion_tokens,
                                            error=error,
                                            error_code="engine_error" if error else None))
            case Delta():
                deltas.append(item)
            case StatusTick():
                pass

    def _tokens(self, step: StepTokens, deltas: list[Delta]) -> None:
        stamps = self.trace.taken(step) if self.trace is not None else None
        for rid, token, finish in step.rows:
            out = self.outputs.get(rid)
            if out is None:
                continue
            delta = out.add(token, finish)
            if delta is None:
                continue
            if step.logprobs and rid in step.logprobs and delta.token_ids:
                lp, top = step.logprobs[rid]
                delta.logprobs = [TokenLogprob(self.token_text(token), lp,
                                               [(self.token_text(i), v) for i, v in top])]
            deltas.append(delta)
            if stamps is not None:
                self.trace.detokenized(delta, stamps, len(step.rows))
            if delta.finish_reason is not None:
                del self.outputs[rid]
                if finish is None:  # a stop string ended it: free the row
                    self.end_row(rid)
