"""How soon the MLX thread gets the GIL back after waiting on the device.

MLX releases the GIL while `mx.eval`, `tolist()` and `item()` wait for a computation, and so do
llguidance's mask fills. Taking it back, a thread must wait for whichever thread holds it to
let go: a thread busy in Python (the output thread detokenizing a step's tokens, the I/O thread
encoding messages, the proxy's event loop in the in-process mode) is only asked to after the
interpreter's switch interval, 5 ms by default, longer than a whole decode step on a GPU, so a
short evaluation or mask fill beside a busy thread can take the whole interval to come back
(`benchmarks/gil_handback.py`; figures: benchmarks/HISTORY.md section 16).

So the engine's process runs with a short interval; the hidden setting `gil_switch_us`
(`MLXD_GIL_SWITCH_US`) sets another, for the benchmarks' comparisons.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("mlxd.engine")

def apply(us: float) -> None:
    """Set the process's switch interval to `us` microseconds (the whole process: every
    thread shares the GIL)."""
    s = us / 1e6
    if sys.getswitchinterval() != s:
        log.debug("GIL switch interval %.0f µs", s * 1e6)
        sys.setswitchinterval(s)
