"""The SSD tier's in-memory index of tail blocks (engine/tail_index.py): built from a scan of
real block files, kept by the engine's confirmed writes, corrected by a read that finds a file
gone; the reader answers through it exactly as it answers from the disk."""

from __future__ import annotations

import os
import random

import pytest

from mlxd.engine.kv.ssd_restore import SsdReader
from mlxd.engine.kv.ssd_tier import SsdStats
from mlxd.engine.kv.tail_index import TailIndex
from mlxd.protocol.block_format import block_key, namespace_key
from support.blocks import write_block

B = 16  # block tokens of these tests


def test_the_longest_tail_the_rest_starts_with_is_found():
    idx = TailIndex(B)
    ns, other = namespace_key("test"), b"o" * 32
    rest = [5, 6, 7, 8, 9, 10]
    for t in (2, 4):
        idx.add(ns, t, block_key(ns, rest[:t]))
    idx.add(ns, 5, block_key(ns, [5, 6, 7, 8, 0]))  # as long, but another prompt's
    idx.add(other, 6, block_key(other, rest))  # this prompt's tokens under another parent
    idx.add(ns, B, block_key(ns, list(range(B))))  # a full block: not a tail
    assert idx.count == 4
    assert idx.best(ns, rest) == (4, block_key(ns, rest[:4]))
    assert idx.best(ns, rest[:3]) == (2, block_key(ns, rest[:2]))  # longer than the rest: no
    assert idx.best(ns, [1, 2, 3]) is None
    assert idx.best(b"x" * 32, rest) is None
    idx.discard(ns, 4, block_key(ns, rest[:4]))
    assert idx.best(ns, rest) == (2, block_key(ns, rest[:2]))
    idx.discard(ns, 4, block_key(ns, rest[:4]))  # twice: nothing happens
    idx.discard(ns, 2, block_key(ns, rest[:2]))
    assert idx.best(ns, rest) is None and idx.count == 2


def test_a_scan_indexes_the_tails_on_disk_and_nothing_else(tmp_path):
    tails = [write_block(tmp_path, [3, 1, 4, 1, 5][:n]) for n in (1, 3, 5)]
    full = write_block(tmp_path, list(range(B)))
    write_block(tmp_path, [9, 9], parent=full.key)  # a tail after a full block
    (tails[0].path.parent / "notes.txt").write_text("not a block")
    (tails[0].path.parent / "zz-1-zz.blk").write_text("a block name that is not hex")
    idx = TailIndex(B)
    idx.scan(tmp_path / "ns")
    assert idx.ready.is_set() and idx.count == 4
    ns = tails[0].namespace
    assert idx.best(ns, [3, 1, 4, 1, 5, 9]) == (5, tails[2].key)
    assert idx.best(full.key, [9, 9, 9]) == (2, block_key(full.key, [9, 9]))
    empty = TailIndex(B)
    empty.scan(tmp_path / "nothing-here")
    assert empty.ready.is_set() and empty.count == 0


def _reader(tmp_path, probe, tails=None):
    return SsdReader(probe.namespace, tmp_path / "ns", probe.layout, B, True, SsdStats(),
                     lambda names: None, tails)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_reader_answers_through_the_index_as_it_does_from_the_disk(tmp_path, seed):
    rnd = random.Random(seed)
    probe = write_block(tmp_path, [1])
    stored = []
    for _ in range(60):  # short prompts and longer ones (a full block, then its tail)
        toks = [rnd.randrange(6) for _ in range(rnd.randrange(2, 2 * B + 4))]
        parent = None
        for start in range(0, len(toks) - len(toks) % B, B):
            parent = write_block(tmp_path, toks[start:start + B], parent).key
        if len(toks) % B:
            write_block(tmp_path, toks[len(toks) - len(toks) % B:], parent)
        stored.append(toks)
    idx = TailIndex(B)
    idx.scan(tmp_path / "ns")
    on_disk, indexed = _reader(tmp_path, probe), _reader(tmp_path, probe, idx)
    prompts = [s[:rnd.randrange(2, len(s) + 2)] + [rnd.randrange(6)] for s in stored]
    prompts += [[rnd.randrange(6) for _ in range(rnd.randrange(2, 40))] for _ in range(60)]
    hits = 0
    for p in prompts:
        want, got = on_disk.better_than_ram(p, 0), indexed.better_than_ram(p, 0)
        assert (want is None) == (got is None), p
        if want is not None:
            hits += 1
            assert got.tokens == want.tokens
            assert all((a == b).all() for wl, gl in zip(want.layers, got.layers, strict=True)
                       for a, b in zip(wl, gl, strict=True))
    assert hits > 25  # the comparison covered hits, not only misses


def test_a_tail_gone_from_the_disk_is_a_miss_and_is_forgotten(tmp_path):
    prompt = [4, 4, 2, 7, 1, 8, 3]
    gone = write_block(tmp_path, prompt[:5])
    kept = write_block(tmp_path, prompt[:2])
    idx = TailIndex(B)
    idx.scan(tmp_path / "ns")
    os.unlink(gone.path)  # the storage worker evicted it after the scan
    stats = SsdStats()
    reader = SsdReader(kept.namespace, tmp_path / "ns", kept.layout, B, True, stats,
                       lambda names: None, idx)
    assert reader.better_than_ram(prompt, 0) is None  # the index named the evicted tail
    assert stats.bad_blocks == 0 and stats.misses == 1  # an eviction, not a bad file
    got = reader.better_than_ram(prompt, 0)  # forgotten: the next longest serves
    assert got is not None and got.tokens == 2


def test_before_its_scan_ends_the_reader_asks_the_disk(tmp_path):
    prompt = [6, 5, 4, 3]
    block = write_block(tmp_path, prompt[:3])
    idx = TailIndex(B)  # not scanned yet: empty and not ready
    got = _reader(tmp_path, block, idx).better_than_ram(prompt, 0)
    assert got is not None and got.tokens == 3


def test_tails_evicted_unseen_are_dropped_by_a_rebuild(tmp_path):
    """Evicted tails that no lookup meets would stay in the index for good: once it holds
    far more than the disk reports, a rescan rebuilds it from the files."""
    kept = [write_block(tmp_path, [2, 7, 1, 8][:n]) for n in (1, 2, 3)]
    idx = TailIndex(B)
    idx.slack = 10
    idx.scan(tmp_path / "ns")
    ns = kept[0].namespace
    for i in range(12):  # tails since evicted by the worker: no file
        idx.add(ns, 4, block_key(ns, [i, i, i, i]))
    assert idx.count == 15
    assert idx.rebuild_if_stale(tmp_path / "ns", blocks_on_disk=3) is None  # 15 <= 2 * 3 + 10
    idx.add(ns, 4, block_key(ns, [98, 98, 98, 98]))
    idx.add(ns, 4, block_key(ns, [99, 99, 99, 99]))  # 17 > 16
    rebuild = idx.rebuild_if_stale(tmp_path / "ns", blocks_on_disk=3)
    assert rebuild is not None
    rebuild.join(10)
    assert idx.count == 3
    assert idx.best(ns, [2, 7, 1, 8, 2]) == (3, kept[2].key)
    assert idx.best(ns, [5, 5, 5, 5, 5]) is None
