"""A fake engine that speaks the real protocol (msgspec over the real ZeroMQ sockets) and emits
one token per active request per step, as fast as the protocol allows (or every --step-ms).
It loads no model: it exists to measure what the proxy can relay.

    python tests/support/fake_engine.py --run-dir DIR --engine-id e1 --model fake
"""

from __future__ import annotations

import argparse
import json
import os
import time

import zmq

from mlxd.protocol import codec
from mlxd.protocol.addresses import Endpoints, engine_identity
from mlxd.protocol.messages import Abort, Delta, EngineStatus, FlushCache, Generate, StepOutput

STATUS_EVERY = 0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--reply", default=None, metavar="JSON",
                    help="instead of ' tok' tokens: a list of Delta fields (text, reasoning, "
                         "tool_calls, finish_reason...) sent one per step to every request")
    args = ap.parse_args()
    script = json.loads(args.reply) if args.reply else None
    eps = Endpoints.ipc(args.run_dir)
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.IDENTITY, engine_identity(args.engine_id, args.epoch))
    req.connect(eps.requests)
    out = ctx.socket(zmq.PUSH)
    out.connect(eps.outputs)
    dec, enc = codec.to_engine(), codec.from_engine()
    active: dict[str, list[int]] = {}  # request id -> [generated, max_tokens]
    steps = generated = 0
    next_status = 0.0

    def status() -> EngineStatus:
        return EngineStatus(engine_id=args.engine_id, epoch=args.epoch, pid=os.getpid(),
                            model_id=args.model, model_names=[args.model], state="ready",
                            active=len(active), steps=steps, context_length=1 << 20,
                            generated_tokens_total=generated, model_spec=args.model)

    while True:
        now = time.monotonic()
        if now >= next_status:
            out.send(enc.encode(status()))
            next_status = now + STATUS_EVERY
        admitted = []
        while req.poll(0 if active else 100):
            msg = dec.decode(req.recv())
            if isinstance(msg, Generate):
                active[msg.request_id] = [0, msg.sampling.max_tokens]
                admitted.append(Delta(msg.request_id, prompt_tokens=8))
            elif isinstance(msg, Abort):
                for rid in (list(active) if msg.request_ids == ["*"] else msg.request_ids):
                    active.pop(rid, None)
            elif isinstance(msg, FlushCache):
                pass
        if admitted:
            out.send(enc.encode(StepOutput(args.engine_id, args.epoch, admitted)))
        if not active:
            continue
        deltas = []
        for rid, state in list(active.items()):
            state[0] += 1
            if script is not None:
                fields = script[state[0] - 1]
                done = state[0] >= len(script)
                deltas.append(Delta(rid, token_ids=[state[0]], prompt_tokens=8,
                                    completion_tokens=state[0],
                                    **{"finish_reason": "stop" if done else None, **fields}))
            else:
                done = state[0] >= state[1]
                deltas.append(Delta(rid, text=" tok", token_ids=[state[0] % 1000],
                                    finish_reason="length" if done else None, prompt_tokens=8,
                                    completion_tokens=state[0]))
            if done:
                del active[rid]
        steps += 1
        generated += len(deltas)
        out.send(enc.encode(StepOutput(args.engine_id, args.epoch, deltas)))
        if args.step_ms:
            time.sleep(args.step_ms / 1000)  # a slower engine, on request


if __name__ == "__main__":
    main()
