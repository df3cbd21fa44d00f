"""KV cache quantization (`--kv-bits 4|8`, `--kv-group-size`): what mlx-lm 0.32 lacks for it.

mlx-lm has a quantized cache for one sequence (`QuantizedKVCache`: keys and values stored as
`mx.quantize` triplets (packed uint32, scales, biases), attention through
`quantized_scaled_dot_product_attention`, which `scaled_dot_product_attention` picks for any
cache with `bits`), but its `BatchGenerator` only batches `KVCache` rows (`BatchKVCache`).
This module adds the batched form and wires it in without touching the generator:

- `QuantizedRowCache`: mlx-lm's `QuantizedKVCache` plus `merge`/`size`, so the generator can
  merge rows of it into a batch (`_merge_caches` calls the first row's `merge`).
- `BatchQuantizedKVCache`: `BatchKVCache`'s interface (left padding, prepare/finalize for right
  padded prompts, filter, extend, extract, merge, trim, state) over quantized triplets.
- `install(model, bits, group_size)`: the model's `make_cache` then makes quantized rows, so
  every cache the generator makes (and every forward pass through `make_prompt_cache`) stores
  quantized KV. A model's plain `KVCache` layers are quantized; its sliding-window and
  recurrent layers stay as they are (their size is bounded already). Other caches, and
  attention mlx-lm cannot run quantized (sinks), are refused at load time with a clear error
  (`KvQuantError`).
- The tiers hold a quantized layer's keys and values as triplets (`codec.py` handles both).

No quantized_kv_start here (mlx-lm's generate keeps the first 5000 tokens unquantized): a row
is quantized from its first token, so one layout holds for the whole batch and every tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, dynamic_roll

from mlxd.engine.load.loader import ModelLoadError
from mlxd.engine.mlx_lm_internals import BaseCache

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
STEP = 256


class KvQuantError(ModelLoadError):
    """--kv-bits cannot apply to this model (said at load time)."""


class QuantizedRowCache(QuantizedKVCache):
    """One row: mlx-lm's QuantizedKVCache that BatchGenerator can merge into a batch."""

    def size(self) -> int:
        return int(self.offset)

    def merge(self, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


def _tmap(fn: Any, t: tuple[Any, ...] | None) -> Any:
    return None if t is None else tuple(fn(x) for x in t)


def _cat(a: tuple[Any, ...], b: tuple[Any, ...], axis: int) -> tuple[mx.array, ...]:
    return tuple(mx.concatenate([x, y], axis=axis) for x, y in zip(a, b, strict=True))


class BatchQuantizedKVCache(BaseCache):
    """BatchKVCache over quantized triplets: `keys`/`values` are (packed, scales, biases),
    each (B, kv_heads, T, ...); rows are left-padded as in BatchKVCache."""

    step = STEP

    def __init__(self, left_padding: list[int], bits: int, group_size: int) -> None:
        self.keys: tuple[mx.array, ...] | None = None
        self.values: tuple[mx.array, ...] | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.bits, self.group_size = bits, group_size

    def _zeros(self, B: int, H: int, T: int, dim: int, dtype: Any) -> tuple[mx.array, ...]:
        el = 32 // self.bits
        return (mx.zeros((B, H, T, dim // el), mx.uint32),
                mx.zeros((B, H, T, dim // self.group_size), dtype),
                mx.zeros((B, H, T, dim // self.group_size), dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev = self._idx
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            grow = (self.step + n - 1) // self.step * self.step
            new_k = self._zeros(B, H, grow, keys.shape[3], keys.dtype)
            new_v = self._zeros(B, H, grow, values.shape[3], keys.dtype)
            if self.keys is not None and self.values is not None:
                old_k, old_v = self.keys, self.values
                if prev % self.step:
                    old_k, old_v = _tmap(lambda x: x[..., :prev, :], old_k), \
                        _tmap(lambda x: x[..., :prev, :], old_v)
                new_k = _cat(old_k, new_k, axis=2)
                new_v = _cat(old_v, new_v, axis=2)
            self.keys, self.values = new_k, new_v
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        assert self.keys is not None and self.values is not None
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = qk[i]
            self.values[i][..., prev:self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> Any:
        idx = self._idx
        return _tmap(lambda x: x[..., :idx, :], self.keys), \
            _tmap(lambda x: x[..., :idx, :], self.values)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: Any = None,
                right_padding: list[int] | None = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys = _tmap(lambda x: dynamic_roll(x, pad[:, None], axis=2), self.keys)
            self.values = _tmap(lambda x: dynamic_roll(x, pad[:, None], axis=2), self.values)
            self.offset = self.offset - pad
            self.left_padding = self.left_padding + pad
            self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    @property
    def meta_state(self) -> Any:
        return tuple(map(str, (self.bits, self.group_size)))

    @meta_state.setter
    def meta_state(self, v: Any) -> None:
        self.bits, self.group_size = map(int, v)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        self.keys = _tmap(lambda x: x[batch_indices], self.keys)
        self.values = _tmap(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(cast(list[int], self.left_padding.tolist()))
        if shift > 0:
            self.keys = _tmap(lambda x: x[..., shift:, :], self.keys)
            self.values = _tmap(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        full = [c for c in (self, other) if c.keys is not None]
        size = max(c.keys[0].shape[2] for c in full if c.keys is not None)
        ref_k, ref_v = full[0].keys, full[0].values
        assert ref_k is not None and ref_v is not None

        def pad(c: BatchQuantizedKVCache) -> tuple[Any, Any, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None or v is None:
                rows = c.offset.shape[0]
                k = tuple(mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), x.dtype) for x in ref_k)
                v = tuple(mx.zeros((rows, *x.shape[1:2], 0, x.shape[3]), x.dtype) for x in ref_v)
            left = top - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = _tmap(lambda x: x[..., :right, :], k), _tmap(lambda x: x[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = _tmap(lambda x: mx.pad(x, widths), k), _tmap(lambda x: mx.pad(x, widths), v)
            return k, v, c.offset, c.left_padding + left

        a, b = pad(self), pad(other)
        self.keys, self.values = _cat(a[0], b[0], axis=0), _cat(a[1], b[1], axis=0)
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = top

    def extract(self, idx: int) -> QuantizedRowCache:
        cache = QuantizedRowCache(group_size=self.group_size, bits=self.bits)
        pad = cast(int, self.left_padding[idx].item())
        end = self._idx
        cache.keys = _tmap(lambda x: mx.contiguous(x[idx:idx + 1, :, pad:end]), self.keys)
        cache.values = _tmap(lambda x: mx.contiguous(x[idx:idx + 1, :, pad:end]), self.values)
        cache.offset = end - pad
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        bits, group = caches[0].bits, caches[0].group_size
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), bits, group)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)
        keys = tuple(mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype)
                     for x in ref.keys)
        values = tuple(mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype)
                       for x in ref.values)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            for j in range(3):
                keys[j][i:i + 1, :, p:p + c.offset] = c.keys[j][..., :c.offset, :]
                values[j][i:i + 1, :, p:p + c.offset] = c.values[j][..., :c.offset, :]
        out = cls(padding, bits, group)
        out.keys, out.values = keys, values
        out.offset = out.offset + longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for t in (self.keys, self.values) if t is not None for x in t)


# ---------------------------------------------------------------------- the model hook

def install(model: Any, bits: int | None, group_size: int) -> None:
    """With `bits`, every cache made for `model` stores quantized KV; a model whose cache is
    not one plain KVCache per layer cannot be (KvQuantError)."""
    if bits is None:
        return
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise KvQuantError(f"--kv-bits must be one of {BITS} and --kv-group-size one of "
                           f"{GROUP_SIZES} (got {bits}, {group_size})")
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    uninstall(model)  # installing again replaces the bits
    made = make_prompt_cache(model)
    kinds = {type(c).__name__ for c in made}
    if "KVCache" not in kinds or not kinds <= MIXABLE:
        raise KvQuantError(f"--kv-bits needs a model with plain KVCache layers (beside which "
                           f"sliding-window and recurrent layers stay as they are); this one "
                           f"uses {', '.join(sorted(kinds))}")
    probe = make_prompt_cache(model)
    model(mx.array([[0]]), cache=probe)
    dims = {d for c in probe if type(c) is KVCache and c.keys is not None
            and c.values is not None for d in (c.keys.shape[-1], c.values.shape[-1])}
    if any(d % group_size for d in dims):
        fits = [str(g) for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        raise KvQuantError(f"--kv-group-size {group_size} does not divide this model's head "
                           f"size ({', '.join(map(str, sorted(dims)))}): use "
                           f"{' or '.join(fits) if fits else 'no --kv-bits'}")

    def make_cache() -> list[Any]:
        """The model's own caches, its plain KV layers quantized."""
        return [QuantizedRowCache(group_size, bits) if type(c) is KVCache else c
                for c in make_prompt_cache(cast(Any, model_for_cache))]
    model_for_cache = _OwnCaches(model)
    # instance attributes (nn.Module keeps only arrays, dicts, lists and tuples as children)
    model.make_cache = make_cache
    model.mlxd_kv_quant = KvQuant(bits, group_size)
    try:  # MLX's CUDA backend (0.32) has no quantized_matmul for attention's shapes; models
        # with attention sinks (GPT-OSS) have no quantized attention in mlx-lm
        mx.eval(model(mx.array([[0, 0]]), cache=model.make_cache()))
    except ValueError as e:  # mlx-lm's own refusal, whatever the device
        uninstall(model)
        raise KvQuantError(f"--kv-bits {bits}: mlx-lm has no quantized attention for this "
                           f"model ({str(e)[:160]}); use no --kv-bits") from e
    except RuntimeError as e:
        uninstall(model)
        raise KvQuantError(f"--kv-bits {bits}: this MLX build cannot attend over quantized KV "
                           f"on {mx.default_device()} ({str(e)[:160]}); use no --kv-bits") from e


MIXABLE = {"KVCache", "RotatingKVCache", "ArraysCache"}


class _OwnCaches:
    """`model` as `make_prompt_cache` sees it, without the quantized `make_cache` installed
    on the instance: its class's own caches."""

    def __init__(self, model: Any) -> None:
        self._model = model
        own = getattr(type(model), "make_cache", None)
        if own is not None:
            self.make_cache = lambda: own(model)
        self.layers = getattr(model, "layers", None)

    def __getattr__(self, name: str) -> Any:
        if name == "make_cache":  # the class has none: mlx-lm's default, plain KV per layer
            raise AttributeError(name)
        return getattr(self._model, name)


def install_for(model: Any, settings: Any, alone: bool) -> None:
    """The engine's hook: `settings.kv_bits` on a model one text engine serves (`alone`: not a
    sharded group's, not a vision model's, whose caches mlxd does not make)."""
    if settings.kv_bits is not None and not alone:
        raise KvQuantError("--kv-bits applies to text models served by one engine (not to a "
                           "sharded or a vision model)")
    install(model, settings.kv_bits, settings.kv_group_size)


def uninstall(model: Any) -> None:
    """Back to the model's own caches (tests and benchmarks compare both on one model)."""
    for name in ("make_cache", "mlxd_kv_quant"):
        model.__dict__.pop(name, None)


@dataclass(frozen=True)
class KvQuant:
    bits: int
    group_size: int


def config_of(model: Any) -> tuple[int, int] | None:
    """(bits, group size) that `install` gave `model`, or None: unquantized."""
    q = getattr(model, "__dict__", {}).get("mlxd_kv_quant")
    return (q.bits, q.group_size) if isinstance(q, KvQuant) else None
