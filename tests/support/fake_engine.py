"""A fake engine that speaks the real protocol (msgspec over the real ZeroMQ sockets) and emits
one token per active request per step, as fast as the protocol allows (or every --step-ms).
It loads no model: it exists to measure what the proxy can relay.

    python tests/support/fake_engine.py --run-dir DIR --engine-id e1 --model fake
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

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
    ap.add_argument("--drop-after", type=int, default=0, metavar="N",
                    help="end every new (not resumed) request with finish_reason 'abort' after "
                         "N tokens, as an engine dropping a row the proxy still reads")
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
    drop_at: dict[str, int] = {}  # request id -> tokens after which it is dropped
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
                done_before = len(msg.resume_token_ids)  # a resumed request goes on from there
                active[msg.request_id] = [done_before, msg.sampling.max_tokens]
                if args.drop_after and not done_before:
                    drop_at[msg.request_id] = args.drop_after
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
            if drop_at.get(rid) == state[0]:
                deltas.append(Delta(rid, finish_reason="abort", prompt_tokens=8,
                                    completion_tokens=state[0]))
                del active[rid], drop_at[rid]
                continue
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


@contextlib.contextmanager
def proxy_with_fake_engine(*engine_args: str) -> Iterator[str]:
    """A real proxy process (launched as the supervisor launches it) fed by this fake engine
    (a process too), both on a private run dir; yields the proxy's base URL."""
    import httpx2 as httpx

    from mlxd.daemon.launch import popen
    from mlxd.protocol.models import engine_id_for
    from mlxd.protocol.settings import EngineSettings, ProxyLaunch, ProxySettings
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-pf-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eid = engine_id_for("fake")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launch = ProxyLaunch(epoch=0, run_dir=str(run_dir), log_level="info", socket=None,
                         engines={eid: "fake"}, settings=ProxySettings(port=port),
                         engine=EngineSettings())
    procs = [popen(launch, env=env),
             subprocess.Popen([sys.executable, __file__, "--run-dir", str(run_dir),
                               "--engine-id", eid, *engine_args], env=env)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # polling another process's readiness: no event to await across it
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the proxy did not become ready"
            time.sleep(0.1)
        yield url
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
