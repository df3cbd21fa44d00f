"""Issue 18: a model served by a 2-rank tensor-parallel group against the same model whole.

`serve` (the default) starts `mlxd serve --isolate MODEL` twice: whole (one process, one GPU)
and `--shard MODEL=tensor:N` (N ranks: NCCL over N GPUs where MLX runs on CUDA, the ring
backend over TCP elsewhere), and streams the same greedy chats at each concurrency; it reports
aggregate tok/s and the ratio group/whole. The model is a random-weight Llama built on the spot
(`--shape`, shared with throughput.py) unless `--model` names one.

`allsum` measures what one collective costs at the sizes a decode step moves: per layer, a
tensor-parallel step all-reduces the attention output and the MLP output, each (rows x hidden)
activations, so a step adds 2 x layers all-reduces. It starts N local ranks (as mlx.launch
does) and times `mx.distributed.all_sum` for rows 1/8/32 of the shape's hidden size.

    python benchmarks/distributed.py --shape 1b --out benchmarks/results/gpu-h200x2-tp
    python benchmarks/distributed.py allsum --shape 1b --out benchmarks/results/cpu-allsum
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (
    SHAPES,
    engine_figures,
    free_port,
    measured_http,
    median_round,
    model_for,
    pct,
    run_http,
    save,
    start_target,
)

# ---------------------------------------------------------------- serve: group vs whole

async def serve(args: argparse.Namespace) -> None:
    model_dir = model_for(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    targets = [("whole", []), (f"tensor:{args.ranks}",
                               ["--shard", f"{model_dir}=tensor:{args.ranks}"])]
    rows: list[dict] = []
    for name, extra in targets:
        server, base, model = start_target("mlxd-isolate", model_dir, max(levels), args.dtype,
                                           extra + ["--hang-timeout", "600"])
        try:
            await server.wait()
            fig = await engine_figures(base)
            print(f"{name}: batch {fig.get('batch_why')}", flush=True)
            for c in levels:
                await run_http(name, base, model, c, min(args.max_tokens, 16))  # warm-up
                r = median_round([await measured_http("mlxd", base, model, c, args.max_tokens)
                                  for _ in range(args.repeat)])
                rows.append({"target": name, "streams": c, "tok_s": r.tok_s,
                             "ttft_p50": pct(r.ttft, .5), "itl_p50": pct(r.itl, .5),
                             "tokens": r.tokens, "seconds": r.seconds})
                print(f"{name:10s} c={c:3d} {r.tok_s:9.1f} tok/s, first text p50 "
                      f"{pct(r.ttft, .5):.3f} s, inter-token p50 {pct(r.itl, .5) * 1e3:.1f} ms",
                      flush=True)
        finally:
            server.stop()
    whole = {row["streams"]: row["tok_s"] for row in rows if row["target"] == "whole"}
    lines = [f"# tensor:{args.ranks} group vs whole engine ({Path(model_dir).name}, "
             f"{args.max_tokens} tokens per stream, greedy)", "",
             "| target | streams | tok/s | ratio to whole | first text p50 s | "
             "inter-token p50 ms |", "|---|---|---|---|---|---|"]
    for row in rows:
        ref = whole.get(row["streams"])
        ratio = row["tok_s"] / ref if ref else float("nan")
        row["ratio"] = ratio
        lines.append(f"| {row['target']} | {row['streams']} | {row['tok_s']:.1f} | "
                     f"{ratio:.2f} | {row['ttft_p50']:.3f} | {row['itl_p50'] * 1e3:.1f} |")
    save(args.out.with_suffix(".md") if args.out else None, "\n".join(lines) + "\n",
         {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}})


# ---------------------------------------------------------------- allsum: one collective

def allsum_rank(args: argparse.Namespace) -> None:
    """One rank of the all_sum timing (started by `allsum`)."""
    import mlx.core as mx
    group = mx.distributed.init(strict=True, backend=args.backend)
    hidden, layers = SHAPES[args.shape][0], SHAPES[args.shape][1]
    dtype = getattr(mx, args.act_dtype)
    out = []
    for rows in (1, 8, 32):
        a = mx.ones((rows, hidden), dtype=dtype)
        for _ in range(20):
            mx.eval(mx.distributed.all_sum(a, group=group))
        t0 = time.perf_counter()
        n = args.iters
        for _ in range(n):
            mx.eval(mx.distributed.all_sum(a, group=group))
        us = (time.perf_counter() - t0) / n * 1e6
        out.append({"rows": rows, "bytes": a.nbytes, "us": us,
                    "per_step_ms": 2 * layers * us / 1e3})
    if group.rank() == 0:
        print(json.dumps({"load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
                          "backend": args.backend, "ranks": group.size(), "shape": args.shape,
                          "hidden": hidden, "layers": layers, "dtype": args.act_dtype,
                          "results": out}), flush=True)


def allsum(args: argparse.Namespace) -> None:
    import mlx.core as mx
    cuda = getattr(mx, "cuda", None)
    backend = args.backend or ("nccl" if cuda is not None and cuda.is_available() else "ring")
    n = args.ranks
    ports = [free_port() for _ in range(n + 1)]
    hostfile = Path(tempfile.mkstemp(suffix=".json")[1])
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:n]]))
    procs = []
    for r in range(n):
        env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile),
               "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(ports[n]),
               "MLX_WORLD_SIZE": str(n), "PYTHONUNBUFFERED": "1"}
        if backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = str(r)
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "_allsum_rank", "--shape", args.shape,
             "--backend", backend, "--act-dtype", args.act_dtype, "--iters", str(args.iters)],
            env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    hostfile.unlink(missing_ok=True)
    data = next(json.loads(line) for line in outs[0].splitlines() if line.startswith("{"))
    lines = [f"# all_sum on this host: {backend}, {n} ranks, {args.shape} "
             f"(hidden {data['hidden']}, {data['layers']} layers), {args.act_dtype}; "
             f"load average {data['load_avg_1m']:.1f} on {data['cpus']} CPUs", "",
             "| rows | bytes | one all_sum (us) | per decode step: 2 x layers (ms) |",
             "|---|---|---|---|"]
    for x in data["results"]:
        lines.append(f"| {x['rows']} | {x['bytes']} | {x['us']:.1f} | {x['per_step_ms']:.2f} |")
    save(args.out.with_suffix(".md") if args.out else None, "\n".join(lines) + "\n", data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="serve", choices=["serve", "allsum",
                                                                 "_allsum_rank"])
    ap.add_argument("--model", default=None, help="a model dir (default: random, --shape)")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model-dtype", default="bfloat16", help="dtype of the random weights")
    ap.add_argument("--dtype", default="auto", help="mlxd --dtype")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--backend", default=None, help="allsum: ring or nccl (default: by device)")
    ap.add_argument("--act-dtype", default="float32", help="allsum: activation dtype")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.mode == "serve":
        asyncio.run(serve(args))
    elif args.mode == "allsum":
        allsum(args)
    else:
        allsum_rank(args)


if __name__ == "__main__":
    main()
