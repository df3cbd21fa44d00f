"""KV block files (protocol/block_format.py): a verified read returns the payload, and every
kind of damage is a `BadBlock`, never wrong bytes."""

from __future__ import annotations

import pytest

from mlxd.protocol.block_format import BadBlock, read_block
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
