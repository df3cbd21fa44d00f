"""The figures `--batch auto` is sized from, measured once at load on the MLX thread: the
memory the engine may use (free device memory on a GPU; available RAM on unified memory and
on the CPU backend, plus what the model already holds), the model's weight bytes and the KV
bytes one token costs, read from a real one-token forward pass (any model, any KV layout).
The rules that use them are pure (`budget.py`)."""

from __future__ import annotations

import logging
from typing import Any, cast

from mlxd.engine.batch.budget import Budget, KvShape, budget, explicit_cap, machine_memory
from mlxd.protocol.settings import PoolShare

log = logging.getLogger("mlxd.engine")

# `--engine-memory GB`: the memory the engine may use in all, weights included (with a model
# pool: all its engines together), named instead of measured; the budget is then derived from
# it by the same rules. The budget's explanation names it as its source.
FORCED = "--engine-memory"


def measure_budget(model: Any, batch: int | str, stream: Any, cache_bytes: int | None = 0,
                   share: PoolShare | None = None, memory_gb: float | None = None) -> Budget:
    """`cache_bytes`: the RAM prefix cache's capacity, KV in the same memory as the rows'
    (None: auto, `budget.AUTO_CACHE_FRACTION`).
    `share`: the engine's part of the memory when it is one of a pool's. `memory_gb`:
    `--engine-memory`, if given."""
    weights = weight_bytes(model)
    available, source = available_memory(weights, memory_gb)
    whole = machine_memory(available, share, whole=not free_based(source))
    b = budget(whole, weights, kv_shape(model, stream), explicit_cap(batch), source,
               cache_bytes, share, whole - available)
    if b.kv_bytes == 0 and b.per_token > 1:
        log.warning("no memory left for KV cache (%s): one request at a time; a smaller "
                    "--prompt-cache%s leaves room for more", b.why,
                    " or --model-pool" if b.share < 1 else "")
    return b


def free_based(source: str) -> bool:
    """Whether `available_memory`'s figure came from free memory, which lacks what the other
    engines of a pool already hold (not a forced figure nor Metal's working-set limit)."""
    return source.startswith(("RAM (", "GPU memory ("))


def weight_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(v.nbytes for _, v in params)


def available_memory(weights: int, memory_gb: float | None = None) -> tuple[int, str]:
    """(bytes the engine may use in all, weights included; where that figure came from)."""
    import mlx.core as mx
    import psutil
    if memory_gb is not None:
        return int(memory_gb * 2**30), FORCED
    gib = 2**30
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001  an older MLX, or a device that says nothing: use RAM
        info = {}
    free = info.get("free_memory")
    if isinstance(free, int):  # CUDA: the device's own memory, free now, plus what MLX holds
        held = mx.get_active_memory() + mx.get_cache_memory()
        return free + held, (f"GPU memory ({free / gib:.1f} GiB free + {held / gib:.1f} GiB "
                             "held by MLX)")
    # freed buffers MLX keeps for reuse are memory new KV can take, though the OS counts them used
    ram = psutil.virtual_memory().available + weights + mx.get_cache_memory()
    limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if isinstance(limit, int) and limit < ram:  # Metal: unified memory, a working-set limit
        return limit, "unified memory (the GPU's recommended working set)"
    return ram, f"RAM ({(ram - weights) / gib:.1f} GiB available + the weights)"


def kv_shape(model: Any, stream: Any) -> KvShape:
    """KV bytes per token as a forward pass lays them out (`codec.py`'s kinds): append-only
    layers, and the first such layer's heads, head sizes and dtype; sliding-window layers
    (a window's tokens at most); recurrent states (bytes per row). With --kv-bits the keys
    and values are quantized triplets (packed, scales, biases; engine/kv/quant.py): bytes
    per element is what the three arrays take per element (0.5625 at 4 bits, group 64,
    float16 scales)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.kv.codec import APPEND, ARRAYS, RING, CacheCodec
    try:
        with mx.stream(stream):
            cache = make_prompt_cache(model)
            model(mx.array([[0]]), cache=cache)
            codec = CacheCodec(cache)
            leaves = codec.leaves(cache)
            mx.eval([c.state for c in leaves])
    except Exception as e:  # noqa: BLE001  a model that cannot run alone: no KV figure
        log.warning("cannot measure the KV size per token (%s): the batch is capped only by "
                    "its ceiling", e)
        return KvShape(0, 0, 0, 0, 0)
    kv = [c for c, kind in zip(leaves, codec.kinds, strict=True) if kind == APPEND]
    rings = [c for c, kind in zip(leaves, codec.kinds, strict=True) if kind == RING]
    state = sum(a.nbytes for c, kind in zip(leaves, codec.kinds, strict=True) if kind == ARRAYS
                for a in c.cache if a is not None)
    window = max((c.max_size for c in rings), default=0)
    first = (kv or rings or [None])[0]
    if first is None:  # no per-token KV (a state-space model): a constant per row
        return KvShape(0, 0, 0, 0, 0, state_bytes=state)
    k, v = first.keys, first.values
    if isinstance(k, tuple):  # quantized: head size from the scales, bytes from all three
        group = first.group_size
        kd, vd = k[1].shape[-1] * group, v[1].shape[-1] * group
        per_token = sum(a.shape[1] * a.shape[-1] * a.dtype.size for a in (*k, *v))
        return KvShape(layers=len(kv), kv_heads=k[0].shape[1], k_head_dim=kd, v_head_dim=vd,
                       bytes_per_element=per_token / (k[0].shape[1] * (kd + vd)),
                       window_layers=len(rings), window=window, state_bytes=state)
    return KvShape(layers=len(kv), kv_heads=k.shape[1], k_head_dim=k.shape[-1],
                   v_head_dim=v.shape[-1], bytes_per_element=k.dtype.size,
                   window_layers=len(rings), window=window, state_bytes=state)
