"""The benchmarks' HTTP clients in a process of their own.

The in-process reference (mlx-lm's BatchGenerator) runs in the benchmark's own process, with
the model, the tokenizer, MLX's device threads and every library they pull in. A client in a
spawned process (no MLX imported, no model) shares neither that interpreter's GIL nor its
garbage, so it times the server and nothing of the reference. (It was made for the 87-190 ms
lags of some H200 burst rounds between the proxy's write and the client's read; they stayed
with the client here, and were the rounds' text coming out only with their last token:
benchmarks/HISTORY.md section 23.) Its clock is the parent's: `time.perf_counter` is the
host's monotonic clock on Linux and macOS alike.

    clients = ClientProcess()
    result = await clients.run("throughput", "http_round", *args)  # module, coroutine, args
    clients.close()
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection) -> None:
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        module, name, args = job
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send((True, asyncio.run(fn(*args))))
        except Exception as e:  # noqa: BLE001 - the parent raises it
            conn.send((False, f"{type(e).__name__}: {e}"))


class ClientProcess:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that holds MLX's device state
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True,
                                 name="benchmark-clients")
        self._proc.start()
        child.close()

    async def run(self, module: str, name: str, *args: Any) -> Any:
        """`await module.name(*args)` in the client process; its result (picklable)."""
        self._conn.send((module, name, args))
        ok, value = await asyncio.get_running_loop().run_in_executor(None, self._conn.recv)
        if not ok:
            raise RuntimeError(f"benchmark client process: {value}")
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
