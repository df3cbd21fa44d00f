"""What `--generation-checkpoint N` costs, side by side in one run.

One `mlxd serve --isolate` per N (0 = off, and the values asked for) runs at the same time on
the same model, each with its own cache dir; rounds of C concurrent streaming requests are
interleaved across them (rep 1: N=0, 16, 64, 256; rep 2: rotated; ...), so drift of the machine
hits every N alike. Every round uses fresh prompts (a repeated prompt would find its blocks on
disk and write nothing). Two figures per N:

- aggregate decode tok/s, median over the reps, and its ratio to N=0 (what a user sees; noisy
  where run-to-run variation is larger than the effect);
- the share of the engine's MLX-thread step time spent taking checkpoints (the engine's own
  `checkpoint_s` / `step_s` counters over the measured rounds): the direct cost, which
  throughput differences only estimate.

    python benchmarks/checkpoint_cost.py --shape tiny --reps 3
    python benchmarks/checkpoint_cost.py --shape 1b --model-dtype bfloat16 --concurrency 8 \\
        --max-tokens 256 --reps 7 --out benchmarks/results/gpu-checkpoint-cost.md
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import TypedDict

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # the harness next to this file


class Cost(TypedDict):
    """One checkpoint interval's figures, over every rep."""
    tok_s: list[float]
    checkpoint_s: float
    step_s: float
    checkpoints: int


async def engine_counters(base: str) -> tuple[float, float, int]:
    async with aiohttp.ClientSession() as s, s.get(base + "/stats") as r:
        cache = (await r.json())["engines"][0]["cache"]
    return cache.get("checkpoint_s", 0.0), cache.get("step_s", 0.0), cache.get("checkpoints", 0)


async def main_async(args: argparse.Namespace) -> dict[int, Cost]:
    model_dir = throughput.model_for(args)
    ns = [0, *[int(n) for n in args.n.split(",") if int(n) > 0]]
    servers = {}
    try:
        for n in ns:
            extra = ["--generation-checkpoint", str(n), "--cache-dir",
                     tempfile.mkdtemp(prefix=f"mlxd-ckpt{n}-")]
            servers[n] = throughput.start_target("mlxd-isolate", model_dir, args.concurrency,
                                                 args.dtype, extra)
        for server, _, _ in servers.values():
            await server.wait()
        results = {n: Cost(tok_s=[], checkpoint_s=0.0, step_s=0.0, checkpoints=0) for n in ns}
        for n, (_, base, name) in servers.items():  # warm-up: compile every shape once
            throughput.PROMPTS[:] = [f"warm-up {n} {i}: tell a story" for i in range(256)]
            await throughput.run_http("warm", base, name, args.concurrency, args.max_tokens)
        for rep in range(args.reps):
            order = ns[rep % len(ns):] + ns[:rep % len(ns)]
            for n in order:
                _, base, name = servers[n]
                throughput.PROMPTS[:] = [f"Rep {rep} request {i}: write a long story about "
                                         f"the sea and the number {i * 7 + rep}."
                                         for i in range(256)]
                c0, s0, k0 = await engine_counters(base)
                r = await throughput.run_http(f"N={n}", base, name, args.concurrency,
                                              args.max_tokens)
                c1, s1, k1 = await engine_counters(base)
                res = results[n]
                res["tok_s"].append(r.tok_s)
                res["checkpoint_s"] += c1 - c0
                res["step_s"] += s1 - s0
                res["checkpoints"] += k1 - k0
                print(f"rep {rep} N={n:4d} {r.tok_s:9.1f} tok/s  checkpoints {k1 - k0:4d}  "
                      f"checkpoint share {(c1 - c0) / max(s1 - s0, 1e-9):.2%}", flush=True)
        return results
    finally:
        for server, _, _ in servers.values():
            server.stop()


def report(results: dict[int, Cost], args: argparse.Namespace) -> str:
    base = statistics.median(results[0]["tok_s"])
    import mlx.core as mx
    lines = [f"# Checkpoint cost: {args.shape} shape ({args.model_dtype}), {args.concurrency} "
             f"streams x {args.max_tokens} tokens, {args.reps} interleaved reps",
             "", f"{time.strftime('%Y-%m-%d')}, {platform.node()}, mlx {version('mlx')}, "
             f"device {mx.default_device()}", "",
             "| N | median tok/s | min..max | ratio to N=0 (medians) | checkpoints | "
             "MLX-thread share spent on checkpoints |", "|---|---|---|---|---|---|"]
    for n, r in results.items():
        med = statistics.median(r["tok_s"])
        share = r["checkpoint_s"] / r["step_s"] if r["step_s"] else 0.0
        lines.append(f"| {n or 'off'} | {med:.1f} | {min(r['tok_s']):.1f}..{max(r['tok_s']):.1f}"
                     f" | {med / base:.3f} | {r['checkpoints']} | {share:.2%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default="tiny", choices=sorted(throughput.SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--n", default="16,64,256", help="checkpoint intervals besides off")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    throughput.save(args.out, report(results, args), results)


if __name__ == "__main__":
    main()
