"""KV block files (protocol/block_format.py): a verified read returns the payload, and every
kind of damage is a `BadBlock`, never wrong bytes; the engine's reader finds a prompt's tail
block by name."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mlxd.engine.kv.ssd_restore import SsdReader
from mlxd.engine.kv.ssd_tier import SsdStats
from mlxd.protocol.block_format import (
    BadBlock,
    block_key,
    block_spans,
    chain_keys,
    namespace_key,
    prefix_keys,
    read_block,
)
from support.blocks import write_block


def test_block_round_trip_and_every_kind_of_damage(tmp_path):
    tokens = [5, 6, 7, 8]
    lay, ns, parent, key, path, payload = write_block(tmp_path, tokens)
    assert bytes(read_block(path, lay, ns, parent, key, tokens)) == payload
    with pytest.raises(BadBlock):  # asked for other tokens
        read_block(path, lay, ns, parent, key, [5, 6, 7, 9])
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[-3] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(BadBlock, match="hash"):
        read_block(path, lay, ns, parent, key, tokens)
    assert read_block(path, lay, ns, parent, key, tokens, verify=False)  # verify off: trusted
    path.write_bytes(good[:len(good) // 2])
    with pytest.raises(BadBlock, match="truncated"):
        read_block(path, lay, ns, parent, key, tokens)
    path.unlink()
    with pytest.raises(BadBlock):
        read_block(path, lay, ns, parent, key, tokens)


def test_prefix_keys_are_the_block_keys_of_every_prefix():
    parent = namespace_key("test")
    tokens = [5, 70000, 3, 3, 2**31, 0, 9]
    assert prefix_keys(parent, tokens) == [block_key(parent, tokens[:t])
                                           for t in range(1, len(tokens) + 1)]
    assert prefix_keys(parent, []) == []


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 23])
def test_block_spans_chain_the_block_keys_from_one_conversion(n):
    """The keys the write-behind names blocks by are the chained `block_key`s of each span,
    whatever the ids' container (list, tuple, numpy), ids up to 2**32 - 1 included."""
    root = namespace_key("test")
    tokens = [(i * 2654435761) % 2**32 for i in range(n)]
    want, parent = [], root
    for start in range(0, n, 8):
        span = tokens[start:start + 8]
        key = block_key(parent, np.array(span, dtype=np.int64))
        want.append((start, start + len(span), parent, key))
        parent = key
    assert block_spans(root, tokens, 8) == want
    assert block_spans(root, tuple(tokens), 8) == want
    assert chain_keys(root, tokens, 8) == [k for s, e, _, k in want if e - s == 8]


def test_the_ssd_reader_finds_the_longest_tail_among_other_prompts_tails(tmp_path,
                                                                         monkeypatch):
    """A prompt's stored tails are found by name: the longest that matches wins, tails of
    other prompts under the same parent (thousands, on a daemon that ran for months) and
    longer tails that diverge from the prompt are not taken. The folder is never listed: a
    lookup's cost must not grow with what the disk holds."""
    prompt = list(range(100, 140))
    for i in range(300):  # other conversations' tails, in the same folder
        write_block(tmp_path, [7, i % 50, i, 1 + i % 13][: 1 + i % 4])
    short = write_block(tmp_path, prompt[:5])
    longest = write_block(tmp_path, prompt[:12])
    write_block(tmp_path, prompt[:20] + [1])  # longer, but not this prompt's
    def no_listing(*_):
        raise AssertionError("the SSD lookup listed a folder")
    monkeypatch.setattr(os, "listdir", no_listing)
    monkeypatch.setattr(os, "scandir", no_listing)
    stats = SsdStats()
    reader = SsdReader(short.namespace, tmp_path / "ns", short.layout, 16, True, stats,
                       lambda names: None)
    got = reader.better_than_ram(prompt, 0)
    assert got is not None and got.tokens == 12 and stats.hits == 1
    lay = longest.layout
    k0 = np.frombuffer(longest.payload, np.float32, lay.kv_heads * 12 * lay.k_head_dim)
    assert np.array_equal(got.layers[0][0].reshape(-1), k0)
    assert reader.better_than_ram(prompt, 12) is None  # RAM holds as much: files not read
    assert reader.better_than_ram([1, 2, 3, 4], 0) is None and stats.misses == 1
