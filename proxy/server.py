"""Run the proxy (the proxy process, or the serving process without `--isolate`): engine
channel, HTTP listeners, and (when supervised) the control channel."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from mlxd.protocol import codec, exit_codes, faults, heap
from mlxd.protocol.addresses import Endpoints, identity
from mlxd.protocol.listen_address import ListenError
from mlxd.protocol.messages import (
    ChildFailed,
    ChildStates,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    StopDaemon,
    ToSupervisor,
)
from mlxd.protocol.settings import ProxyLaunch
from mlxd.proxy import lifecycle
from mlxd.proxy.app import ListenSettings, make_app, start_listeners, write_listen_file
from mlxd.proxy.core.sampling import Defaults
from mlxd.proxy.core.volatile import VolatileLines, compile_patterns
from mlxd.proxy.engines.client import EngineClient
from mlxd.proxy.engines.pool import ModelPool, kv_bytes_per_element
from mlxd.proxy.engines.router import Router
from mlxd.proxy.security import AccessSettings
from mlxd.proxy.state import STATE

log = logging.getLogger("mlxd.proxy")

HEARTBEAT_S = 0.5
FAILURE_DELIVERY_S = 2.0  # how long a ChildFailed may take to reach the supervisor


class SupervisorLink:
    """The proxy's DEALER to the supervisor (only under `--isolate`). Its heartbeats come from
    the event loop on a clock, so a blocked loop is what the supervisor sees go silent."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: Endpoints, epoch: int) -> None:
        self.epoch = epoch
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity("proxy", "proxy", epoch))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoints.control)
        self._enc = codec.to_supervisor()

    async def send(self, msg: ToSupervisor) -> None:
        await self.sock.send(self._enc.encode(msg))

    async def fail(self, reason: str) -> None:
        """Tell the supervisor why this proxy cannot work, before it exits."""
        try:
            await asyncio.wait_for(self.send(ChildFailed("proxy", self.epoch, reason)),
                                   FAILURE_DELIVERY_S)
        except TimeoutError:
            pass  # the supervisor still sees the exit code
        self.sock.close(linger=int(FAILURE_DELIVERY_S * 1000))

    async def run(self, client: EngineClient, where: str, stop: asyncio.Event) -> None:
        dec = codec.to_child()
        parent = os.getppid()
        loop = asyncio.get_running_loop()
        await self.send(Hello("proxy", "proxy", self.epoch, os.getpid()))
        await self.send(Ready("proxy", self.epoch, where))
        next_beat = loop.time()
        while True:  # cancelled when the proxy closes; runs on while it drains
            wait_ms = max(0, math.ceil((next_beat - loop.time()) * 1000))
            if await self.sock.poll(wait_ms):  # flags: POLLIN
                self._handle(dec, await self.sock.recv(), client, stop)
            if loop.time() < next_beat:
                continue
            if os.getppid() != parent:
                log.error("supervisor is gone; exiting")
                os._exit(exit_codes.PARENT_GONE)
            faults.hit("proxy.heartbeat")
            await self.send(Heartbeat("proxy", self.epoch))
            next_beat = loop.time() + HEARTBEAT_S

    @staticmethod
    def _handle(dec: codec.Codec, data: bytes, client: EngineClient,
                stop: asyncio.Event) -> None:
        try:
            msg = dec.decode(data)
        except msgspec.DecodeError as e:
            log.warning("dropped an undecodable control message: %s", e)
            return
        match msg:
            case Shutdown(reason=reason):
                log.info("shutdown requested: %s", reason)
                stop.set()
            case ChildStates():
                client.apply_children(msg)


async def run_proxy(ctx: zmq.asyncio.Context, endpoints: Endpoints, launch: ProxyLaunch,
                    stop: asyncio.Event, *, api_key: str | None,
                    on_listening: Callable[[str], None] | None = None,
                    supervised: bool = False,
                    before_close: Callable[[], Awaitable[None]] | None = None) -> int:
    """Serve until `stop` is set; then drain (in-flight requests get up to the shutdown
    timeout to finish) and close. The API key is not in `launch`: it never leaves the
    environment of the process that holds it."""
    s = launch.settings
    shutdown_timeout = s.shutdown_timeout
    listen = ListenSettings(s.host, s.port, Path(launch.socket) if launch.socket else None,
                            s.max_body, s.max_header,
                            AccessSettings(s.host, api_key, s.allowed_host, s.cors_origin))
    defaults = Defaults(s.temp, s.top_p, s.top_k, s.max_tokens)
    client = EngineClient(ctx, endpoints, launch.engines)
    await client.start()
    link = SupervisorLink(ctx, endpoints, launch.epoch) if supervised else None
    router = Router(client, load_wait=s.load_wait, aliases=s.model_alias,
                    pool=ModelPool(s.model_pool, s.idle_unload) if supervised else None,
                    send=link.send if link else None, batch=launch.engine.batch,
                    kv_element_bytes=kv_bytes_per_element(
                        launch.engine.dtype, launch.engine.kv_bits, launch.engine.kv_group_size),
                    pool_wait=s.pool_wait, pool_queue=s.pool_queue,
                    adapters=launch.engine.adapter)
    if link is not None:
        def request_stop() -> None:
            asyncio.ensure_future(link.send(StopDaemon("POST /admin/shutdown")))
    else:
        request_stop = stop.set
    app = make_app(client, router, defaults, listen,
                   resume=s.resume and supervised,  # without --isolate no engine comes back
                   shutdown_timeout=shutdown_timeout, request_stop=request_stop)
    state = app[STATE]
    state.allow_image_urls = s.allow_image_urls
    state.stream_ping = s.stream_ping
    state.volatile = VolatileLines(compile_patterns(s.volatile_line))
    try:
        runner, where = await start_listeners(app, launch.listen_fds)
    except ListenError as e:
        await client.close()
        if link is None:
            raise  # the serving process says it once, and exits
        await link.fail(str(e))  # the supervisor says it once, and stops the daemon
        return exit_codes.CONFIG_ERROR
    assert state.listening is not None
    write_listen_file(Path(launch.run_dir), state.listening)
    heap.freeze_startup_heap(launch.tuning.gc_freeze)
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
        result = await lifecycle.drain(state, shutdown_timeout, flush=False)
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
        if listen.socket_path is not None and not launch.listen_fds \
                and listen.socket_path.exists():  # the supervisor's socket is its own
            listen.socket_path.unlink()
    return exit_codes.OK
