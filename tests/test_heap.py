"""The start-up heap's freeze (protocol/heap.py), in this process."""

import gc

import pytest

from mlxd.protocol import heap


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("1", True), ("0", False),
                                       ("off", False), ("False", False), ("no", False)])
def test_the_freeze_is_on_unless_turned_off(value: str | None, on: bool) -> None:
    assert heap.enabled(value) is on


def test_freezing_moves_the_live_heap_out_of_the_collectors_scans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    try:
        monkeypatch.setenv(heap.ENV, "0")
        assert heap.freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
        monkeypatch.delenv(heap.ENV)
        kept = [[i] for i in range(1000)]  # containers the collector tracks
        frozen = heap.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > len(kept)
        assert all(gc.get_count()[g] == 0 for g in (1, 2))  # the collection ran first
    finally:
        gc.unfreeze()
