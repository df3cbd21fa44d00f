"""Keep the garbage collector off a long-lived process's start-up heap.

A served process builds its heap once (the model's modules, the tokenizer, mlx-lm, aiohttp,
the request handlers) and then allocates only short-lived objects per token and per request.
CPython's cyclic collector still walks the whole old heap in every full collection, and a full
collection runs on whichever thread allocates: in an engine, often the MLX thread in the middle
of a step's graph build. `gc.freeze()` after start-up moves that heap to a generation the
collector never scans, as vLLM's engine does after its start-up; young objects are collected as
usual. The hidden setting `gc_freeze` (`MLXD_GC_FREEZE=0`) leaves the collector as it is, for
benchmarks' comparisons (figures: benchmarks/RESULTS.md, "Start-up heap freeze").
"""

from __future__ import annotations

import gc
import logging
import time

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
