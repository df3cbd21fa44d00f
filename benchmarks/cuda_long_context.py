"""Attention at an agent's context lengths on MLX's CUDA backend: a batch cache's array mask
and cuDNN's fused attention, side by side in one run.

An agent session's turns decode and prefill over 10k-100k tokens of cached context. mlx-lm's
batch cache (`BatchKVCache.make_mask`) passes an array mask at every pass, even for a batch of
one row with no padding, where a single sequence's cache (`KVCache`, mlx-lm in-process) passes
none for a decode step and `"causal"` for a prefill. MLX's CUDA backend
(`mlx/backend/cuda/scaled_dot_product_attention.cpp`) takes a one-token pass to its vector
kernel only without an array mask, and a multi-token pass to cuDNN only when
`MLX_CUDA_USE_CUDNN_SDPA` is on; everything else runs the unfused fallback, which
materialises the whole score matrix. This times, at each context length:

- `decode kv`: a decode step through `KVCache` (the in-process reference);
- `decode batch`: the same step through a one-row `BatchKVCache` with mlx-lm's array mask;
- `decode batch, no mask`: the same, with the mask of a row that has no padding left out;
- `decode 2 rows`: two rows of different lengths (left padding: the mask is needed);
- `decode 2 rows split`: the same, each row attending over its own keys without a mask
  (`engine/load/cuda_attention.by_row`, as engines route it);
- `prefill kv` / `prefill batch` / `prefill batch, causal`: 2,048 new tokens over the context,
  as in an agent's next turn (`"causal"` for the one-row batch without padding), at a shape
  seen before; `_new`: at a shape never seen (a cuDNN graph build each pass).

Each cuDNN setting runs in its own child process (MLX reads the variable once).

    python benchmarks/cuda_long_context.py --shape 1b --model-dtype bfloat16 \
        --contexts 8192,32768,65536
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = ("decode_kv", "decode_batch", "decode_batch_nomask", "decode_2rows", "decode_2rows_split",
         "prefill_kv", "prefill_batch", "prefill_batch_causal",
         "prefill_kv_new", "prefill_batch_causal_new")


def measure(model_dir: str, contexts: list[int], reps: int, chunk: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache, KVCache, trim_prompt_cache

    from mlxd.engine.load.cuda_attention import by_row
    from mlxd.engine.mlx_lm_internals import route_attention
    model, _ = load(model_dir)[:2]
    vocab = model.args.vocab_size
    n_layers = len(model.layers)

    def tokens(n: int, salt: int) -> mx.array:
        return mx.array([[(salt * 7919 + i * 31) % vocab for i in range(n)]], dtype=mx.uint32)

    def extend(cache: list[Any], n: int, salt: int) -> None:
        for start in range(0, n, chunk):
            mx.eval(model(tokens(min(chunk, n - start), salt + start), cache=cache))

    def timed(fn: Callable[[], Any]) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        return time.perf_counter() - t0

    def run(case: str, cache: list[Any], toks: mx.array, out: list[float],
            new_shapes: bool = False) -> None:
        for i in range(reps + 2):  # two passes to warm kernels and graphs
            # a new shape every pass (as a turn's next chunk meets): one token fewer each time
            t_in = toks[:, : toks.shape[1] - 1 - i] if new_shapes else toks
            t = timed(lambda t_in=t_in: model(t_in, cache=cache))  # type: ignore[misc]
            trim_prompt_cache(cache, t_in.shape[1])
            if i >= 2:
                out.append(t)

    original = BatchKVCache.make_mask

    def unpadded(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        # this benchmark's one-row batches have no padding (merged from one KVCache)
        if N == 1:
            return None
        return original(self, N, return_array=True, **kwargs) if return_array else "causal"

    results: dict[str, dict[str, list[float]]] = {}
    single = [KVCache() for _ in range(n_layers)]
    shorter = [KVCache() for _ in range(n_layers)]
    built = 0
    one = tokens(1, 3)
    block = tokens(chunk, 5)
    for ctx in contexts:
        extend(single, ctx - built, 11 + built)
        extend(shorter, ctx - built, 13 + built)
        built = ctx
        trim_prompt_cache(shorter, min(1000, ctx // 4))  # the other row: a shorter session
        row: dict[str, list[float]] = {c: [] for c in CASES}
        batch = [BatchKVCache.merge([c]) for c in single]
        two = [BatchKVCache.merge([a, b]) for a, b in zip(single, shorter, strict=True)]
        mx.eval([c.keys for c in batch] + [c.keys for c in two])
        run("decode_kv", single, one, row["decode_kv"])
        run("decode_batch", batch, one, row["decode_batch"])
        run("decode_2rows", two, mx.concatenate([one, one]), row["decode_2rows"])
        pads = [0, min(1000, ctx // 4)]

        def split(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, sinks: Any = None,
                  cache: Any = None, pads: list[int] = pads) -> Any:
            if q.shape[2] == 1 and q.shape[0] == 2:
                return by_row(q, k, v, scale, pads, mx.fast.scaled_dot_product_attention)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                        sinks=sinks)
        route_attention(split)
        try:
            run("decode_2rows_split", two, mx.concatenate([one, one]), row["decode_2rows_split"])
        finally:
            route_attention(None)
        run("prefill_kv", single, block, row["prefill_kv"])
        run("prefill_batch", batch, block, row["prefill_batch"])
        run("prefill_kv_new", single, block, row["prefill_kv_new"], new_shapes=True)
        BatchKVCache.make_mask = unpadded  # type: ignore[method-assign]
        try:
            run("decode_batch_nomask", batch, one, row["decode_batch_nomask"])
            run("prefill_batch_causal", batch, block, row["prefill_batch_causal"])
            run("prefill_batch_causal_new", batch, block, row["prefill_batch_causal_new"],
                new_shapes=True)
        finally:
            BatchKVCache.make_mask = original  # type: ignore[method-assign]
        extend(shorter, min(1000, ctx // 4), 17)  # back to the same length as `single`
        del batch, two
        results[str(ctx)] = {k: [round(x, 6) for x in v] for k, v in row.items()}
        print(f"context {ctx}: " + ", ".join(
            f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in row.items()),
            file=sys.stderr, flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=2048, help="a next turn's new tokens")
    ap.add_argument("--settings", default="1,0", help="MLX_CUDA_USE_CUDNN_SDPA values to run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from throughput import model_for  # the same random model directory as the other benchmarks
    model_dir = model_for(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print(json.dumps(measure(model_dir, contexts, args.reps, args.chunk)))
        return
    runs: dict[str, Any] = {}
    for setting in args.settings.split(","):
        env = {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": setting}
        child = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env,
                               stdout=subprocess.PIPE, text=True, check=True)
        runs[setting] = json.loads(child.stdout.strip().splitlines()[-1])
    import mlx.core as mx
    lines = [f"Model: {args.model or 'random ' + args.shape + ' (' + args.model_dtype + ')'}; "
             f"mlx {version('mlx')}, {mx.default_device()}; medians of {args.reps} passes, ms; "
             f"prefill = {args.chunk} new tokens over the context.", "",
             "| cuDNN | context | " + " | ".join(CASES) + " |",
             "|---|---|" + "---|" * len(CASES)]
    for setting, by_ctx in runs.items():
        for ctx, r in by_ctx.items():
            lines.append(f"| {setting} | {ctx} | " + " | ".join(
                f"{statistics.median(r[c]) * 1e3:.1f}" for c in CASES) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
