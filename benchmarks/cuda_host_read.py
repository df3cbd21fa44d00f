"""What a host read of a CUDA array costs MLX (issue 14; benchmarks/RESULTS.md, "SSD
write-behind on CUDA"): `np.asarray` of an evaluated device array (which moves its buffer to
managed memory), with the GPU idle and busy; `mx.clear_cache()` with such managed buffers
cached (a `cudaFree` of managed memory synchronizes the device); a CPU-stream copy instead;
and whether a GPU op writing into a recycled managed buffer is slower. A ticker thread
measures how long the GIL was held.

    python benchmarks/cuda_host_read.py        # meant for a CUDA machine; runs on any backend
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

MB = 2**20
lags: list[float] = []
stopped = threading.Event()


def _ticker() -> None:
    while not stopped.is_set():
        t0 = time.perf_counter()
        time.sleep(0.0005)
        lags.append(time.perf_counter() - t0 - 0.0005)


def report(label: str, ts: list[float]) -> None:
    lag = sorted(lags) or [0.0]
    print(f"{label:58s} p50 {statistics.median(ts) * 1e3:8.2f} ms max {max(ts) * 1e3:8.2f} | "
          f"GIL ticker lag max {lag[-1] * 1e3:7.2f} p99 "
          f"{lag[int(0.99 * (len(lag) - 1))] * 1e3:6.2f} ms", flush=True)
    lags.clear()


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    threading.Thread(target=_ticker, daemon=True).start()
    w = mx.random.normal((4096, 4096), dtype=mx.bfloat16)
    mx.eval(w)

    def gpu_work(n: int = 20) -> mx.array:
        a = mx.random.normal((4096, 4096), dtype=mx.bfloat16)
        for _ in range(n):
            a = (a @ w) * 0.01
        return a

    mx.eval(gpu_work())
    report("baseline: 20 matmuls 4096^2 (eval)", timed(lambda: mx.eval(gpu_work()), 10))

    def device_array(n: int) -> mx.array:
        x = mx.ones((n,), dtype=mx.uint8) + 1
        mx.eval(x)
        return x

    for size in (16 * MB, 256 * MB):
        label = f"{size // MB} MB"
        ts: list[float] = []
        for busy in (False, True):
            ts = []
            for _ in range(5):
                x = device_array(size)
                g = gpu_work(40) if busy else None
                if g is not None:
                    mx.async_eval(g)
                t0 = time.perf_counter()
                h = np.asarray(x)
                ts.append(time.perf_counter() - t0)
                if g is not None:
                    mx.eval(g)
                del h, x
            report(f"np.asarray of an evaluated {label} GPU array (GPU "
                   f"{'busy' if busy else 'idle'})", ts)
        for busy in (False, True):
            ts = []
            for _ in range(5):
                x = device_array(size)
                h = np.asarray(x)
                del h, x  # a managed buffer, now in MLX's cache
                g = gpu_work(40) if busy else None
                if g is not None:
                    mx.async_eval(g)
                t0 = time.perf_counter()
                mx.clear_cache()
                ts.append(time.perf_counter() - t0)
                if g is not None:
                    mx.eval(g)
            report(f"clear_cache, {label} managed cached (GPU {'busy' if busy else 'idle'})", ts)
        ts = []
        for _ in range(5):
            x = device_array(size)
            t0 = time.perf_counter()
            y = mx.add(x, 0, stream=mx.cpu)
            mx.eval(y)
            h = np.asarray(y)
            ts.append(time.perf_counter() - t0)
            del h, x, y
        report(f"CPU-stream copy, then np.asarray, {label}", ts)

    src = mx.random.normal((32 * MB,), dtype=mx.bfloat16)
    mx.eval(src)
    mx.clear_cache()

    def elementwise() -> list[float]:
        def once() -> None:
            y = src * 2 + 1
            mx.eval(y)
        return timed(once, 20)

    report("elementwise 64 MB, clean cache", elementwise())
    for _ in range(4):
        x = device_array(64 * MB)
        h = np.asarray(x)
        del h, x
    report("elementwise 64 MB, after 4 managed 64 MB buffers cached", elementwise())
    mx.clear_cache()
    report("elementwise 64 MB, after clear_cache", elementwise())
    stopped.set()


if __name__ == "__main__":
    main()
