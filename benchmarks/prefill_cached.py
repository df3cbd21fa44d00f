"""Does a short cached prefix make a burst's prefill slower? (issue 14, HISTORY.md section 18).
mlx-lm's BatchGenerator in this process, N prompts sharing a head of --prefix tokens, inserted
at once: without caches, and with the head's KV lent to every row (or half of them) as the
runner lends a RAM-tier hit (`codec.CacheCodec.lend`); time until every row's first token.

--where says where the lent arrays were before the burst, as the KV tiers leave them:
`device` (computed there, never read by the host), `host-read` (then read through numpy by the
host, as the SSD write-behind reads a RAM entry: on CUDA that moves managed memory to the
host), `numpy` (made from host arrays, as an SSD restore makes them); `views-default` and
`views-gen`: views of the head in an entry 40 tokens longer, made on the thread's default
stream (as the engine's runner made them before benchmarks/HISTORY.md section 19) or in the
generator's (figures: benchmarks/RESULTS.md, "Burst prefill with short cached prefixes").

    python benchmarks/prefill_cached.py --shape 1b --model-dtype bfloat16 --prefix 30 --reps 5
    python benchmarks/prefill_cached.py --shape 1b --model-dtype bfloat16 --prefix 7 \
        --suffix 20,40 --n 32,64 --where device,host-read,numpy,views-default,views-gen
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput


def main() -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.kv.codec import CacheCodec
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(throughput.SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--n", default="32", help="prompts in the burst (comma-separated)")
    ap.add_argument("--prefix", type=int, default=30, help="tokens of the shared head")
    ap.add_argument("--suffix", default="60,120", help="each prompt's own tokens: LO,HI")
    ap.add_argument("--where", default="device", help="device,host-read,numpy")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.suffix.split(","))
    model = load(throughput.model_for(argparse.Namespace(
        model=None, shape=args.shape, model_dtype=args.model_dtype)))[0]
    rnd = random.Random(0)
    vocab = model.args.vocab_size
    head = [rnd.randrange(1, vocab) for _ in range(args.prefix)]
    held = make_prompt_cache(model)  # the head's KV, as a RAM-tier entry holds it
    model(mx.array([head]), cache=held)
    layers = [(mx.contiguous(c.keys[..., :args.prefix, :]),
               mx.contiguous(c.values[..., :args.prefix, :])) for c in held]
    mx.eval(layers)

    codec = CacheCodec.for_model(model)

    def lend_rows(layers: list[tuple[Any, Any]], n: int, quant: Any) -> list[Any]:
        return codec.lend(layers, [], n, quant)

    def placed(where: str) -> list[tuple[Any, Any]]:
        """Fresh copies of the head's KV, left where `where` says (see the module text)."""
        out = [(k + 0, v + 0) for k, v in layers]
        mx.eval(out)
        if where == "host-read":
            for k, v in out:
                for a in (k, v):
                    np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).sum()
        elif where == "numpy":
            def host_made(a: Any) -> Any:
                if a.dtype == mx.bfloat16:
                    return mx.array(np.asarray(a.view(mx.uint16))).view(mx.bfloat16)
                return mx.array(np.asarray(a))
            out = [(host_made(k), host_made(v)) for k, v in out]
            mx.eval(out)
        return out

    def lend(n: int, where: str) -> list[Any]:
        if where.startswith("views"):
            return lend_views(n, where == "views-gen")
        return lend_rows([(k[..., :n, :], v[..., :n, :]) for k, v in placed(where)],
                             n, None)

    def lend_views(n: int, in_gen_stream: bool) -> list[Any]:
        """Views of the first n tokens of an entry holding 40 more (a RAM entry of a whole
        history), made on this thread's default stream or in the generator's."""
        from mlx_lm.generate import generation_stream
        longer = [tuple(mx.concatenate([a, mx.zeros((*a.shape[:2], 40, a.shape[3]), a.dtype)],
                                       axis=2) for a in kv) for kv in placed("device")]
        mx.eval(longer)
        if in_gen_stream:
            with mx.stream(generation_stream):
                return lend_rows([(k[..., :n, :], v[..., :n, :]) for k, v in longer],
                                     n, None)
        return lend_rows([(k[..., :n, :], v[..., :n, :]) for k, v in longer], n, None)

    def run(cached_tokens: int, share: float, n_rows: int, where: str) -> float:
        from mlx_lm.generate import BatchGenerator
        gen = BatchGenerator(model, max_tokens=1, completion_batch_size=128,
                             prefill_batch_size=128)
        prompts = [head + [rnd.randrange(1, vocab) for _ in range(rnd.randrange(lo, hi))]
                   for _ in range(n_rows)]
        cached = [bool(cached_tokens) and i < share * n_rows for i in range(n_rows)]
        # a row without a cache is None, as the runner inserts it
        caches: Any = [lend(cached_tokens, where) if c else None for c in cached]
        t0 = time.perf_counter()
        gen.insert([p[cached_tokens:] if c else p for p, c in zip(prompts, cached, strict=True)],
                   max_tokens=[1] * n_rows,
                   caches=caches if cached_tokens else None,
                   all_tokens=[p[:cached_tokens] if c else []
                               for p, c in zip(prompts, cached, strict=True)]
                   if cached_tokens else None)
        firsts = 0
        while firsts < n_rows:
            firsts += len(gen.next()[1])
        seconds = time.perf_counter() - t0
        gen.close()
        return seconds

    heads = [c for c in [7, 30, 200] if c <= args.prefix]
    wheres = args.where.split(",")
    for n_rows in [int(x) for x in args.n.split(",")]:
        cases = [(0, 1.0, "-")] + [(c, 1.0, w) for c in heads for w in wheres] + \
            [(heads[0], 0.5, w) for w in wheres]
        for case in cases:
            run(case[0], case[1], n_rows, case[2])  # warm-up: kernels and buffers of each shape
        times: dict[tuple[int, float, str], list[float]] = {c: [] for c in cases}
        for rep in range(args.reps):
            for case in cases[rep % len(cases):] + cases[:rep % len(cases)]:
                times[case].append(run(case[0], case[1], n_rows, case[2]))
        for (n, share, where), ts in times.items():
            label = "no cache" if not n else f"{int(share * 100)}% rows cached {n}, {where}"
            print(f"{label:34s} first tokens of {n_rows}: median "
                  f"{statistics.median(ts) * 1e3:7.1f} ms  {[round(x * 1e3) for x in ts]}",
                  flush=True)


if __name__ == "__main__":
    main()
