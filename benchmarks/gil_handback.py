"""How long a thread waits to get the GIL back after a call that released it, beside a thread
busy in Python, at CPython's switch interval and at the engine's (engine/load/gil_switch.py).

The engine's MLX thread releases the GIL in every device wait (`mx.eval`, `tolist`) and in
llguidance's mask fills; the output and I/O threads run Python meanwhile. This times, alone and
beside a busy thread at each interval: an MLX evaluation of a small matmul chain, and one
llguidance JSON-schema mask fill for the default tokenizer's vocabulary (skipped when the
default model has not been converted yet).

    python benchmarks/gil_handback.py --intervals-us 5000,200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--intervals-us", default="5000,200")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    import mlx.core as mx
    a = mx.random.normal((96, 96))
    mx.eval(a)

    def evaluation() -> None:
        y = a
        for _ in range(4):
            y = y @ a
        mx.eval(y)
    calls: dict[str, Callable[[], None]] = {"MLX evaluation": evaluation}
    fill = _mask_fill()
    if fill is not None:
        calls["llguidance mask fill"] = fill
    before = sys.getswitchinterval()
    try:
        for name, call in calls.items():
            row = [f"alone {_median_ms(call, args.reps):.3f} ms"]
            for us in (float(x) for x in args.intervals_us.split(",")):
                sys.setswitchinterval(us / 1e6)
                with _busy_thread():
                    ms = _median_ms(call, args.reps)
                row.append(f"beside a busy thread at {us:g} µs {ms:.3f} ms")
            print(f"{name}: " + "; ".join(row), flush=True)
    finally:
        sys.setswitchinterval(before)


def _median_ms(call: Callable[[], None], reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


class _busy_thread:
    def __enter__(self) -> None:
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        n = 0
        while not self.stop:
            n += 1

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()


def _mask_fill() -> Callable[[], None] | None:
    """One mask fill of a JSON-schema matcher, or None without the converted default model."""
    import json

    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    from mlx_lm.utils import load_tokenizer
    from platformdirs import user_cache_dir
    found = sorted(Path(user_cache_dir("mlxd")).glob("models/SmolLM2-135M-Instruct*"))
    if not found:
        return None
    tok = load_tokenizer(found[0])
    ll = llguidance.hf.from_tokenizer(tok._tokenizer, n_vocab=len(tok))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema)))
    bits = allocate_token_bitmask(1, len(tok))
    return lambda: fill_next_token_bitmask(matcher, bits, 0)


if __name__ == "__main__":
    main()
