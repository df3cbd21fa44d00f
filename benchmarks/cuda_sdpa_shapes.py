"""What a never-seen attention shape costs on MLX's CUDA backend, with cuDNN's fused attention
on and off (`MLX_CUDA_USE_CUDNN_SDPA`), side by side in one run.

MLX sends attention with more than one query token to cuDNN and caches one cuDNN graph per
exact shape (`mlx/backend/cuda/scaled_dot_product_attention.cpp`). A speculative verify pass
(1 + k query tokens against the row's whole context) and the prefill of a prompt of a new
length meet a shape they have not seen. This times, through the same `BatchKVCache` of one
row that `engine/speculative/step.py` verifies with:

- a plain decode step (one query token: MLX's own vector kernel either way);
- a verify pass of 1 + k tokens at a key length seen for the first time, and at a key length
  seen before;
- the prefill of a prompt of a length seen for the first time, and of one seen before;
- the prefill of one long prompt (where cuDNN's fused kernel should matter most);
- the prefill of a burst: 32 short prompts of different lengths together, at a padded length
  seen for the first time, and at one seen before.

Each setting runs in its own child process (the variable is read once per process).

    python benchmarks/cuda_sdpa_shapes.py --shape 1b --model-dtype bfloat16   # the H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ms(samples: list[float]) -> str:
    if not samples:
        return "-"
    return f"{statistics.median(samples) * 1e3:.1f}"


def measure(model_dir: str, reps: int, draft: int, long_len: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache, trim_prompt_cache

    model, _ = load(model_dir)[:2]
    vocab = model.args.vocab_size
    n_layers = len(model.layers)

    def fresh(prompt_len: int, salt: int, rows: int = 1) -> list[Any]:
        pads = [r % 8 for r in range(rows)]  # a burst's prompts differ in length
        cache = [BatchKVCache(left_padding=pads) for _ in range(n_layers)]
        toks = mx.array([[(salt * 7919 + r * 13 + i * 31) % vocab for i in range(prompt_len)]
                         for r in range(rows)], dtype=mx.uint32)
        mx.eval(model(toks, cache=cache))
        return cache

    def timed(fn: Any, *args: Any, **kwargs: Any) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        mx.synchronize()
        return time.perf_counter() - t0

    out: dict[str, list[float]] = {k: [] for k in (
        "decode", "verify_new", "verify_seen", "prefill_new", "prefill_seen", "prefill_long",
        "burst_new", "burst_seen")}
    cache = fresh(300, 1)
    one = mx.array([[5]], dtype=mx.uint32)
    block = mx.array([[5] * (draft + 1)], dtype=mx.uint32)
    for _ in range(3):  # warm the kernels of both step kinds
        mx.eval(model(one, cache=cache))
        mx.eval(model(block, cache=cache))
        trim_prompt_cache(cache, draft + 1)
    for _ in range(reps):
        out["decode"].append(timed(lambda: mx.eval(model(one, cache=cache))))
        # a new key length every pass: keep one of the 1 + k tokens, as a step that accepts none
        out["verify_new"].append(timed(lambda: mx.eval(model(block, cache=cache))))
        trim_prompt_cache(cache, draft)
    for _ in range(reps):
        out["verify_seen"].append(timed(lambda: mx.eval(model(block, cache=cache))))
        trim_prompt_cache(cache, draft + 1)  # back to the same key length
    for i in range(reps):
        out["prefill_new"].append(timed(fresh, 400 + i, 100 + i))
    for i in range(reps):
        out["prefill_seen"].append(timed(fresh, 400, 200 + i))
    for i in range(reps):
        out["burst_new"].append(timed(fresh, 60 + i, 400 + i, rows=32))
    for i in range(reps):
        out["burst_seen"].append(timed(fresh, 60, 500 + i, rows=32))
    fresh(long_len, 2)
    for i in range(3):
        out["prefill_long"].append(timed(fresh, long_len, 300 + i))
    return {k: [round(x, 6) for x in v] for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--draft", type=int, default=3, help="draft tokens per verify pass")
    ap.add_argument("--long", type=int, default=4096, help="the long prompt's length")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from throughput import model_for  # the same random model directory as the other benchmarks
    model_dir = model_for(args)
    if args.child:
        print(json.dumps(measure(model_dir, args.reps, args.draft, args.long)))
        return
    rows = []
    for setting in ("1", "0"):
        env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": setting}
        child = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env,
                               capture_output=True, text=True, check=True)
        rows.append((setting, json.loads(child.stdout.strip().splitlines()[-1])))
    import mlx.core as mx
    lines = [f"Model: {args.model or 'random ' + args.shape + ' (' + args.model_dtype + ')'}; "
             f"mlx {version('mlx')}, {mx.default_device()}; {args.reps} passes each, medians "
             f"in ms; verify = 1 + {args.draft} tokens through a one-row BatchKVCache.", "",
             "| MLX_CUDA_USE_CUDNN_SDPA | decode step | verify, new key length | "
             "verify, seen length | prefill ~400, new length | prefill 400, seen length | "
             f"prefill {args.long} | 32 rows x ~60, new length | 32 rows x 60, seen |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, r in rows:
        lines.append(f"| {setting} | {_ms(r['decode'])} | {_ms(r['verify_new'])} | "
                     f"{_ms(r['verify_seen'])} | {_ms(r['prefill_new'])} | "
                     f"{_ms(r['prefill_seen'])} | {_ms(r['prefill_long'])} | "
                     f"{_ms(r['burst_new'])} | {_ms(r['burst_seen'])} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
