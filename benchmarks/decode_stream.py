"""Which MLX stream decodes fastest? (issue 14 item 2: the single stream)

On the H200 `mlx_lm.server` decoded one stream faster than the in-process reference of
benchmarks/throughput.py (inter-token p50 4.0 ms against 5.0 ms, benchmarks/HISTORY.md section 18),
though both decode through mlx-lm's BatchGenerator. One difference is the stream: the server
runs its generator on the thread's default stream, the reference (and mlxd's engine) on a
stream of their own from `mx.new_stream`. This runs the same BatchGenerator decode in this
process on each kind of stream, interleaved, and prints the rate and inter-token times:

    new-per-round   a new stream for every round (the reference of throughput.py)
    new-reused      one stream of its own, made once (what mlxd's engine does)
    default         mx.default_stream(device) (what mlx_lm.server does)
    thread-local    mlx-lm's generation_stream (its module-level thread-local stream)

    python benchmarks/decode_stream.py --shape 1b --model-dtype bfloat16 --streams 1,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PROMPTS, SHAPES, model_for, pct

KINDS = ["new-per-round", "new-reused", "default", "thread-local"]


def decode(model: Any, prompts: list[list[int]], tokens: int, stream: Any
           ) -> tuple[float, float, float]:
    """(decode tok/s after the first token, inter-token p50 ms, first token ms)."""
    from mlx_lm.generate import BatchGenerator
    n = len(prompts)
    gen = BatchGenerator(model, completion_batch_size=n, prefill_batch_size=n,
                         prefill_step_size=512, stream=stream)
    t0 = time.perf_counter()
    gen.insert(prompts, max_tokens=[tokens] * n)
    first = last_step = 0.0
    steps: list[float] = []
    count = 0
    live = n
    while live:
        _, responses = gen.next()
        if not responses:
            continue
        now = time.perf_counter()
        if not first:
            first = now
        else:
            steps.append(now - last_step)
            count += len(responses)
        last_step = now
        live -= sum(r.finish_reason is not None for r in responses)
    gen.close()
    return count / (last_step - first), pct(steps, 0.5) * 1e3, (first - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None)
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from mlxd.engine.load.loader import load_model
    model, tok, _ = load_model(model_for(args), Path(tempfile.gettempdir()) / "mlxd-bench-cache",
                               args.model_dtype)
    device = mx.default_device()
    reused = mx.new_stream(device)
    streams = {"new-reused": lambda: reused, "default": lambda: mx.default_stream(device),
               "new-per-round": lambda: mx.new_stream(device),
               "thread-local": lambda: generation_stream}
    print(f"device {device}, mlx {version('mlx')}")
    for n in [int(s) for s in args.streams.split(",")]:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                           add_generation_prompt=True) for p in PROMPTS[:n]]
        for kind in KINDS:  # warm-up: every shape compiled on every stream
            decode(model, prompts, 16, streams[kind]())
        got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in KINDS}
        for rep in range(args.repeat):
            order = KINDS[rep % len(KINDS):] + KINDS[:rep % len(KINDS)]
            for kind in order:
                got[kind].append(decode(model, prompts, args.max_tokens, streams[kind]()))
        base = statistics.median(r[0] for r in got[KINDS[0]])
        print(f"\n{n} stream(s), {args.max_tokens} tokens, {args.repeat} interleaved reps")
        print("| stream | decode tok/s (median) | vs new-per-round | inter-token p50 ms | "
              "first token ms |")
        print("|---|---|---|---|---|")
        for kind in KINDS:
            rate = statistics.median(r[0] for r in got[kind])
            print(f"| {kind} | {rate:,.0f} | {rate / base:.3f} | "
                  f"{statistics.median(r[1] for r in got[kind]):.2f} | "
                  f"{statistics.median(r[2] for r in got[kind]):.1f} |")


if __name__ == "__main__":
    main()
