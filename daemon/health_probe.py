"""The supervisor's liveness probe of the proxy: `GET /health` over a raw asyncio connection
(the supervisor does not import aiohttp). Any HTTP status line is an answer."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

REQUEST = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class ProbeAddress:
    unix: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0


def probe_address(socket_path: Path | None, host: str, run_dir: Path) -> ProbeAddress | None:
    """The Unix socket if there is one, else the TCP port the proxy wrote to listen.json."""
    if socket_path is not None:
        return ProbeAddress(unix=socket_path)
    try:
        port = int(json.loads((run_dir / "listen.json").read_text())["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
    return ProbeAddress(host=wildcard.get(host, host), port=port)


def parse_status_line(line: bytes) -> int | None:
    parts = line.split(None, 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit():
        return int(parts[1])
    return None


async def probe(address: ProbeAddress, timeout: float) -> int | None:
    """The HTTP status of `GET /health`, or None when no answer came within `timeout`."""
    try:
        return await asyncio.wait_for(_ask(address), timeout)
    except (TimeoutError, OSError, ValueError, EOFError):
        return None


async def _ask(address: ProbeAddress) -> int | None:
    if address.unix is not None:
        reader, writer = await asyncio.open_unix_connection(str(address.unix))
    else:
        reader, writer = await asyncio.open_connection(address.host, address.port)
    try:
        writer.write(REQUEST)
        await writer.drain()
        return parse_status_line(await reader.readline())
    finally:
        writer.close()
