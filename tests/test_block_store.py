"""The storage worker's block directory (storage_worker/block_store.py), without processes:
a rescan drops torn temporaries, the byte cap evicts leaves before the blocks they chain to."""

from __future__ import annotations

from mlxd.storage_worker.block_store import BlockStore
from support.blocks import write_block


def test_block_store_rescan_drops_temporaries_and_evicts_leaves_first(tmp_path):
    first = write_block(tmp_path, [1, 2])
    second = write_block(tmp_path, [3, 4], parent=first.key)
    (first.path.parent / "junk.blk.tmp").write_bytes(b"torn")
    store = BlockStore(tmp_path, cap_bytes=first.path.stat().st_size)
    store.scan()
    assert not list(tmp_path.rglob("*.tmp"))
    assert len(store.blocks) == 2
    assert store.evict_to_cap() == 1
    # the child went first: the chain stays whole
    assert first.path.exists() and not second.path.exists()
