"""A prompt's last token folded into its final chunk's pass (`engine/last_token_fold.py`)
against its own one-token pass (mlx-lm's generator): the engine's time from a request's insert
to its first token, for final chunks of several lengths after a cached prefix, on a random
model of `--layers` layers. The fold saves a whole one-token pass and pays the last layer's
attention and MLP over the whole chunk (the cache alone stops before them), so it wins for
short chunks and loses for long ones, where depends on the device: this script finds where.

Each setting runs `--reps` times, fold and no fold alternated, on one engine `Runner` driven on
this thread (no processes); a prefix of `--cached` tokens is served from the RAM tier, the
chunk is the request's new tokens. Reports the median ms per setting and the paired ratio.

    python benchmarks/fold_last_token.py --layers 8 --chunks 4,8,16,32,64
    python benchmarks/fold_last_token.py --shape 1b --model-dtype bfloat16 --chunks 8,32,64,256
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--shape", choices=["1b"], default=None, help="a ~1.2B Llama instead")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--chunks", default="4,8,16,32,64")
    ap.add_argument("--cached", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.sample_utils import greedy_sampler

    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from mlxd.protocol.settings import TuningSettings
    from support.random_model import write_random_model

    tmp = Path(tempfile.mkdtemp(prefix="fold-"))
    if a.shape == "1b":
        path = write_random_model(tmp / "m", hidden=2048, layers=16, heads=32, kv_heads=8,
                                  intermediate=8192, vocab=49152, context=8192,
                                  dtype=a.model_dtype)
    else:
        path = write_random_model(tmp / "m", hidden=a.hidden, layers=a.layers,
                                  intermediate=2 * a.hidden, context=8192, dtype=a.model_dtype)
    model, _, _ = load_model(str(path), tmp / "c")
    layers = len(model.layers)
    chunks = [int(c) for c in a.chunks.split(",")]
    rows: list[dict[str, Any]] = []
    for chunk in chunks:
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(a.reps + 1):  # the first pair warms up
            for fold in ((True, False) if rep % 2 == 0 else (False, True)):
                outq: queue.Queue = queue.Queue()
                r = Runner(model, [], batch_size=4, prefill_step=2048, outbox=outq,
                           cache_bytes=1 << 30,
                           tuning=TuningSettings(fold_last_token=4096 if fold else 0))
                head = [(7 * i + rep) % 400 + 5 for i in range(a.cached)]
                _first(r, outq, AddRequest("warm", head + [3], 1, greedy_sampler, []))
                while r.rows:
                    r.step()
                prompt = head + [(11 * i + rep) % 400 + 5 for i in range(chunk)]
                t = _first(r, outq, AddRequest("turn", prompt, 2, greedy_sampler, []))
                if rep:
                    times[fold].append(t)
                while r.rows:
                    r.step()
                r._gen.close()
        ratio = [f / n for f, n in zip(times[True], times[False], strict=True)]
        row: dict[str, Any] = {"chunk": chunk, "fold_ms": statistics.median(times[True]),
               "own_pass_ms": statistics.median(times[False]),
               "ratio": statistics.median(ratio), "ratio_range": [min(ratio), max(ratio)]}
        rows.append(row)
        print(f"chunk {chunk}: folded {row['fold_ms']:.2f} ms, own pass {row['own_pass_ms']:.2f}"
              f" ms, paired {row['ratio']:.3f} ({min(ratio):.3f}-{max(ratio):.3f})", flush=True)
    print(f"\nModel: random, {layers} layers, {a.model_dtype}; device {mx.default_device()}; "
          f"{a.cached} tokens cached; {a.reps} pairs.\n")
    print("| final chunk (tokens) | folded: insert to first token, ms | own pass, ms | "
          "folded / own pass, paired (range) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['chunk']} | {row['fold_ms']:.2f} | {row['own_pass_ms']:.2f} | "
              f"{row['ratio']:.3f} ({row['ratio_range'][0]:.3f}-{row['ratio_range'][1]:.3f}) |")
    if a.out:
        a.out.write_text(json.dumps({"layers": layers, "cached": a.cached, "rows": rows},
                                    indent=1))


def _first(r, outq: queue.Queue, add) -> float:
    """Insert `add` and step until its first token is out: the milliseconds that took."""
    from mlxd.engine.batch.messages import StepTokens
    r.inbox.put(add)
    r.take_commands()
    t0 = time.perf_counter()
    while True:
        r.step()
        while not outq.empty():
            if isinstance(outq.get(), StepTokens):
                return (time.perf_counter() - t0) * 1e3


if __name__ == "__main__":
    main()
