"""systemd's notify protocol (sd_notify(3)): datagrams to $NOTIFY_SOCKET. A no-op when the
daemon was not started by systemd with Type=notify (always the case on macOS)."""

from __future__ import annotations

import asyncio
import os
import socket


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        if path.startswith("@"):  # abstract namespace
            path = "\0" + path[1:]
        self.address = path or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watched = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval = int(usec) / 1e6 / 2 if watched else None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str | int) -> bool:
        """notify(READY=1, STATUS="...") sends `READY=1\\nSTATUS=...`."""
        if self.address is None:
            return False
        data = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(data, self.address)
                return True
            except OSError:
                return False

    async def watchdog_loop(self) -> None:
        """Pings at half WATCHDOG_USEC from the event loop, so a wedged loop gets restarted."""
        if self.watchdog_interval is None:
            return
        while True:
            self.notify(WATCHDOG=1)
            await asyncio.sleep(self.watchdog_interval)
