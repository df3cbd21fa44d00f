"""Endpoint names. Everything lives in one private run directory (mode 0700); AF_UNIX paths
are limited to 104 bytes on macOS, so the run dir must be short."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MAX_UNIX_PATH = 103  # macOS sun_path is 104 bytes including the NUL


@dataclass(frozen=True)
class Endpoints:
    control: str
    requests: str
    outputs: str
    storage: str = ""

    @classmethod
    def ipc(cls, run_dir: Path) -> Endpoints:
        eps = cls(
            control=f"ipc://{run_dir}/ctl.sock",
            requests=f"ipc://{run_dir}/req.sock",
            outputs=f"ipc://{run_dir}/out.sock",
            storage=f"ipc://{run_dir}/store.sock",
        )
        for ep in (eps.control, eps.requests, eps.outputs, eps.storage):
            if len(ep) - len("ipc://") > MAX_UNIX_PATH:
                raise ValueError(f"run dir {run_dir} is too long for a Unix socket path")
        return eps

    @classmethod
    def inproc(cls, tag: str, run_dir: Path) -> Endpoints:
        """Proxy and engine in one process; the storage worker is still its own process."""
        return cls(control=f"inproc://{tag}-ctl", requests=f"inproc://{tag}-req",
                   outputs=f"inproc://{tag}-out", storage=f"ipc://{run_dir}/store.sock")



def identity(role: str, child_id: str, epoch: int) -> bytes:
    """A child's ZeroMQ identity, on the control channel and (engines) the request channel:
    the epoch makes every life of a child a different peer."""
    return f"{role}:{child_id}:{epoch}".encode()


def engine_identity(engine_id: str, epoch: int) -> bytes:
    return identity("engine", engine_id, epoch)


def make_private(endpoint: str) -> None:
    """Mode 0600 for the socket file behind a bound ipc:// endpoint: ZeroMQ creates it with
    the process umask (0755 under the usual 022). The run dir (0700) already keeps others
    out; this keeps every file in it private on its own, as the HTTP socket is."""
    if endpoint.startswith("ipc://"):
        os.chmod(endpoint[len("ipc://"):], 0o600)


def ensure_private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path
