"""Keep the garbage collector off a long-lived process's start-up heap, and give an idle
process's free heap back to the system.

A served process builds its heap once (the model's modules, the tokenizer, mlx-lm, aiohttp,
the request handlers) and then allocates only short-lived objects per token and per request.
CPython's cyclic collector still walks the whole old heap in every full collection, and a full
collection runs on whichever thread allocates: in an engine, often the MLX thread in the middle
of a step's graph build. `gc.freeze()` after start-up moves that heap to a generation the
collector never scans, as vLLM's engine does after its start-up; young objects are collected as
usual. The hidden setting `gc_freeze` (`MLXD_GC_FREEZE=0`) leaves the collector as it is, for
benchmarks' comparisons (figures: benchmarks/RESULTS.md, "Start-up heap freeze").

The C allocator keeps what a busy spell freed (a burst's requests, token lists, msgpack
buffers, numpy copies of KV blocks) for reuse: glibc returns its heap's pages only from the
top, and a single live object above them keeps them all. `give_back_free_heap` returns every
free page (glibc's `malloc_trim(0)`; on macOS `malloc_zone_pressure_relief` for all zones), which
an engine does once per idle spell, beside MLX's own buffer cache (figures:
benchmarks/RESULTS.md, "Memory"). The hidden setting `heap_trim` (`MLXD_HEAP_TRIM=0`) leaves it
to the allocator.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable

log = logging.getLogger("mlxd")

def freeze_startup_heap(enabled: bool = True) -> int:
    """Collect what start-up left behind, then freeze the rest; the objects frozen (0: off)."""
    if not enabled:
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the collector's scans in %.1f ms", frozen,
              (time.perf_counter() - t0) * 1e3)
    return frozen


def _heap_release() -> Callable[[], object] | None:
    """The C library's call that returns free heap pages to the system, or None (another
    libc: musl, Windows). (ctypes is imported here: the small processes never need it.)"""
    import ctypes
    try:
        if sys.platform == "darwin":
            from ctypes.util import find_library
            libc = ctypes.CDLL(find_library("c") or "libSystem.dylib")
            relief = libc.malloc_zone_pressure_relief
            relief.argtypes, relief.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t
            return lambda: relief(None, 0)  # every zone, as much as it can
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return lambda: trim(0)
    except (OSError, AttributeError):
        return None


_release: list[Callable[[], object] | None] = []  # looked up on first use (engines only)


def give_back_free_heap() -> bool:
    """Return the C heap's free pages to the system (see the module text); False where the C
    library has no such call."""
    if not _release:
        _release.append(_heap_release())
    if _release[0] is None:
        return False
    _release[0]()
    return True
