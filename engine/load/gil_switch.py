"""How soon the MLX thread gets the GIL back after waiting on the device.

MLX releases the GIL while `mx.eval`, `tolist()` and `item()` wait for a computation, and so do
llguidance's mask fills. Taking it back, a thread must wait for whichever thread holds it to
let go: a thread busy in Python (the output thread detokenizing a step's tokens, the I/O thread
encoding messages, the proxy's event loop in the in-process mode) is only asked to after the
interpreter's switch interval, 5 ms by default, longer than a whole decode step on a GPU. On
this project's CPU machine (`benchmarks/gil_handback.py`), a 2.7 ms evaluation beside a busy
thread took 7.9 ms at 5 ms and 3.0 ms at 0.2 ms; a 22 µs grammar mask fill took 5.3 ms and
22 µs.

So the engine's process runs with a short interval. MLXD_GIL_SWITCH_US sets another (in
microseconds), for the benchmarks' comparisons.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("mlxd.engine")

DEFAULT_US = 200.0
ENV = "MLXD_GIL_SWITCH_US"


def interval_s(value: str | None) -> float:
    """The switch interval to use, in seconds: `value` in µs when it is a positive number."""
    try:
        us = float(value) if value else DEFAULT_US
    except ValueError:
        us = DEFAULT_US
    return (us if us > 0 else DEFAULT_US) / 1e6


def apply() -> None:
    """Set the process's switch interval (the whole process: every thread shares the GIL)."""
    s = interval_s(os.environ.get(ENV))
    if sys.getswitchinterval() != s:
        log.debug("GIL switch interval %.0f µs", s * 1e6)
        sys.setswitchinterval(s)
