"""What each child process is started with: its command line (`python -m mlxd.<role>`, no
flags) and its launch struct, built here from the one `ServeConfig`, written whole on the
child's stdin. Used by the supervisor and by the one-process mode alike."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from mlxd.daemon.config import ServeConfig
from mlxd.daemon.group import layout_for
from mlxd.protocol import codec
from mlxd.protocol.messages import Role
from mlxd.protocol.settings import EngineLaunch, Launch, PoolShare, ProxyLaunch, StorageLaunch

MODULES: dict[Role, str] = {"proxy": "mlxd.proxy", "engine": "mlxd.engine",
                            "storage": "mlxd.storage_worker"}
ROLES: dict[type, Role] = {ProxyLaunch: "proxy", EngineLaunch: "engine",
                           StorageLaunch: "storage"}


L = TypeVar("L", EngineLaunch, ProxyLaunch, StorageLaunch)


def command(role: Role) -> list[str]:
    return [sys.executable, "-m", MODULES[role]]


def engine_launch(cfg: ServeConfig, engine_id: str, spec: str, epoch: int,
                  share: PoolShare | None = None) -> EngineLaunch:
    """`share`: its part of the machine's memory (daemon/memory_share.py); None: all of it."""
    return EngineLaunch(pool_share=share or PoolShare(),
        engine_id=engine_id, epoch=epoch, model=spec, run_dir=str(cfg.run_dir),
        cache_dir=str(cfg.cache_dir),
        ssd_root=None if cfg.ssd_cache is None else str(cfg.ssd_cache),
        log_level=cfg.daemon.log_level, log_format=cfg.daemon.log_format, settings=cfg.engine,
        group=layout_for(spec, cfg.engine.shard, cfg.proxy.model_alias),
        group_hosts=str(Path(cfg.engine.shard_hosts).expanduser().resolve())
        if cfg.engine.shard_hosts else None, tuning=cfg.tuning,
        hang_timeout=cfg.daemon.hang_timeout)


def proxy_launch(cfg: ServeConfig, epoch: int, listen_fds: list[int] | None = None
                 ) -> ProxyLaunch:
    return ProxyLaunch(
        epoch=epoch, run_dir=str(cfg.run_dir), log_level=cfg.daemon.log_level,
        log_format=cfg.daemon.log_format,
        socket=None if cfg.socket is None else str(cfg.socket), engines=cfg.engines(),
        settings=cfg.proxy, engine=cfg.engine, listen_fds=list(listen_fds or []),
        tuning=cfg.tuning)


def storage_launch(cfg: ServeConfig, epoch: int, supervised: bool) -> StorageLaunch:
    assert cfg.ssd_cache is not None, "no storage worker without an SSD tier"
    return StorageLaunch(
        epoch=epoch, run_dir=str(cfg.run_dir), log_level=cfg.daemon.log_level,
        log_format=cfg.daemon.log_format, root=str(cfg.ssd_cache), supervised=supervised,
        settings=cfg.storage, tuning=cfg.tuning, stop_grace=stop_grace(cfg))


def stop_grace(cfg: ServeConfig) -> float:
    """How long a stopping child may take: the proxy's drain (the shutdown timeout) plus the
    engines' bounded flush."""
    return cfg.proxy.shutdown_timeout + 10


def with_lifeline(launch: L, fd: int) -> L:
    """`launch` naming the lifeline's read end, which the child inherits."""
    return msgspec.structs.replace(launch, lifeline_fd=fd)


async def write_launch(proc: asyncio.subprocess.Process, data: bytes) -> None:
    """The encoded launch struct on the child's stdin (spawned with stdin=PIPE), then EOF.
    A child that died first is noticed by whoever awaits its exit."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
        await proc.stdin.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        proc.stdin.close()


def popen(launch: Launch, **kwargs: Any) -> subprocess.Popen[bytes]:
    """A child started without the daemon (tests, benchmarks), fed `launch` the same way."""
    proc = subprocess.Popen(command(ROLES[type(launch)]), stdin=subprocess.PIPE, **kwargs)
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(codec.encode_launch(launch))
    return proc
