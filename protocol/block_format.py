"""The SSD tier's block files: names, chained keys and the on-disk layout. Pure functions, a
contract between the storage worker (which writes) and the engine (which looks up and reads).

A block holds every layer's K and V for a span of tokens. Its key is the chained hash
blake3(parent_key || token ids as u32 LE), whose root is the model namespace, so identical
prefixes in different conversations name the same blocks. Full blocks span `block_tokens`
tokens; a tail block spans fewer (the partial span at a checkpoint boundary).

File: ROOT/<namespace>/<parent[:2]>/<parent>-<n_tokens>-<key>.blk
  header (HEADER struct) | token ids (u32 LE x n_tokens) | payload
  payload: per layer, K as (kv_heads, n_tokens, k_head_dim) then V as (kv_heads, n, v_head_dim),
  C order, in the KV dtype. With --kv-bits (`Layout.kv_bits`), K and V are each three arrays,
  as `mx.quantize` gives them: packed (kv_heads, n, head_dim * bits / 32) uint32, then scales
  and biases (kv_heads, n, head_dim / group size) in the KV dtype.
The header records the bits and the group size (0, 0: unquantized) and a reader checks them
against its own: a block of other bits is a miss, never misread. (The namespace, the keys'
root, names them too, so an engine set to other bits does not even find such a block.)

Models with fixed-size state layers (sliding windows, recurrent states) store only their
append-only layers in blocks (`Layout.n_layers` counts those) and the state layers as snapshot
files beside them, one per position a snapshot was taken at:
  ROOT/<namespace>/<parent[:2]>/<parent>-<n_tokens>-<snap key>.snp
named like the block (full or tail) that ends at that position, with `snap_key(key)` for its
key; same header (flag SNAPSHOT, the payload's length and hash) and token ids; payload: per
state layer, as `SnapLayout` says (a ring's last min(position, window) tokens of K then V,
(kv_heads, tokens, head_dim); a recurrent layer's arrays, each whole), C order.
"""

from __future__ import annotations

import array
import math
import os
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import blake3
import msgspec

if TYPE_CHECKING:  # numpy is imported where arrays come in: the supervisor and proxy import
    import numpy as np  # this module (through messages.py) and never need it (14 MB each)

MAGIC = b"MLXDKV01"
VERSION = 1
# ... dtype, kv bits, kv group size (both 0 when unquantized; were padding before they existed)
HEADER = struct.Struct("<8sHHIIIII BBH4x 32s32s32s Q32s")
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
STORED_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}  # numpy's


TAIL, SNAPSHOT = 1, 2  # header flags
BLOCK_SUFFIX, SNAP_SUFFIX = ".blk", ".snp"


