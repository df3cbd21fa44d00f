"""Run the proxy: engine channel, HTTP listeners, and (when supervised) the control channel."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Callable

import zmq
import zmq.asyncio

from mlxd.protocol import codec, exit_codes
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.messages import Heartbeat, Hello, Ready, Shutdown
from mlxd.proxy.app import ListenSettings, make_app, start_listeners, write_listen_file
from mlxd.proxy.engine_client import EngineClient
from mlxd.proxy.openai_schema import Defaults

log = logging.getLogger("mlxd.proxy")


async def run_proxy(ctx: zmq.asyncio.Context, endpoints: Endpoints, models: dict[str, str],
                    defaults: Defaults, listen: ListenSettings, run_dir: Path, load_wait: float,
                    stop: asyncio.Event, on_listening: Callable[[str], None] | None = None,
                    supervised: bool = False, epoch: int = 0) -> int:
    client = EngineClient(ctx, endpoints, models)
    await client.start()
    app = make_app(client, defaults, load_wait, listen.max_body)
    runner, where = await start_listeners(app, listen)
    write_listen_file(run_dir, app)
    log.info("listening on %s", where)
    if on_listening:
        on_listening(where)
    ctl_task = None
    if supervised:
        ctl_task = asyncio.create_task(_control(ctx, endpoints, epoch, where, stop))
    try:
        await stop.wait()
    finally:
        if ctl_task is not None:
            ctl_task.cancel()
        await runner.cleanup()
        await client.close()
        if listen.socket_path is not None and listen.socket_path.exists():
            listen.socket_path.unlink()
    return exit_codes.OK


async def _control(ctx: zmq.asyncio.Context, endpoints: Endpoints, epoch: int, where: str,
                   stop: asyncio.Event) -> None:
    enc = codec.to_supervisor()
    dec = codec.to_child()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"proxy:proxy:{epoch}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoints.control)
    parent = os.getppid()
    try:
        await sock.send(enc.encode(Hello("proxy", "proxy", epoch, os.getpid())))
        await sock.send(enc.encode(Ready("proxy", epoch, where)))
        while not stop.is_set():
            if await sock.poll(500, zmq.POLLIN):
                msg = dec.decode(await sock.recv())
                if isinstance(msg, Shutdown):
                    log.info("shutdown requested: %s", msg.reason)
                    stop.set()
                    return
            await sock.send(enc.encode(Heartbeat("proxy", epoch)))
            if os.getppid() != parent:
                log.error("supervisor is gone; exiting")
                os._exit(exit_codes.PARENT_GONE)
    finally:
        sock.close()
