"""Does a short cached prefix make a burst's prefill slower? (issue 14, RESULTS section 18).
mlx-lm's BatchGenerator in this process, N prompts sharing a head of --prefix tokens, inserted
at once: without caches, and with the head's KV lent to every row (or half of them) as the
runner lends a RAM-tier hit (`kv_quant.lend`); time until every row's first token.

    python benchmarks/prefill_cached.py --shape 1b --model-dtype bfloat16 --prefix 30 --reps 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput


def main() -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine import kv_quant
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(throughput.SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--n", type=int, default=32, help="prompts in the burst")
    ap.add_argument("--prefix", type=int, default=30, help="tokens of the shared head")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model = load(throughput.model_for(argparse.Namespace(
        model=None, shape=args.shape, model_dtype=args.model_dtype)))[0]
    rnd = random.Random(0)
    vocab = model.args.vocab_size
    head = [rnd.randrange(1, vocab) for _ in range(args.prefix)]
    held = make_prompt_cache(model)  # the head's KV, as a RAM-tier entry holds it
    model(mx.array([head]), cache=held)
    layers = [(c.keys[..., :args.prefix, :], c.values[..., :args.prefix, :]) for c in held]
    mx.eval(layers)

    def lend(n: int) -> list[Any]:
        return kv_quant.lend([(k[..., :n, :], v[..., :n, :]) for k, v in layers], n, None)

    def run(cached_tokens: int, share: float) -> float:
        from mlx_lm.generate import BatchGenerator
        gen = BatchGenerator(model, max_tokens=1, completion_batch_size=128,
                             prefill_batch_size=128)
        prompts = [head + [rnd.randrange(1, vocab) for _ in range(rnd.randrange(60, 120))]
                   for _ in range(args.n)]
        cached = [bool(cached_tokens) and i < share * args.n for i in range(args.n)]
        # a row without a cache is None, as the runner inserts it
        caches: Any = [lend(cached_tokens) if c else None for c in cached]
        t0 = time.perf_counter()
        gen.insert([p[cached_tokens:] if c else p for p, c in zip(prompts, cached, strict=True)],
                   max_tokens=[1] * args.n,
                   caches=caches if cached_tokens else None,
                   all_tokens=[p[:cached_tokens] if c else []
                               for p, c in zip(prompts, cached, strict=True)]
                   if cached_tokens else None)
        firsts = 0
        while firsts < args.n:
            firsts += len(gen.next()[1])
        seconds = time.perf_counter() - t0
        gen.close()
        return seconds

    cases = [c for c in [(0, 1.0), (7, 1.0), (30, 1.0), (7, 0.5), (200, 1.0)]
             if c[0] <= args.prefix]
    for case in cases:
        run(*case)  # warm-up: kernels and buffers of each shape
    times: dict[tuple[int, float], list[float]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for case in cases:
            times[case].append(run(*case))
    for (n, share), ts in times.items():
        label = "no cache" if not n else f"{int(share * 100)}% rows cached {n}"
        print(f"{label:24s} first tokens of {args.n}: median "
              f"{statistics.median(ts) * 1e3:7.1f} ms  {[round(x * 1e3) for x in ts]}",
              flush=True)


if __name__ == "__main__":
    main()
