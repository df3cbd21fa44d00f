"""Claiming the proxy's listening addresses: an address that cannot be used is one clear
error (ListenError), never a traceback and never a retry, and a live daemon's Unix socket is
never taken over. Runs in the proxy."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path


class ListenError(Exception):
    """The proxy cannot listen where it was told to; retrying will not help."""


def tcp_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def describe_os_error(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "address already in use"
    return e.strerror or str(e)


def claim_unix_path(path: Path) -> None:
    """Make `path` free for a new Unix socket: a stale socket file (nobody accepts on it) is
    removed; a socket someone still serves on, or any other file, is a ListenError."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise ListenError(f"cannot listen on unix:{path}: {describe_os_error(e)}") from None
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"cannot listen on unix:{path}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # left by a process that died
        return
    except OSError:
        pass  # a socket we cannot even try (permissions, too long): the bind will say why
    else:
        raise ListenError(f"cannot listen on unix:{path}: another process is serving on it")
    finally:
        probe.close()
