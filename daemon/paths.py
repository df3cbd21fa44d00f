"""Where mlxd keeps its run dir (sockets, lock) and its cache (converted models, KV blocks)."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from mlxd.protocol.addresses import ensure_private_dir

if TYPE_CHECKING:
    from mlxd.daemon.config import ServeConfig


def default_run_dir() -> Path:
    # Unix socket paths are limited to 104 bytes on macOS: keep this short.
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return Path(xdg) / "mlxd"
    if sys.platform == "darwin":
        return Path(platformdirs.user_runtime_dir("mlxd"))
    return Path(f"/tmp/mlxd-{os.getuid()}")


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("mlxd"))


def private_dirs(cfg: ServeConfig) -> None:
    """The cache (converted models, KV blocks: users' conversations) is the user's alone."""
    ensure_private_dir(cfg.cache_dir)
    if cfg.ssd_cache is not None:
        ensure_private_dir(cfg.ssd_cache)


class RunDirLock:
    """One daemon per run dir. Holding the lock makes it safe to remove what a dead one left."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        ensure_private_dir(self.run_dir)
        fd = os.open(self.run_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SystemExit(
                f"mlxd: another mlxd is already running with run dir {self.run_dir}") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        for pattern in ("*.sock", "listen.json", "*.tmp"):
            for path in self.run_dir.glob(pattern):
                path.unlink(missing_ok=True)

    def release(self) -> None:
        self.remove_leftovers()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            (self.run_dir / "lock").unlink(missing_ok=True)
