"""Time to first token of the first request after `mlxd serve` reports ready, against the
next ones, on a fresh daemon each round.

The daemon is started, the benchmark waits for `/health` to say `ok` (the engine has sent
`Ready`), then sends streaming chat requests one after the other and times each from sending
to its first text: three questions of different lengths, then the third again. The prefix
caches are off (`--prompt-cache 0 --ssd-cache off`), so no request is faster for reusing
another's prefill. The figure that matters is first / second: what the first request pays for
being first (kernel compilation, template compilation, buffer allocation). The questions differ
in length because on a GPU every prompt length seen for the first time costs extra (MLX builds
work per shape): the second request pays that too, like the first, and only what is left is the
first request's own stall. The repeat shows the cost for a length already seen.

    python benchmarks/first_request.py                        # CPU, the default model
    python benchmarks/first_request.py --shape 1b --model-dtype bfloat16   # GPU: random 1.24B
    python benchmarks/first_request.py --mlxd-args=--no-warm-up            # the cost without it
"""

from __future__ import annotations

import argparse
import http.client
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import SHAPES, free_port, model_for

# The standard library's HTTP client only: this runs on machines that have little else.

QUESTIONS = ["What is the capital of France?",
             "Name three rivers that flow through Germany, please.",
             "Write one short sentence about the history of the lighthouse of Alexandria.",
             "Write one short sentence about the history of the lighthouse of Alexandria."]


def first_text_s(port: int, question: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first text, prompt tokens)."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {r.read()!r}")
        first, prompt_tokens = None, 0
        while line := r.readline():
            if first is None and b'"content": "' in line and b'"content": ""' not in line:
                first = time.perf_counter() - t0
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("no text came back")
    return first, prompt_tokens


def healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read()).get("status") == "ok"
    except (OSError, ValueError):
        return False
    finally:
        conn.close()


def one_round(model: str, args: argparse.Namespace) -> dict:
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="mlxd-fr-", dir="/tmp")
    argv = [sys.executable, "-m", "mlxd.cli.main", "serve", model, "--port", str(port),
            "--run-dir", run_dir, "--cache-dir", args.cache_dir, "--ssd-cache", "off",
            "--prompt-cache", "0", "--dtype", args.dtype, "--log-level", "warning",
            *(["--isolate"] if args.isolate else []), *shlex.split(args.mlxd_args)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while not healthy(port):  # polling another process's readiness: no event to await
            if proc.poll() is not None:
                raise RuntimeError(f"mlxd exited with {proc.returncode}: {' '.join(argv)}")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        got = [first_text_s(port, q, args.max_tokens) for q in QUESTIONS]
        return {"start_to_ready_s": round(ready, 3), "ttft_s": [round(t, 4) for t, _ in got],
                "prompt_tokens": [n for _, n in got]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


def report(rounds: list[dict], args: argparse.Namespace, model: str) -> str:
    ttft = [[r["ttft_s"][i] for r in rounds] for i in range(len(QUESTIONS))]
    ratios = [a / b for a, b in zip(ttft[0], ttft[1], strict=True)]
    mode = "--isolate" if args.isolate else "one process"
    lengths = "/".join(str(n) for n in rounds[0]["prompt_tokens"])
    lines = [f"# First request after ready: {Path(model).name or model} ({mode}, "
             f"`{args.mlxd_args or 'defaults'}`), {len(rounds)} fresh daemons, "
             f"max_tokens {args.max_tokens}, prompts of {lengths} tokens", "",
             "| round | start to ready (s) | TTFT 1st (s) | 2nd (s) | 3rd (s) | 3rd again (s) "
             "| 1st / 2nd |", "|---|---|---|---|---|---|---|"]
    for i, (r, ratio) in enumerate(zip(rounds, ratios, strict=True), 1):
        cells = " | ".join(f"{t:.3f}" for t in r["ttft_s"])
        lines.append(f"| {i} | {r['start_to_ready_s']:.2f} | {cells} | {ratio:.2f} |")
    cells = " | ".join(f"{statistics.median(t):.3f}" for t in ttft)
    lines.append(f"| median | {statistics.median(r['start_to_ready_s'] for r in rounds):.2f} | "
                 f"{cells} | {statistics.median(ratios):.2f} |")
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
