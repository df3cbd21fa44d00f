"""Logging set-up shared by every mlxd process: each line names its role, model and epoch."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys


def setup_logging(level: str, tag: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {tag}[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,
    )


def child_process_setup(level: str, tag: str) -> None:
    """For a supervised child: a Ctrl-C in the terminal reaches the whole process group, but
    only the supervisor decides how children stop; SIGABRT dumps every thread's stack."""
    setup_logging(level, tag)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable(file=sys.stderr, all_threads=True)
