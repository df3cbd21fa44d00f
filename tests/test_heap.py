"""The start-up heap's freeze (protocol/heap.py), in this process, and the free heap given
back to the system, in a process of its own."""

import gc
import platform
import subprocess
import sys

import pytest

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


HEAP_SCRIPT = """
import sys
from mlxd.protocol import heap

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

base = rss_mb()
blocks = [bytes(64 * 1024) for _ in range(2048)]  # 128 MB in the heap (under mmap's threshold)
pin = bytes(64 * 1024)  # a live block above them: the heap's top cannot shrink by itself
del blocks
freed = rss_mb()
released = heap.give_back_free_heap() if sys.argv[1] == "trim" else False
print(base, freed, rss_mb(), released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="measured through glibc's heap and /proc")
@pytest.mark.parametrize("how", ["trim", "keep"])
def test_free_heap_pages_go_back_to_the_system_only_when_given_back(how: str) -> None:
    out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, how], capture_output=True,
                         text=True, check=True).stdout.split()
    base, freed, after = (float(x) for x in out[:3])
    assert freed > base + 64  # the freed blocks are still resident
    if how == "trim":
        assert out[3] == "True" and after < base + 16
    else:
        assert after > freed - 8
