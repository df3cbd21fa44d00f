"""The SSD tier's block files: names, chained keys and the on-disk layout. Pure functions, a
contract between the storage worker (which writes) and the engine (which looks up and reads).

A block holds every layer's K and V for a span of tokens. Its key is the chained hash
blake3(parent_key || token ids as u32 LE), whose root is the model namespace, so identical
prefixes in different conversations name the same blocks. Full blocks span `block_tokens`
tokens; a tail block spans fewer (the partial span at a checkpoint boundary).

File: ROOT/<namespace>/<parent[:2]>/<parent>-<n_tokens>-<key>.blk
  header (HEADER struct) | token ids (u32 LE x n_tokens) | payload
  payload: per layer, K as (kv_heads, n_tokens, k_head_dim) then V as (kv_heads, n, v_head_dim),
  C order, in the KV dtype.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Literal

import blake3
import msgspec
import numpy as np

MAGIC = b"MLXDKV01"
VERSION = 1
HEADER = struct.Struct("<8sHHIIIII B7x 32s32s32s Q32s")
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


class BadBlock(Exception):
    """A missing, torn or corrupt block file: a cache miss, never a wrong answer."""


KvDtype = Literal["float32", "float16", "bfloat16"]


class Layout(msgspec.Struct, frozen=True, array_like=True):
    """The shape of a model's KV cache, as blocks store it (and `StoreBlocks` names it)."""
    n_layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: KvDtype

    def layer_bytes(self, n_tokens: int) -> int:
        return self.kv_heads * n_tokens * (self.k_head_dim + self.v_head_dim) \
            * DTYPE_SIZES[self.dtype]

    def payload_bytes(self, n_tokens: int) -> int:
        return self.n_layers * self.layer_bytes(n_tokens)


def namespace_key(description: str) -> bytes:
    return blake3.blake3(b"mlxd-namespace\0" + description.encode()).digest()


def block_key(parent: bytes, tokens: list[int] | np.ndarray) -> bytes:
    return blake3.blake3(parent + np.asarray(tokens, dtype="<u4").tobytes()).digest()


def chain_keys(root: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    """Keys of the full blocks covering `tokens` (a trailing partial span is not included)."""
    keys = []
    parent = root
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = block_key(parent, tokens[start:start + block_tokens])
        keys.append(parent)
    return keys


def block_name(parent: bytes, n_tokens: int, key: bytes) -> str:
    return f"{parent.hex()}-{n_tokens}-{key.hex()}.blk"


def block_path(ns_dir: Path, parent: bytes, n_tokens: int, key: bytes) -> Path:
    return ns_dir / parent.hex()[:2] / block_name(parent, n_tokens, key)


def parse_name(name: str) -> tuple[str, int, str] | None:
    """(parent hex, n_tokens, key hex) from a block file name."""
    if not name.endswith(".blk"):
        return None
    parts = name[:-4].split("-")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


def pack_header(layout: Layout, namespace: bytes, parent: bytes, key: bytes, tokens: list[int],
                payload_hash: bytes, payload_len: int, tail: bool) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, 1 if tail else 0, len(tokens), layout.n_layers,
                       layout.kv_heads, layout.k_head_dim, layout.v_head_dim,
                       DTYPE_CODES[layout.dtype], namespace, parent, key, payload_len,
                       payload_hash)
    return head + np.asarray(tokens, dtype="<u4").tobytes()


def read_block(path: Path, layout: Layout, namespace: bytes, parent: bytes, key: bytes,
               tokens: list[int], verify: bool = True) -> memoryview:
    """The payload of a block file (a view of the bytes read), after checking everything that
    can be checked."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadBlock(f"{path.name}: {e}") from e
    if len(data) < HEADER.size:
        raise BadBlock(f"{path.name}: truncated header")
    (magic, version, _flags, n, n_layers, kv_heads, kd, vd, dtype, ns, par, k, plen,
     phash) = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BadBlock(f"{path.name}: not a v{VERSION} block")
    if (ns, par, k) != (namespace, parent, key):
        raise BadBlock(f"{path.name}: namespace, parent or key mismatch")
    if (n_layers, kv_heads, kd, vd, dtype) != (layout.n_layers, layout.kv_heads, layout.k_head_dim,
                                               layout.v_head_dim, DTYPE_CODES[layout.dtype]):
        raise BadBlock(f"{path.name}: layout mismatch")
    if n != len(tokens) or plen != layout.payload_bytes(n):
        raise BadBlock(f"{path.name}: size mismatch")
    start = HEADER.size + 4 * n
    if len(data) != start + plen:
        raise BadBlock(f"{path.name}: truncated payload")
    if data[HEADER.size:start] != np.asarray(tokens, dtype="<u4").tobytes():
        raise BadBlock(f"{path.name}: token mismatch")
    payload = memoryview(data)[start:]
    if verify and blake3.blake3(payload).digest() != phash:
        raise BadBlock(f"{path.name}: payload hash mismatch")
    return payload
