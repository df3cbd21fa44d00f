"""Proxy process entry: `python -m mlxd.proxy --run-dir DIR ...` (spawned by the supervisor)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import zmq.asyncio

from mlxd.protocol import faults
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.logs import child_process_setup
from mlxd.proxy.app import ListenSettings
from mlxd.proxy.openai_schema import Defaults
from mlxd.proxy.security import AccessSettings
from mlxd.proxy.server import PoolSettings, run_proxy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxd.proxy")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--socket", default=None)
    ap.add_argument("--engine", action="append", default=[], metavar="ID=SPEC")
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--load-wait", type=float, default=120.0)
    ap.add_argument("--max-body", type=int, default=16 * 1024 * 1024)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--model-pool", type=int, default=1)
    ap.add_argument("--model-alias", action="append", default=[], metavar="NAME=SPEC")
    ap.add_argument("--idle-unload", type=float, default=0.0)
    ap.add_argument("--pool-wait", type=float, default=60.0)
    ap.add_argument("--pool-queue", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--resume", default="on")
    ap.add_argument("--max-header", type=int, default=8190)
    ap.add_argument("--shutdown-timeout", type=float, default=15.0)
    ap.add_argument("--allowed-host", action="append", default=[])
    ap.add_argument("--cors-origin", action="append", default=[])
    args = ap.parse_args(argv)  # the API key comes in the environment, never on a command line
    child_process_setup(args.log_level, f"proxy#{args.epoch}")
    faults.configure(args.epoch)
    models = dict(e.split("=", 1) for e in args.engine)
    access = AccessSettings(args.host, os.environ.get("MLXD_API_KEY") or None,
                            args.allowed_host, args.cors_origin)
    listen = ListenSettings(args.host, args.port, Path(args.socket) if args.socket else None,
                            args.max_body, args.max_header, access)
    defaults = Defaults(args.temp, args.top_p, args.top_k, args.max_tokens)
    pool = PoolSettings(args.model_pool, args.idle_unload, args.pool_wait, args.pool_queue,
                        args.batch, dict(a.split("=", 1) for a in args.model_alias),
                        resume=args.resume == "on")

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        ctx = zmq.asyncio.Context()
        try:
            return await run_proxy(ctx, Endpoints.ipc(args.run_dir), models, defaults, listen,
                                   args.run_dir, args.load_wait, stop, supervised=True,
                                   epoch=args.epoch, pool=pool,
                                   shutdown_timeout=args.shutdown_timeout)
        finally:
            ctx.destroy(linger=0)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
