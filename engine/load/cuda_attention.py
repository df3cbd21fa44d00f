"""Which attention kernel each pass of an engine runs on MLX's CUDA backend.

MLX (`mlx/backend/cuda/scaled_dot_product_attention.cpp`) runs a one-token pass with no array
mask in its vector kernel (or cuDNN's, over a long cache), a pass of several tokens in cuDNN's
fused kernel when `MLX_CUDA_USE_CUDNN_SDPA` is on (its default), and everything else in an
unfused fallback that writes the whole score matrix out. cuDNN builds one graph per exact
shape of queries, keys and mask (an LRU of 256), which costs about as much as the unfused
attention of a 2,048-token prefill over 10k tokens of context, many times a short prompt's
whole pass; a shape seen before runs fused at a fraction of the fallback's time, and the
longer the context the larger the fraction (`benchmarks/cuda_sdpa_shapes.py`,
`benchmarks/cuda_long_context.py`; figures: benchmarks/RESULTS.md, "cuDNN attention on CUDA").
With an array mask (rows of different lengths) cuDNN is slower than the fallback.

No setting of the variable suits both a chat's short prompts and an agent's next turn over
60k tokens, so engines leave cuDNN on and route each multi-token pass (`route`):

- fused (cuDNN) when its shape was seen before, or when the unfused attention of the whole
  pass would cost more than one graph build (`BUILD_EQUIVALENT_SCORES`);
- unfused (`unfused`: MLX's own fallback, written with the same operations) otherwise, and
  always with an array mask.

A one-token pass goes to MLX as it is, except over rows of different lengths at a long context
(agent sessions decoding side by side): their padding needs an array mask, which sends the
step to the unfused fallback, so each row attends over its own keys alone, without a mask,
in MLX's vector kernel (`split`; the rows' padding is known on the host,
`mlx_lm_internals.left_padding`). A user who sets `MLX_CUDA_USE_CUDNN_SDPA` themselves
gets their setting: with `0` every multi-token pass is unfused, as MLX would run it. MLX reads
the variable once, at its first attention on the GPU, so `apply` runs before the model's
first forward pass. A sharded group's ranks get rank 0's value (`kinds/group/leader.py`).
Other backends (Metal, CPU) do not read it and are not routed.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

import mlx.core as mx

log = logging.getLogger("mlxd.engine")

ENV = "MLX_CUDA_USE_CUDNN_SDPA"
# Score elements (rows x query heads x query tokens x key tokens, summed over a pass's layers)
# whose unfused attention costs about one cuDNN graph build: measured on the H200 with a 1.24B
# model (benchmarks/cuda_long_context.py: ~5-6 ps per score element per layer, ~60-65 ms per
# build).
BUILD_EQUIVALENT_SCORES = 11e9
SEEN_SHAPES = 256  # MLX's own cache of cuDNN graphs
# A padded one-token pass runs row by row over at most this many rows (a kernel call each),
# from this many keys on (below, the unfused attention over the batch costs little).
SPLIT_ROWS = 8
SPLIT_FROM_KEYS = 4096
# Passes routed each way since the process started (read by the stage clock's step log).
COUNTS = {"one": 0, "fused_seen": 0, "fused_new": 0, "unfused": 0, "split": 0}


def apply() -> str:
    """The value in force for this process (MLX's default, on, unless the user chose)."""
    value = os.environ.get(ENV, "1")
    if _on_cuda():
        log.info("CUDA attention: cuDNN's fused kernel %s (%s=%s)",
                 "off" if value == "0" else "on for long or repeated passes", ENV, value)
    return value


def _on_cuda() -> bool:
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


class Router:
    """Fused or unfused, per multi-token pass (see the module's docstring). `layers`: the
    attention layers one forward pass runs, all of one shape (a graph is built once for
    them)."""

    def __init__(self, layers: int, fused_allowed: bool = True) -> None:
        self.layers = max(1, layers)
        self.fused_allowed = fused_allowed
        self._seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()

    def fused(self, q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: Any,
              array_mask: bool) -> bool:
        """Whether a pass of queries `q_shape` (B, heads, L, D) over keys `k_shape` runs
        fused; a one-token pass always does (MLX's own choice)."""
        batch, heads, queries, _ = q_shape
        if queries == 1:
            COUNTS["one"] += 1
            return True
        if array_mask or not self.fused_allowed:
            COUNTS["unfused"] += 1
            return False
        key = (q_shape, k_shape, dtype)
        if key in self._seen:
            self._seen.move_to_end(key)
            COUNTS["fused_seen"] += 1
            return True
        if batch * heads * queries * k_shape[2] * self.layers < BUILD_EQUIVALENT_SCORES:
            COUNTS["unfused"] += 1
            return False
        COUNTS["fused_new"] += 1
        self._seen[key] = None
        if len(self._seen) > SEEN_SHAPES:
            self._seen.popitem(last=False)
        return True


    def split(self, rows: int, keys: int) -> bool:
        """Whether a one-token pass over `rows` padded rows and `keys` keys runs row by row."""
        return 1 < rows <= SPLIT_ROWS and keys >= SPLIT_FROM_KEYS


def by_row(q: mx.array, k: mx.array, v: mx.array, scale: float, pads: list[int],
           fast: Any) -> mx.array:
    """A one-token pass, each row over its keys past its padding, with no mask."""
    return mx.concatenate([fast(q[i:i + 1], k[i:i + 1, :, p:], v[i:i + 1, :, p:], scale=scale)
                           for i, p in enumerate(pads)], axis=0)


def unfused(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention as MLX's own fallback computes it (`mlx/fast.cpp`): grouped heads, a boolean
    mask by `where` and an additive one by `+`, a causal mask aligned to the last key."""
    n_q, n_kv = q.shape[1], k.shape[1]
    reps = n_q // n_kv
    q = q * mx.array(scale, dtype=q.dtype)
    if reps > 1:
        q = q.reshape(q.shape[0], n_kv, reps, *q.shape[2:])
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal"
        q_len, k_len = q.shape[-2], k.shape[-2]
        mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
    if mask is not None:
        if reps > 1 and mask.ndim >= 3:
            mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                    else mask.reshape(*mask.shape[:-3], n_kv, reps, *mask.shape[-2:]))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(out.shape[0], n_q, *out.shape[-2:]) if reps > 1 else out


def routed(router: Router) -> Any:
    """`mx.fast.scaled_dot_product_attention`'s signature, through `router`."""
    fast = mx.fast.scaled_dot_product_attention

    from mlxd.engine.mlx_lm_internals import left_padding

    def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None,
                  sinks: Any = None, cache: Any = None) -> mx.array:
        if (q.shape[2] == 1 and sinks is None and isinstance(mask, mx.array)
                and router.split(q.shape[0], k.shape[2])):
            pads = left_padding(cache)
            if pads is not None and len(pads) == q.shape[0] and mask.shape[-1] == k.shape[2]:
                COUNTS["split"] += 1
                return by_row(q, k, v, scale, pads, fast)
        if sinks is not None or router.fused(tuple(q.shape), tuple(k.shape), q.dtype,
                                             isinstance(mask, mx.array)):
            return fast(q, k, v, scale=scale, mask=mask, sinks=sinks)
        return unfused(q, k, v, scale, mask)
    return attention


def install(model: Any) -> Router | None:
    """Route `model`'s attention on CUDA (None elsewhere: nothing is changed)."""
    if not _on_cuda():
        return None
    from mlxd.engine.mlx_lm_internals import route_attention
    router = Router(len(getattr(model, "layers", ()) or ()) or 1,
                    fused_allowed=os.environ.get(ENV, "1") != "0")
    route_attention(routed(router))
    return router