class BadBlock(Exception):
    """A missing, torn or corrupt block file: a cache miss, never a wrong answer. `missing`:
    the file is not there (evicted since it was found), nothing wrong with the disk."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


KvDtype = Literal["float32", "float16", "bfloat16"]


class Layout(msgspec.Struct, frozen=True, array_like=True, repr_omit_defaults=True):
    """The shape of a model's KV cache, as blocks store it (and `StoreBlocks` names it)."""
    n_layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: KvDtype
    kv_bits: int = 0  # --kv-bits: 4 or 8; 0: unquantized
    kv_group_size: int = 0

    def parts(self) -> list[tuple[str, int]]:
        """The arrays one layer stores, in order, each (kv_heads, n_tokens, width): (numpy
        dtype as stored, width), K's then V's."""
        raw = STORED_DTYPES[self.dtype]
        out = []
        for dim in (self.k_head_dim, self.v_head_dim):
            if self.kv_bits:
                groups = dim // self.kv_group_size
                out += [("uint32", dim * self.kv_bits // 32), (raw, groups), (raw, groups)]
            else:
                out.append((raw, dim))
        return out

    def layer_bytes(self, n_tokens: int) -> int:
        return self.kv_heads * n_tokens * sum(_ITEMSIZE[t] * w for t, w in self.parts())

    def payload_bytes(self, n_tokens: int) -> int:
        return self.n_layers * self.layer_bytes(n_tokens)


class SnapLeaf(msgspec.Struct, frozen=True, array_like=True):
    """One state layer as a snapshot stores it: a ring (`kind` "ring": heads, head sizes,
    window, dtype) or a recurrent layer's arrays (`kind` "arrays": each slot's shape without
    the batch axis and dtype; an empty shape and dtype for a slot the layer leaves None)."""
    kind: str
    dtype: str = ""  # the ring's (an MLX dtype name)
    kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    window: int = 0
    shapes: list[list[int]] = []
    dtypes: list[str] = []


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4, "int64": 8,
             "uint16": 2}


class SnapLayout(msgspec.Struct, frozen=True, array_like=True):
    """The state layers of a model, in order, as snapshot files store them."""
    leaves: list[SnapLeaf]

    def arrays(self, position: int) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, shape) of every array a snapshot at `position` stores, in order."""
        out: list[tuple[str, tuple[int, ...]]] = []
        for leaf in self.leaves:
            if leaf.kind == "ring":
                t = min(position, leaf.window)
                out += [(leaf.dtype, (leaf.kv_heads, t, leaf.k_head_dim)),
                        (leaf.dtype, (leaf.kv_heads, t, leaf.v_head_dim))]
            else:
                out += [(d, tuple(sh)) for sh, d in zip(leaf.shapes, leaf.dtypes, strict=True)
                        if d]
        return out

    def payload_bytes(self, position: int) -> int:
        return sum(_ITEMSIZE[d] * math.prod(sh) for d, sh in self.arrays(position))

    def max_bytes(self) -> int:
        return self.payload_bytes(max([leaf.window for leaf in self.leaves] + [1]))


def snap_key(key: bytes) -> bytes:
    """The key of the snapshot taken where the block `key` ends (apart from the block's own,
    so the store's index by key holds both)."""
    return blake3.blake3(b"mlxd-snapshot\0" + key).digest()


def snap_file(ns_dir: str, parent: bytes, n_tokens: int, key: bytes) -> str:
    """The snapshot taken where the block (`parent`, `n_tokens`, `key`) ends."""
    return os.path.join(ns_dir, parent.hex()[:2],
                        f"{parent.hex()}-{n_tokens}-{snap_key(key).hex()}{SNAP_SUFFIX}")


PARALLEL_HASH_BYTES = 4 << 20  # larger payloads are hashed on every core (BLAKE3's tree)


def payload_hash(payload: bytes | memoryview) -> bytes:
    """A payload's blake3 digest: on every core for a large one (a state snapshot of a
    sliding-window model is tens of MB; verifying it single-threaded costs a restore more than
    reading it), the same digest either way."""
    if len(payload) >= PARALLEL_HASH_BYTES:
        return blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest()
    return blake3.blake3(payload).digest()


def namespace_key(description: str) -> bytes:
    return blake3.blake3(b"mlxd-namespace\0" + description.encode()).digest()


_NATIVE_U32_LE = array.array("I").itemsize == 4 and sys.byteorder == "little"


def token_bytes(tokens: list[int] | tuple[int, ...] | np.ndarray) -> bytes:
    """Token ids as u32 little-endian, the bytes every key hashes (`array` builds them from a
    Python sequence faster than numpy does)."""
    if _NATIVE_U32_LE and isinstance(tokens, (list, tuple)):
        return array.array("I", tokens).tobytes()
    import numpy as np
    return np.asarray(tokens, dtype="<u4").tobytes()


def block_key(parent: bytes, tokens: list[int] | tuple[int, ...] | np.ndarray) -> bytes:
    return blake3.blake3(parent + token_bytes(tokens)).digest()


def block_spans(parent: bytes, tokens: list[int] | tuple[int, ...], block_tokens: int
                ) -> list[tuple[int, int, bytes, bytes]]:
    """(start, end, parent, key) of every full block and the tail of `tokens`, from one
    conversion of the ids to bytes."""
    data = token_bytes(tokens)
    step = 4 * block_tokens
    out = []
    for start in range(0, len(data), step):
        chunk = data[start:start + step]
        key = blake3.blake3(parent + chunk).digest()
        out.append((start // 4, (start + len(chunk)) // 4, parent, key))
        parent = key
    return out


def prefix_keys(parent: bytes, tokens: list[int]) -> list[bytes]:
    """`block_key(parent, tokens[:t])` for t = 1 .. len(tokens), in one pass of the hash (a
    BLAKE3 digest does not end the hashing): every tail block `tokens` could start with."""
    hasher = blake3.blake3(parent)
    data = token_bytes(tokens)
    keys = []
    for i in range(0, len(data), 4):
        hasher.update(data[i:i + 4])
        keys.append(hasher.digest())
    return keys


def chain_keys(root: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    """Keys of the full blocks covering `tokens` (a trailing partial span is not included)."""
    full = len(tokens) - len(tokens) % block_tokens
    return [key for _, _, _, key in block_spans(root, tokens[:full], block_tokens)]


def block_name(parent: bytes, n_tokens: int, key: bytes) -> str:
    return f"{parent.hex()}-{n_tokens}-{key.hex()}.blk"


def block_path(ns_dir: Path, parent: bytes, n_tokens: int, key: bytes) -> Path:
    return ns_dir / parent.hex()[:2] / block_name(parent, n_tokens, key)


def block_file(ns_dir: str, parent: bytes, n_tokens: int, key: bytes) -> str:
    """`block_path` as a string, for hot paths (a Path costs more to build and test)."""
    return os.path.join(ns_dir, parent.hex()[:2], block_name(parent, n_tokens, key))


def parse_name(name: str, suffixes: tuple[str, ...] = (BLOCK_SUFFIX, SNAP_SUFFIX)
               ) -> tuple[str, int, str] | None:
    """(parent hex, n_tokens, key hex) from a block (or snapshot) file name."""
    if not name.endswith(suffixes):
        return None
    parts = name[:-4].split("-")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


def pack_header(layout: Layout, namespace: bytes, parent: bytes, key: bytes, tokens: list[int],
                payload_hash: bytes, payload_len: int, tail: bool, snapshot: bool = False
                ) -> bytes:
    flags = (TAIL if tail else 0) | (SNAPSHOT if snapshot else 0)
    head = HEADER.pack(MAGIC, VERSION, flags, len(tokens), layout.n_layers,
                       layout.kv_heads, layout.k_head_dim, layout.v_head_dim,
                       DTYPE_CODES[layout.dtype], layout.kv_bits, layout.kv_group_size,
                       namespace, parent, key, payload_len, payload_hash)
    return head + token_bytes(tokens)


def read_block(path: Path, layout: Layout, namespace: bytes, parent: bytes, key: bytes,
               tokens: list[int], verify: bool = True, snapshot_bytes: int = -1) -> memoryview:
    """The payload of a block file (a view of the bytes read), after checking everything that
    can be checked. `snapshot_bytes` (>= 0): a snapshot file of that payload size, whose key
    is `snap_key(key)`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise BadBlock(f"{path.name}: {e}", missing=True) from e
    except OSError as e:
        raise BadBlock(f"{path.name}: {e}") from e
    if len(data) < HEADER.size:
        raise BadBlock(f"{path.name}: truncated header")
    (magic, version, flags, n, n_layers, kv_heads, kd, vd, dtype, bits, group, ns, par, k, plen,
     phash) = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BadBlock(f"{path.name}: not a v{VERSION} block")
    snapshot = snapshot_bytes >= 0
    if bool(flags & SNAPSHOT) != snapshot:
        raise BadBlock(f"{path.name}: a {'block' if snapshot else 'snapshot'}, not a "
                       f"{'snapshot' if snapshot else 'block'}")
    if (ns, par, k) != (namespace, parent, snap_key(key) if snapshot else key):
        raise BadBlock(f"{path.name}: namespace, parent or key mismatch")
    if (n_layers, kv_heads, kd, vd, dtype) != (layout.n_layers, layout.kv_heads, layout.k_head_dim,
                                               layout.v_head_dim, DTYPE_CODES[layout.dtype]):
        raise BadBlock(f"{path.name}: layout mismatch")
    if (bits, group) != (layout.kv_bits, layout.kv_group_size):
        raise BadBlock(f"{path.name}: KV quantization mismatch (block: {bits} bits, group "
                       f"{group}; wanted {layout.kv_bits} bits, group {layout.kv_group_size})")
    if n != len(tokens) or plen != (snapshot_bytes if snapshot else layout.payload_bytes(n)):
        raise BadBlock(f"{path.name}: size mismatch")
    start = HEADER.size + 4 * n
    if len(data) != start + plen:
        raise BadBlock(f"{path.name}: truncated payload")
    if data[HEADER.size:start] != token_bytes(tokens):
        raise BadBlock(f"{path.name}: token mismatch")
    payload = memoryview(data)[start:]
    if verify and payload_hash(payload) != phash:
        raise BadBlock(f"{path.name}: payload hash mismatch")
    return payload
