"""`mlxd serve` without --isolate: one process. The proxy runs on the asyncio loop and the
same engine code runs on a thread, behind the same protocol over inproc:// endpoints."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

import zmq
import zmq.asyncio

from mlxd.daemon.config import ServeConfig
from mlxd.daemon.launch import (
    command,
    engine_launch,
    proxy_launch,
    storage_launch,
    with_lifeline,
    write_launch,
)
from mlxd.daemon.paths import RunDirLock, private_dirs
from mlxd.daemon.restart_policy import RestartPolicy
from mlxd.daemon.sd_notify import Notifier
from mlxd.protocol import codec, exit_codes, shm, stage_trace
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.lifeline import Lifeline
from mlxd.protocol.listen_address import ListenError
from mlxd.protocol.logs import setup_logging
from mlxd.protocol.models import model_id
from mlxd.protocol.signals import ignore_from_now
from mlxd.proxy.server import run_proxy

log = logging.getLogger("mlxd.daemon")


def run_inprocess(cfg: ServeConfig) -> int:
    console = setup_logging(cfg.daemon.log_level, "mlxd", cfg.daemon.log_format)
    stage_trace.configure(cfg.tuning.stage_trace)
    log.info("starting: model %s, run dir %s", model_id(cfg.daemon.model), cfg.run_dir)
    lock = RunDirLock(cfg.run_dir)
    lock.acquire()
    shm.remove_leftovers(cfg.run_dir)
    private_dirs(cfg)
    reason = None
    try:
        code = asyncio.run(_serve(cfg))
    except ListenError as e:  # said once, as the last line; nothing to retry
        code, reason = exit_codes.CONFIG_ERROR, str(e)
    finally:
        shm.remove_leftovers(cfg.run_dir)
        lock.release()
    if reason:
        console.verdict("mlxd", reason)
    else:
        log.info("stopped")
    return code


async def _serve(cfg: ServeConfig) -> int:
    from mlxd.engine.load import transformers_index
    transformers_index.install(cfg.cache_dir)  # before the engine's imports reach transformers
    from mlxd.engine.service import EngineService

    actx = zmq.asyncio.Context()
    # inproc needs one shared context
    sync_ctx: zmq.Context[zmq.Socket] = zmq.Context.shadow(actx.underlying)
    eps = Endpoints.inproc("mlxd", cfg.run_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = {"n": 0}
    notifier = Notifier()
    watchdog = asyncio.create_task(notifier.watchdog_loop())

    async def report_stopping() -> None:  # a signal or POST /admin/shutdown
        await stop.wait()
        notifier.notify(STOPPING=1, STATUS="draining")

    stopping = asyncio.create_task(report_stopping())

    def on_signal() -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    engines: list[tuple[EngineService, threading.Thread]] = []

    def announce(spec: str, state: str, error: str | None) -> None:
        """To systemd; the engine has logged the change itself."""
        if state == "ready":
            notifier.notify(STATUS=f"serving {model_id(spec)}")

    def announcer(spec: str) -> Callable[[str, str | None], None]:
        """An engine thread's state changes, announced from the event loop."""
        def on_state(state: str, error: str | None) -> None:
            loop.call_soon_threadsafe(announce, spec, state, error)
        return on_state

    def start_engines(where: str) -> None:
        notifier.notify(READY=1, STATUS=f"listening on {where}")
        for eid, spec in cfg.engines().items():
            service = EngineService(
                engine_launch(cfg, eid, spec, epoch=0), eps, sync_ctx, supervised=False,
                on_state=announcer(spec))
            t = threading.Thread(target=service.run, name=f"engine-{eid}", daemon=True)
            t.start()
            engines.append((service, t))

    storage = StorageWorkerProcess(cfg) if cfg.ssd_cache is not None else None
    if storage is not None:
        await storage.start()

    async def stop_engines() -> None:
        """Engines stop first (flushing through the storage worker), while the proxy still
        reads what they send; the storage worker last."""
        for service, _ in engines:
            service.stop()
        for _, t in engines:
            await asyncio.to_thread(t.join, cfg.proxy.shutdown_timeout)
        if storage is not None:
            await storage.stop()

    proxy = asyncio.create_task(run_proxy(
        actx, eps, proxy_launch(cfg, epoch=0), stop, api_key=cfg.daemon.api_key,
        on_listening=start_engines, before_close=stop_engines))
    try:
        await proxy
    finally:
        watchdog.cancel()
        stopping.cancel()
        await stop_engines()
        actx.destroy(linger=0)
        ignore_from_now(loop, (signal.SIGINT, signal.SIGTERM))
    return 0


class StorageWorkerProcess:
    """Without --isolate the storage worker is still its own process: started, restarted after
    a crash (with backoff), and stopped last by the serving process."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.policy = RestartPolicy(base_delay=cfg.daemon.restart_backoff, breaker=False)
        self.stopping = False
        self.lifeline = Lifeline()
        self.launch = codec.encode_launch(with_lifeline(
            storage_launch(cfg, epoch=0, supervised=False), self.lifeline.read_fd))
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *command("storage"), stdin=asyncio.subprocess.PIPE,
            **self.lifeline.spawn_kwargs(dict(os.environ)))
        await write_launch(self.proc, self.launch)
        self._watch = asyncio.create_task(self._watch_exit(self.proc))

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        import time
        code = await proc.wait()
        if self.stopping:
            return
        verdict, delay = self.policy.after_exit(code, time.monotonic())
        if verdict == "failed":  # only a configuration it cannot work with
            log.error("the storage worker cannot run; the SSD tier is off")
            return
        await asyncio.sleep(delay)  # the restart backoff
        if not self.stopping:
            await self.start()

    async def stop(self) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._watch is not None:
            self._watch.cancel()
