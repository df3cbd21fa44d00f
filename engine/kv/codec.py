"""The cache codec: what the KV tiers know of each mlx-lm cache class a model's layer uses, in
one place. Every tier (RAM prefix cache, SSD blocks, checkpoints, resume, shared prefills)
holds a row's cache through it.

Two kinds of layer (a model may mix them):
- append-only (`KVCache`; `QuantizedRowCache` with --kv-bits): keys and values grow a token at
  a time, so the state at any earlier position is a slice. Held per layer as (keys, values),
  each an array (1, kv_heads, T, head_dim) or a quantized triplet.
- fixed-size state: `RotatingKVCache` (a sliding window: its last `max_size` tokens) and
  `ArraysCache` (Mamba, gated-delta and convolution states). Such a state is valid only at
  the exact token position it was taken at, so it is held as a snapshot (`Ring`, `Arrays`)
  keyed by that position.
`CacheList` layers are flattened into their parts and rebuilt when lent. Any other class (a
new mlx-lm cache, a ring that keeps its first tokens) makes the model `unsupported`: the tiers
then hold nothing for it and `/stats` names the class, never a wrong answer.

Counted bytes are held bytes: everything a tier keeps is copied out of the batch's buffers
(`mx.contiguous` of a row) and evaluated when it is taken, so no stored array pins a batch
buffer larger than it counts (a lazy slice of a batch would keep the whole batch alive).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mlxd.engine.kv.prefix_cache import Arrays, Held, Ring, State, kv_slice, state_arrays
from mlxd.engine.kv.quant import QuantizedRowCache

__all__ = ["Arrays", "Held", "Ring", "State", "kv_slice", "state_arrays"]

APPEND, RING, ARRAYS = "kv", "ring", "arrays"


def nbytes(arrays: list[Any]) -> int:
    return sum(a.nbytes for a in arrays)


def kv_nbytes(layers: list[tuple[Any, Any]]) -> int:
    return sum(a.nbytes for k, v in layers for x in (k, v)
               for a in (x if isinstance(x, tuple) else (x,)))


def to_mx(x: Any, dtype: str) -> Any:
    """Host arrays read from the SSD tier as MLX arrays (a triplet: packed, scales, biases)."""
    if isinstance(x, tuple):
        return (mx.array(x[0]), *(to_mx(a, dtype) for a in x[1:]))
    arr = mx.array(x)
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


def _own(x: Any) -> Any:
    """`x` in a buffer of its own (a row of a batch array otherwise views, and pins, all of
    it)."""
    return mx.contiguous(x)


class CacheCodec:
    """A model's cache, as the tiers see it: built from a probe of `make_prompt_cache`."""

    def __init__(self, prompt_cache: list[Any]) -> None:
        self.kinds: list[str] = []  # per leaf: APPEND, RING or ARRAYS
        self.windows: list[int] = []  # per leaf: a ring's window (0 otherwise)
        self.sizes: list[int] = []  # per leaf: an ArraysCache's slot count (0 otherwise)
        self.structure: list[int] = []  # per model layer: 0 a plain cache, k a CacheList of k
        bad: list[str] = []
        for c in prompt_cache:
            parts = list(c.caches) if type(c) is CacheList else [c]
            self.structure.append(len(parts) if type(c) is CacheList else 0)
            for p in parts:
                kind = _kind_of(p)
                if kind is None:
                    bad.append(type(p).__name__ + (f"(keep={p.keep})"
                                                   if type(p) is RotatingKVCache else ""))
                    kind = APPEND
                self.kinds.append(kind)
                self.windows.append(p.max_size if kind == RING else 0)
                self.sizes.append(len(p.cache) if kind == ARRAYS else 0)
        self.unsupported = ", ".join(sorted(set(bad)))  # "": every class is understood
        self.appends = [i for i, k in enumerate(self.kinds) if k == APPEND]
        self.state_leaves = [i for i, k in enumerate(self.kinds) if k != APPEND]

    @classmethod
    def for_model(cls, model: Any) -> CacheCodec:
        from mlx_lm.models.cache import make_prompt_cache
        return cls(make_prompt_cache(model))

    def describe(self) -> str:
        """The layers by kind: "kv 16", "kv 4, ring 12 (window 512)", "arrays 24"."""
        out = []
        for kind in (APPEND, RING, ARRAYS):
            count = self.kinds.count(kind)
            if count:
                windows = sorted({w for w in self.windows if w})
                out.append(f"{kind} {count}" + (f" (window {', '.join(map(str, windows))})"
                                               if kind == RING else ""))
        return ", ".join(out)

    @property
    def supported(self) -> bool:
        return not self.unsupported

    @property
    def has_state(self) -> bool:
        """Whether some layer holds a fixed-size state: a hit then needs a snapshot taken at
        exactly its length."""
        return bool(self.state_leaves)

    def leaves(self, cache: list[Any]) -> list[Any]:
        out: list[Any] = []
        for c, k in zip(cache, self.structure, strict=True):
            out += list(c.caches) if k else [c]
        return out

    # ------------------------------------------------------------------ a row out

    def take(self, cache: list[Any], tokens: int, states: bool = True) -> Held | None:
        """A row's cache (one per model layer, as `extract_cache` gives it) at the position
        it holds, at most `tokens`; None when the tiers cannot hold it (an unsupported class,
        no KV yet, or state layers that are not at that position). `states` False: the
        append-only layers only (their slices are all a longer entry adds)."""
        if not self.supported or not cache or len(cache) != len(self.structure):
            return None
        leaves = self.leaves(cache)
        n = tokens
        for i in self.appends:
            c = leaves[i]
            if c.keys is None:
                return None
            n = min(n, int(c.offset))
        held = Held(n, [(kv_slice(leaves[i].keys, n), kv_slice(leaves[i].values, n))
                        for i in self.appends])
        if states and self.state_leaves:
            snaps = [self._snapshot(leaves[i], n) for i in self.state_leaves]
            if any(s is None for s in snaps):
                return None
            held.states = [s for s in snaps if s is not None]
        return held

    def states_at(self, cache: list[Any], position: int) -> list[State] | None:
        """The state layers' snapshots of a row whose cache is at `position` (None if one is
        not there)."""
        if not self.supported or len(cache) != len(self.structure):
            return None
        leaves = self.leaves(cache)
        snaps = [self._snapshot(leaves[i], position) for i in self.state_leaves]
        return None if any(s is None for s in snaps) else [s for s in snaps if s is not None]

    def _snapshot(self, c: Any, n: int) -> State | None:
        if type(c) is RotatingKVCache:
            keys, values = c.keys, c.values
            if keys is None or values is None or int(c.offset) != n:
                return None
            keep = min(n, c.max_size)  # what the next token attends to (merge needs this many)
            if keys.shape[2] < keep:
                return None
            return Ring(_own(keys[..., keys.shape[2] - keep:, :]),
                        _own(values[..., values.shape[2] - keep:, :]))
        if c.empty():
            return None
        return Arrays(tuple(None if a is None else _own(a) for a in c.cache))

    # ------------------------------------------------------------------ a row in

    def lend(self, layers: list[tuple[Any, Any]], states: list[State], n: int,
             quant: tuple[int, int] | None) -> list[Any]:
        """New row caches (one per model layer) over held arrays at position `n`: the donor's
        arrays are never written (mlx-lm merges a lent row into its batch by copying)."""
        it_kv, it_state = iter(layers), iter(states)
        leaves: list[Any] = []
        for kind, window, size in zip(self.kinds, self.windows, self.sizes, strict=True):
            if kind == APPEND:
                k, v = next(it_kv)
                c: Any = (QuantizedRowCache(group_size=quant[1], bits=quant[0])
                          if quant is not None else KVCache())
                c.keys, c.values, c.offset = k, v, n
            elif kind == RING:
                s = next(it_state)
                assert isinstance(s, Ring)
                c = RotatingKVCache(window)
                c.keys, c.values, c.offset, c._idx = s.keys, s.values, n, s.keys.shape[2]
            else:
                s = next(it_state)
                assert isinstance(s, Arrays)
                c = ArraysCache(size)
                c.cache = list(s.arrays)
            leaves.append(c)
        out: list[Any] = []
        pos = 0
        for k in self.structure:
            if k:
                out.append(CacheList(*leaves[pos:pos + k]))
                pos += k
            else:
                out.append(leaves[pos])
                pos += 1
        return out


def _kind_of(c: Any) -> str | None:
    t = type(c)
    if t in (KVCache, QuantizedRowCache):
        return APPEND
    if t is RotatingKVCache and c.keep == 0:
        return RING
    if t is ArraysCache:
        return ARRAYS
    return None
