"""What `--dtype auto` chooses on MLX's CPU backend, and why: the same model's one-token
forward pass (a decode step) with float32 activations against float16 and bfloat16, each the
fastest of a few passes after a short prompt, loaded as an engine loads it.

    python benchmarks/cpu_dtype.py                      # the default model
    python benchmarks/cpu_dtype.py --model DIR --dtypes float32,float16
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def decode_step_s(model: Any, prompt: list[int], reps: int) -> float:
    """Seconds of the fastest of `reps` one-token forward passes after `prompt`."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(model(mx.array([prompt[-1:]]), cache=cache))
        best = min(best, time.perf_counter() - t0)
        trim_prompt_cache(cache, 1)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default' or a model directory")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "mlxd-spec-cache"))
    args = ap.parse_args()
    import mlx.core as mx

    from mlxd.engine.load.loader import load_model
    mx.set_default_device(mx.cpu)
    print(f"model {args.model}, {args.prompt_tokens}-token prompt, fastest of {args.reps}; "
          f"{platform.machine()} {mx.default_device()}, mlx {version('mlx')}", flush=True)
    times = {}
    for dtype in args.dtypes.split(","):
        model, tok, _ = load_model(args.model, Path(args.cache_dir), dtype)
        prompt = (tok.encode("The lighthouse keeper watched the storm. " * 40)
                  [:args.prompt_tokens])
        times[dtype] = decode_step_s(model, prompt, args.reps)
        print(f"  {dtype}: {times[dtype] * 1e3:.1f} ms per decode step", flush=True)
        del model
    base = times.get("float32")
    if base:
        for dtype, t in times.items():
            print(f"  {dtype} / float32: {t / base:.1f}x", flush=True)


if __name__ == "__main__":
    main()
