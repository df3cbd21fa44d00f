"""Real block files for tests of the block format and the block store."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import blake3
import numpy as np

from mlxd.protocol.block_format import Layout, block_key, block_path, namespace_key, pack_header
from mlxd.storage_worker.block_store import BlockStore


class WrittenBlock(NamedTuple):
    layout: Layout
    namespace: bytes
    parent: bytes
    key: bytes
    path: Path
    payload: bytes


def write_block(root: Path, tokens: list[int], parent: bytes | None = None) -> WrittenBlock:
    """Write one block of a 2-layer float32 layout under `root` as the storage worker does,
    with a payload of counting floats; `parent` chains it to another block (default: root)."""
    lay = Layout(2, 2, 4, 4, "float32")
    ns = namespace_key("test")
    parent = parent or ns
    key = block_key(parent, tokens)
    payload = np.arange(lay.payload_bytes(len(tokens)) // 4, dtype=np.float32).tobytes()
    head = pack_header(lay, ns, parent, key, tokens, blake3.blake3(payload).digest(),
                       len(payload), False)
    path = block_path(root / "ns", parent, len(tokens), key)
    BlockStore(root, 0).write(path, [head, payload])
    return WrittenBlock(lay, ns, parent, key, path, payload)
