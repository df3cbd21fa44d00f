"""The daemon's listening sockets: TCP on every address the host names, and the Unix socket.

Under --isolate the supervisor opens them once and holds them for the daemon's life; each proxy
it spawns inherits them (`pass_fds`) and serves on them. A connection that arrives while the
proxy is being respawned then waits in the kernel's backlog for the next one instead of being
refused, and the port never changes. Without --isolate the serving process opens them itself.

An address that cannot be used is one clear error (ListenError), never a traceback and never a
retry, and a live daemon's Unix socket is never taken over.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

BACKLOG = 128  # aiohttp's own: the connections the kernel queues while nobody accepts


class ListenError(Exception):
    """The daemon cannot listen where it was told to; retrying will not help."""


def tcp_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def describe_os_error(e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "address already in use"
    return e.strerror or str(e)


@dataclass
class Listeners:
    tcp: list[socket.socket] = field(default_factory=list)
    unix: socket.socket | None = None

    def sockets(self) -> list[socket.socket]:
        return self.tcp + ([self.unix] if self.unix is not None else [])

    @property
    def port(self) -> int:
        return self.tcp[0].getsockname()[1]

    def close(self) -> None:
        for s in self.sockets():
            s.close()


def listen_on(host: str, port: int, unix_path: Path | None) -> Listeners:
    """Bind and listen on both; nothing stays open when either fails."""
    out = Listeners(tcp=bind_tcp(host, port))
    if unix_path is not None:
        try:
            out.unix = bind_unix(unix_path)
        except BaseException:
            out.close()
            raise
    return out


def adopt(fds: list[int]) -> Listeners:
    """The listening sockets a parent opened and handed down, by descriptor."""
    out = Listeners()
    for fd in fds:
        s = socket.socket(fileno=fd)  # family and type are read from the descriptor
        if s.family == socket.AF_UNIX:
            out.unix = s
        else:
            out.tcp.append(s)
    return out


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """One listening socket per address `host` resolves to, all on the same port (for port 0,
    the one the kernel gave the first)."""
    where = tcp_url(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)  # "": every interface
    except OSError as e:  # socket.gaierror: a host name that does not resolve
        raise ListenError(f"cannot listen on {where}: {describe_os_error(e)}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            s.bind(addr)
            s.listen(BACKLOG)
    except OSError as e:
        for s in socks:
            s.close()
        raise ListenError(f"cannot listen on {where}: {describe_os_error(e)}") from None
    return socks


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from the start."""
    claim_unix_path(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
        os.chmod(path, 0o600)
        s.listen(BACKLOG)
    except OSError as e:
        s.close()
        raise ListenError(f"cannot listen on unix:{path}: {describe_os_error(e)}") from None
    finally:
        os.umask(old)
    return s


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
