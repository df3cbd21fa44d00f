"""State snapshots on the SSD tier (models with sliding-window or recurrent layers; the file
format is in protocol/block_format.py): the layout a model's snapshots take, the arrays one
is written from, and the host arrays one is read back as. The write-behind (`ssd_tier.py`)
and the reader (`ssd_restore.py`) use these; neither knows the cache classes."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxd.engine.kv.codec import ARRAYS, RING, Arrays, CacheCodec, Ring, State
from mlxd.protocol.block_format import SnapLayout, SnapLeaf


def dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def snap_layout(codec: CacheCodec, probe: list[Any]) -> SnapLayout | None:
    """The snapshot layout of a model from its cache after a one-token forward pass (None: no
    state layers)."""
    if not codec.has_state:
        return None
    leaves = codec.leaves(probe)
    out = []
    for i in codec.state_leaves:
        c = leaves[i]
        if codec.kinds[i] == RING:
            k, v = c.keys, c.values
            out.append(SnapLeaf(RING, dtype_name(k.dtype), k.shape[1], k.shape[3], v.shape[3],
                                c.max_size))
        else:
            assert codec.kinds[i] == ARRAYS
            out.append(SnapLeaf(ARRAYS, shapes=[list(a.shape[1:]) if a is not None else []
                                                for a in c.cache],
                                dtypes=[dtype_name(a.dtype) if a is not None else ""
                                        for a in c.cache]))
    return SnapLayout(out)


def state_parts(states: list[State]) -> list[Any]:
    """The MLX arrays a snapshot file holds, in its order (bfloat16 viewed as uint16: numpy
    has no bfloat16)."""
    import mlx.core as mx
    arrays: list[Any] = []
    for s in states:
        if isinstance(s, Ring):
            arrays += [s.keys, s.values]
        else:
            arrays += [a for a in s.arrays if a is not None]
    return [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]


def fits(states: list[State], layout: SnapLayout, position: int) -> bool:
    """Whether `states` are what `layout` stores at `position` (shapes and dtypes)."""
    want = layout.arrays(position)
    got: list[tuple[str, tuple[int, ...]]] = []
    for s in states:
        arrays = [s.keys, s.values] if isinstance(s, Ring) else [a for a in s.arrays
                                                                 if a is not None]
        got += [(dtype_name(a.dtype), tuple(a.shape[1:])) for a in arrays]
    return got == want


_NUMPY = {"bfloat16": np.uint16}


def parse_states(payload: memoryview, layout: SnapLayout, position: int) -> list[Any]:
    """A snapshot file's payload as host states (`codec.states_from_host` makes them MLX):
    per state layer ("ring", keys, values, dtype) or ("arrays", [(array, dtype) | None])."""
    shapes = iter(layout.arrays(position))
    off = 0

    def take() -> tuple[np.ndarray, str]:
        nonlocal off
        dtype, shape = next(shapes)
        np_dtype = np.dtype(_NUMPY.get(dtype, dtype))
        count = int(np.prod(shape))
        arr = np.frombuffer(payload, dtype=np_dtype, count=count, offset=off).reshape(shape)
        off += arr.nbytes
        return arr[None], dtype

    out: list[Any] = []
    for leaf in layout.leaves:
        if leaf.kind == RING:
            (k, dtype), (v, _) = take(), take()
            out.append((RING, k, v, dtype))
        else:
            out.append((ARRAYS, [take() if d else None for d in leaf.dtypes]))
    return out


def states_from_host(host: list[Any]) -> list[State]:
    """Host states (`parse_states`) as MLX snapshots."""
    from mlxd.engine.kv.codec import to_mx
    out: list[State] = []
    for s in host:
        if s[0] == RING:
            out.append(Ring(to_mx(s[1], s[3]), to_mx(s[2], s[3])))
        else:
            out.append(Arrays(tuple(None if a is None else to_mx(a[0], a[1]) for a in s[1])))
    return out
