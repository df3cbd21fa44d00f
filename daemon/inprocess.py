"""`mlxd serve` without --isolate: one process. The proxy runs on the asyncio loop and the
same engine code runs on a thread, behind the same protocol over inproc:// endpoints."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

import zmq
import zmq.asyncio

from mlxd.daemon.config import ServeConfig
from mlxd.daemon.paths import RunDirLock
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.logs import setup_logging
from mlxd.protocol.models import model_id
from mlxd.proxy.app import ListenSettings
from mlxd.proxy.openai_schema import Defaults
from mlxd.proxy.server import PoolSettings, run_proxy


def run_inprocess(cfg: ServeConfig) -> int:
    setup_logging(cfg.log_level, "mlxd")
    lock = RunDirLock(cfg.run_dir)
    lock.acquire()
    try:
        return asyncio.run(_serve(cfg))
    finally:
        lock.release()
        print("mlxd: stopped", file=sys.stderr, flush=True)


async def _serve(cfg: ServeConfig) -> int:
    from mlxd.engine.service import EngineService, EngineSettings

    actx = zmq.asyncio.Context()
    sync_ctx = zmq.Context.shadow(actx.underlying)  # inproc needs one shared context
    eps = Endpoints.inproc("mlxd")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_signal() -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            print("mlxd: second signal: exiting now", file=sys.stderr, flush=True)
            import os
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    engines: list[tuple[EngineService, threading.Thread]] = []

    def announce(spec: str, state: str, error: str | None) -> None:
        if state == "ready":
            print(f"mlxd: model {model_id(spec)} ready (in-process)", file=sys.stderr, flush=True)
        elif state == "failed":
            print(f"mlxd: model {model_id(spec)} failed: {error}", file=sys.stderr, flush=True)

    def start_engines(where: str) -> None:
        print(f"mlxd: listening on {where}", file=sys.stderr, flush=True)
        for eid, spec in cfg.engines().items():
            service = EngineService(
                EngineSettings(eid, 0, spec, cfg.cache_dir, cfg.batch, cfg.prefill_step,
                               cfg.dtype, cfg.prompt_cache_gb), eps, sync_ctx, supervised=False,
                on_state=lambda state, error, spec=spec: loop.call_soon_threadsafe(
                    announce, spec, state, error))
            t = threading.Thread(target=service.run, name=f"engine-{eid}", daemon=True)
            t.start()
            engines.append((service, t))

    async def stop_engines() -> None:
        """Engines stop first, while the proxy still reads what they send."""
        for service, _ in engines:
            service.stop()
        for _, t in engines:
            await asyncio.to_thread(t.join, cfg.shutdown_timeout)

    proxy = asyncio.create_task(run_proxy(
        actx, eps, cfg.engines(), Defaults(cfg.temp, cfg.top_p, cfg.top_k, cfg.max_tokens),
        ListenSettings(cfg.host, cfg.port, cfg.socket, cfg.max_body), cfg.run_dir,
        cfg.load_wait, stop, on_listening=start_engines,
        pool=PoolSettings(batch=cfg.batch, aliases=cfg.aliases), before_close=stop_engines))
    try:
        await proxy
    finally:
        await stop_engines()
        actx.destroy(linger=0)
    return 0
