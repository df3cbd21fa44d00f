"""A child's tie to the process that started it: the parent holds the write end of one pipe
and every child inherits its read end (the fd its launch struct names). Nothing is ever
written; when the parent dies, even by SIGKILL, the kernel closes the write end and each
child's blocking read returns at once, so the child follows within milliseconds instead of
noticing on its next heartbeat. Portable (no PR_SET_PDEATHSIG, which macOS lacks)."""

from __future__ import annotations

import logging
import os
import threading

from mlxd.protocol import exit_codes

log = logging.getLogger(__name__)


class Lifeline:
    """The parent's side: created once, before the first child; held until the parent exits."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # both close-on-exec; pass_fds opens one

    def spawn_kwargs(self, env: dict[str, str]) -> dict:
        """What `create_subprocess_exec`/`Popen` needs to hand the read end to a child (whose
        launch struct names it: `daemon/launch.with_lifeline`)."""
        return {"pass_fds": (self.read_fd,), "env": env}


def follow_parent(fd: int | None) -> None:
    """The child's side: exit when the parent is gone. A no-op when started without one."""
    if fd is None:
        return
    os.set_inheritable(fd, False)  # not inherited by this process's own children

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        log.error("supervisor is gone; exiting")
        os._exit(exit_codes.PARENT_GONE)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
