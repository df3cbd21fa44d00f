"""Run the proxy: engine channel, HTTP listeners, and (when supervised) the control channel."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from mlxd.protocol import codec, exit_codes
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.messages import ChildStates, Heartbeat, Hello, Ready, Shutdown, StopDaemon
from mlxd.proxy import lifecycle
from mlxd.proxy.app import ListenSettings, make_app, start_listeners, write_listen_file
from mlxd.proxy.engine_client import EngineClient
from mlxd.proxy.model_pool import ModelPool
from mlxd.proxy.openai_schema import Defaults
from mlxd.proxy.router import Router

log = logging.getLogger("mlxd.proxy")


@dataclass
class PoolSettings:
    size: int = 1
    idle_unload: float = 0.0
    wait: float = 60.0
    queue: int = 32
    batch: int = 8
    aliases: dict[str, str] = field(default_factory=dict)
    resume: bool = True


class SupervisorLink:
    """The proxy's DEALER to the supervisor (only under `--isolate`)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: Endpoints, epoch: int) -> None:
        self.epoch = epoch
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"proxy:proxy:{epoch}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoints.control)
        self._enc = codec.to_supervisor()

    async def send(self, msg: object) -> None:
        await self.sock.send(self._enc.encode(msg))

    async def run(self, client: EngineClient, where: str, stop: asyncio.Event) -> None:
        dec = codec.to_child()
        parent = os.getppid()
        await self.send(Hello("proxy", "proxy", self.epoch, os.getpid()))
        await self.send(Ready("proxy", self.epoch, where))
        while True:  # cancelled when the proxy closes; runs on while it drains
            while await self.sock.poll(500, zmq.POLLIN):
                msg = dec.decode(await self.sock.recv())
                if isinstance(msg, Shutdown):
                    log.info("shutdown requested: %s", msg.reason)
                    stop.set()
                if isinstance(msg, ChildStates):
                    client.apply_children(msg)
            await self.send(Heartbeat("proxy", self.epoch))
            if os.getppid() != parent:
                log.error("supervisor is gone; exiting")
                os._exit(exit_codes.PARENT_GONE)


async def run_proxy(ctx: zmq.asyncio.Context, endpoints: Endpoints, models: dict[str, str],
                    defaults: Defaults, listen: ListenSettings, run_dir: Path, load_wait: float,
                    stop: asyncio.Event, on_listening: Callable[[str], None] | None = None,
                    supervised: bool = False, epoch: int = 0,
                    pool: PoolSettings | None = None,
                    before_close: Callable[[], Awaitable[None]] | None = None,
                    shutdown_timeout: float = 15.0) -> int:
    """Serve until `stop` is set; then drain (in-flight requests get up to `shutdown_timeout`
    to finish) and close."""
    pool = pool or PoolSettings()
    client = EngineClient(ctx, endpoints, models)
    await client.start()
    link = SupervisorLink(ctx, endpoints, epoch) if supervised else None
    router = Router(client, load_wait=load_wait, aliases=pool.aliases,
                    pool=ModelPool(pool.size, pool.idle_unload) if supervised else None,
                    send=link.send if link else None, batch=pool.batch, pool_wait=pool.wait,
                    pool_queue=pool.queue)
    if link is not None:
        def request_stop() -> None:
            asyncio.ensure_future(link.send(StopDaemon("POST /admin/shutdown")))
    else:
        request_stop = stop.set
    app = make_app(client, router, defaults, listen, shutdown_timeout, request_stop)
    app["resume"] = pool.resume and supervised  # without --isolate no engine comes back
    runner, where = await start_listeners(app, listen)
    write_listen_file(run_dir, app)
    log.info("listening on %s", where)
    if on_listening:
        on_listening(where)
    tasks = [asyncio.create_task(router.idle_loop())]
    if link is not None:
        tasks.append(asyncio.create_task(link.run(client, where, stop)))
    try:
        await stop.wait()
        log.info("draining: up to %.0f s for %d request(s) in flight", shutdown_timeout,
                 router.active)
        result = await lifecycle.drain(app, shutdown_timeout, flush=False)
        log.info("drained in %.2f s (%d aborted)", result["waited_s"], result["aborted"])
        if before_close is not None:
            await before_close()
    finally:
        for t in tasks:
            t.cancel()
        await runner.cleanup()
        await client.close()
        if link is not None:
            link.sock.close()
        if listen.socket_path is not None and listen.socket_path.exists():
            listen.socket_path.unlink()
    return exit_codes.OK
