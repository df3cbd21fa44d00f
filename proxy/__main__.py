"""Proxy process entry: `python -m mlxd.proxy`, spawned by the supervisor, which writes its
`ProxyLaunch` on stdin. The API key comes in the environment (MLXD_API_KEY), never in the
launch struct or on a command line."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import zmq.asyncio

from mlxd.protocol import codec, faults, stage_trace
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.lifeline import follow_parent
from mlxd.protocol.logs import child_process_setup
from mlxd.protocol.settings import ProxyLaunch
from mlxd.protocol.signals import ignore_from_now
from mlxd.proxy.server import run_proxy


def main() -> int:
    launch = codec.read_launch(ProxyLaunch)
    follow_parent(launch.lifeline_fd)
    stage_trace.configure(launch.tuning.stage_trace)
    child_process_setup(launch.log_level, f"proxy#{launch.epoch}")
    faults.configure(launch.epoch, launch.tuning.faults)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        ctx = zmq.asyncio.Context()
        try:
            return await run_proxy(ctx, Endpoints.ipc(Path(launch.run_dir)), launch, stop,
                                   api_key=os.environ.get("MLXD_API_KEY") or None,
                                   supervised=True)
        finally:
            ignore_from_now(loop, [signal.SIGTERM])  # the supervisor's, after a group's
            ctx.destroy(linger=0)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
