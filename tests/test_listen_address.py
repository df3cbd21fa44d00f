"""The daemon's listening sockets (protocol/listen_address.py), on real sockets: one port for
every address of a host, a Unix socket private from the start, nothing left open when either
fails, and sockets handed down by descriptor found by their family."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from mlxd.protocol.listen_address import ListenError, adopt, bind_tcp, listen_on


def test_every_address_of_a_host_listens_on_the_one_port():
    socks = bind_tcp("localhost", 0)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(ports) == 1 and 0 not in ports
        for s in socks:
            with socket.create_connection((s.getsockname()[0], s.getsockname()[1]), 2):
                pass  # accepted into the backlog with nobody calling accept()
    finally:
        for s in socks:
            s.close()


def test_a_taken_port_is_one_clear_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: address already in use"):
            bind_tcp("127.0.0.1", port)
    finally:
        taken.close()


def test_the_unix_socket_is_private_and_a_failure_leaves_nothing_open(tmp_path):
    path = tmp_path / "d.sock"
    held = listen_on("127.0.0.1", 0, path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        free = bind_tcp("127.0.0.1", 0)[0]
        port = free.getsockname()[1]
        free.close()
        with pytest.raises(ListenError, match="another process is serving on it"):
            listen_on("127.0.0.1", port, path)  # a live socket is never taken over
        for s in bind_tcp("127.0.0.1", port):  # the failed attempt let go of its TCP socket
            s.close()
        handed = adopt([os.dup(s.fileno()) for s in held.sockets()])
        assert handed.port == held.port and handed.unix is not None
        assert handed.unix.family == socket.AF_UNIX
        handed.close()
    finally:
        held.close()
