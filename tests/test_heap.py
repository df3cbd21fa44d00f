"""The start-up heap's freeze (protocol/heap.py), in this process."""

import gc

from mlxd.protocol import heap


def test_freezing_moves_the_live_heap_out_of_the_collectors_scans() -> None:
    gc.unfreeze()
    try:
        assert heap.freeze_startup_heap(enabled=False) == 0 and gc.get_freeze_count() == 0
        kept = [[i] for i in range(1000)]  # containers the collector tracks
        frozen = heap.freeze_startup_heap()
        # (frozen objects leave the count only when freed: other threads of this test process,
        # left by earlier tests, may free some meanwhile)
        assert frozen >= gc.get_freeze_count() > len(kept)
        assert all(gc.get_count()[g] == 0 for g in (1, 2))  # the collection ran first
    finally:
        gc.unfreeze()
