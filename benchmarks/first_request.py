"""Time to first token of the first request after `mlxd serve` reports ready, against the
second and third requests, on a fresh daemon each round.

The daemon is started, the benchmark waits for `/health` to say `ok` (the engine has sent
`Ready`), then sends three streaming chat requests one after the other, each a different
question of the same shape, and times each from sending to its first text. The prefix caches
are off (`--prompt-cache 0 --ssd-cache off`), so no request is faster for reusing another's
prefill: what differs is only what the first request pays for being first (kernel compilation,
template compilation, buffer allocation). The figure that matters is first / second.

    python benchmarks/first_request.py                        # CPU, the default model
    python benchmarks/first_request.py --shape 1b --model-dtype bfloat16   # GPU: random 1.24B
    python benchmarks/first_request.py --mlxd-args "--no-warm-up"          # the cost without it
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import SHAPES, free_port, model_for

QUESTIONS = ["What is the capital of France?", "What is the capital of Spain?",
             "What is the capital of Italy?"]


def first_text_s(client: httpx.Client, question: str, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if first is None and '"content": "' in line and '"content": ""' not in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no text came back")
    return first


def one_round(model: str, args: argparse.Namespace) -> dict:
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="mlxd-fr-", dir="/tmp")
    argv = [sys.executable, "-m", "mlxd.daemon.cli", "serve", model, "--port", str(port),
            "--run-dir", run_dir, "--cache-dir", args.cache_dir, "--ssd-cache", "off",
            "--prompt-cache", "0", "--dtype", args.dtype, "--log-level", "warning",
            *(["--isolate"] if args.isolate else []), *shlex.split(args.mlxd_args)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900)
        while True:  # polling another process's readiness: there is no event to await
            if proc.poll() is not None:
                raise RuntimeError(f"mlxd exited with {proc.returncode}: {' '.join(argv)}")
            try:
                if client.get("/health").json().get("status") == "ok":
                    break
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        ttft = [first_text_s(client, q, args.max_tokens) for q in QUESTIONS]
        return {"start_to_ready_s": round(ready, 3), "ttft_s": [round(t, 3) for t in ttft]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


def report(rounds: list[dict], args: argparse.Namespace, model: str) -> str:
    firsts = [r["ttft_s"][0] for r in rounds]
    seconds = [r["ttft_s"][1] for r in rounds]
    thirds = [r["ttft_s"][2] for r in rounds]
    ratios = [a / b for a, b in zip(firsts, seconds, strict=True)]
    mode = "--isolate" if args.isolate else "one process"
    lines = [f"# First request after ready: {Path(model).name or model} ({mode}, "
             f"`{args.mlxd_args or 'defaults'}`), {len(rounds)} fresh daemons, "
             f"max_tokens {args.max_tokens}", "",
             "| round | start to ready (s) | TTFT 1st (s) | TTFT 2nd (s) | TTFT 3rd (s) | "
             "1st / 2nd |", "|---|---|---|---|---|---|"]
    for i, (r, ratio) in enumerate(zip(rounds, ratios, strict=True), 1):
        a, b, c = r["ttft_s"]
        lines.append(f"| {i} | {r['start_to_ready_s']:.2f} | {a:.3f} | {b:.3f} | {c:.3f} | "
                     f"{ratio:.2f} |")
    lines.append(f"| median | {statistics.median(r['start_to_ready_s'] for r in rounds):.2f} | "
                 f"{statistics.median(firsts):.3f} | {statistics.median(seconds):.3f} | "
                 f"{statistics.median(thirds):.3f} | {statistics.median(ratios):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="'default' (the default; ignored with --shape), or a model dir")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="a random-weight model of this shape instead (1b: 1.24B)")
    ap.add_argument("--model-dtype", default="float32", help="dtype of the random weights")
    ap.add_argument("--dtype", default="auto", help="mlxd --dtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mlxd-args", default="", help="extra `mlxd serve` flags")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "mlxd-fr-cache"),
                    help="converted models (kept between rounds: conversion is not measured)")
    ap.add_argument("--out", type=Path, default=None, help="write FILE.md and FILE.json")
    args = ap.parse_args()
    if args.shape is None:
        args.model = args.model or "default"
    model = model_for(args)
    rounds = [one_round(model, args) for _ in range(args.rounds)]
    text = report(rounds, args, model)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"model": model, "isolate": args.isolate, "mlxd_args": args.mlxd_args,
             "rounds": rounds}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
