"""LoRA adapters on one base model: every adapter's low-rank weights held at once, each batch
row running with its own adapter (or none) in the same forward pass.

- Loading (`apply_adapters`): each adapter directory is an mlx-lm one (`adapters.safetensors`,
  `adapter_config.json`, as `mlx_lm.lora` trains it). For every linear layer that any adapter
  touches, the adapters' `lora_a` / `lora_b` are stacked (ranks padded with zeros; the base
  has no slot, its scale is 0) and the layer's class is swapped in place for a subclass that
  adds, per row, `scale[i] * (x @ A[i]) @ B[i]`, as mlx-lm's `LoRALinear` does for one
  adapter. Parameter paths of the base are unchanged.
- Which adapter a row uses is carried by the row's own tokens: an adapter request's FIRST
  prompt token is shifted by `index * vocab` (`mark_prompt`), an id no real token has. So
  - every cache key (the RAM tier's token trie, the SSD tier's chained block hashes, the
    runner's shared-prefill matching) differs from the first token on between adapters, and
    a block computed under one adapter is never used under another, with no change to the
    runner or the caches;
  - the token embedding takes ids modulo the vocabulary (its class is swapped likewise);
  - before each forward pass of the generator's batches (prompt chunks, decode steps), the
    rows' adapter indices are read from each row's first token, in the batch's own row
    order (`mlx_lm_internals.hook_forward_passes`, installed once per process; for a model
    without adapters the hook only looks up an attribute).
- A forward pass made outside the generator (the SSD probe, embeddings, the warm-up) runs the
  base for every row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.load.loader import ModelLoadError
from mlxd.protocol.models import adapter_problem

log = logging.getLogger("mlxd.engine")

LORA_ATTR = "_mlxd_lora"  # the model's attribute holding its `LoraSet`


class AdapterError(ModelLoadError):
    """An adapter that cannot be applied to this base (the message says why)."""


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    index: int  # 1.. (0 is the base)
    rank: int
    scale: float
    layers: int  # linear layers it changes
    nbytes: int
    digest: str  # identity of its weights (SSD namespace)


@dataclass
class Rows:
    """The current forward pass's adapter per row: None (every row the base), an int (every
    row that adapter, index >= 1) or, rows of several, (slots, indices): per row the slot of
    its adapter in the stacks (adapter index - 1; a base row any slot) and its index (the
    scale of index 0 is 0: a base row adds nothing)."""
    current: int | tuple[mx.array, mx.array] | None = None


@dataclass
class LoraSet:
    vocab: int
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)  # by name
    rows: Rows = field(default_factory=Rows)
    nbytes: int = 0  # bytes of the stacked adapter weights held

    def index(self, name: str) -> int | None:
        a = self.adapters.get(name)
        return a.index if a is not None else None

    def identity(self) -> str:
        """Names everything the adapter indices mean (for the SSD tier's namespace)."""
        return ",".join(f"{a.index}:{a.digest}" for a in
                        sorted(self.adapters.values(), key=lambda a: a.index))

    def clear(self) -> None:
        self.rows.current = None

    def set_rows(self, first_tokens: list[int]) -> None:
        idx = [t // self.vocab if t >= self.vocab else 0 for t in first_tokens]
        if not any(idx):
            self.rows.current = None
        elif all(i == idx[0] for i in idx):
            self.rows.current = idx[0]
        else:
            self.rows.current = (mx.array([max(i - 1, 0) for i in idx], dtype=mx.int32),
                                 mx.array(idx, dtype=mx.int32))


# ---------------------------------------------------------------------- requests

def mark_prompt(prompt: list[int], index: int, vocab: int) -> list[int]:
    """The prompt as an adapter request's row carries it: its first token shifted by
    `index * vocab` (index 0, the base: unchanged)."""
    if index <= 0 or not prompt:
        return prompt
    return [prompt[0] + index * vocab, *prompt[1:]]


def unmarked_processors(processors: list, vocab: int) -> list:
    """Logits processors that see real token ids in their context (the row's first token is
    marked; penalties index the logits by those ids)."""
    def wrap(p: Callable[[mx.array, mx.array], mx.array]) -> Callable[[mx.array, mx.array],
                                                                       mx.array]:
        def unmarked(tokens: mx.array, logits: mx.array) -> mx.array:
            return p(tokens % vocab if tokens is not None else tokens, logits)
        return unmarked
    return [wrap(p) for p in processors]


# ---------------------------------------------------------------------- layers

def _lora_delta(self: Any, x: mx.array) -> mx.array | None:
    current = self._mlxd_rows.current
    if current is None:
        return None
    if isinstance(current, int):
        a, b = self.lora_a[current - 1], self.lora_b[current - 1]
        z = (x @ a) @ b
        return (self.lora_scale[current] * z).astype(x.dtype)
    slots, indices = current
    a, b = self.lora_a[slots], self.lora_b[slots]  # (rows, in, r), (rows, r, out)
    z = (x @ a) @ b
    s = self.lora_scale[indices].reshape(-1, *([1] * (z.ndim - 1)))
    return (s * z).astype(x.dtype)


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    cls = _LORA_CLASSES.get(base)
    if cls is None:
        def __call__(self: Any, x: mx.array) -> mx.array:
            y = base.__call__(self, x)
            d = _lora_delta(self, x)
            return y if d is None else y + d
        cls = _LORA_CLASSES[base] = type(f"MultiLoRA{base.__name__}", (base,),
                                         {"__call__": __call__})
    return cls


_EMBEDDING_CLASSES: dict[type, type] = {}


def _offset_class(base: type) -> type:
    cls = _EMBEDDING_CLASSES.get(base)
    if cls is None:
        def __call__(self: Any, x: mx.array) -> mx.array:
            return base.__call__(self, x % self._mlxd_vocab)
        cls = _EMBEDDING_CLASSES[base] = type(f"Marked{base.__name__}", (base,),
                                              {"__call__": __call__})
    return cls


def _dims(module: nn.Module) -> tuple[int, int]:
    """(input, output) dims of a Linear or QuantizedLinear."""
    out_dims, in_dims = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        in_dims = in_dims * 32 // module.bits
    return in_dims, out_dims


def _token_embedding(model: nn.Module) -> tuple[nn.Module, int]:
    found = [(m, m.weight.shape[0]) for _, m in model.named_modules()
             if isinstance(m, nn.Embedding | nn.QuantizedEmbedding)]
    if not found:
        raise AdapterError("the base model has no token embedding that adapters can use")
    return max(found, key=lambda f: f[1])


# ---------------------------------------------------------------------- loading

def _read_adapter(name: str, path: Path) -> tuple[dict, dict[str, tuple[mx.array, mx.array]]]:
    problem = adapter_problem(str(path))
    if problem is not None:
        raise AdapterError(f"adapter {name}: {problem}")
    config = json.loads((path / "adapter_config.json").read_text())
    try:
        weights = mx.load(str(path / "adapters.safetensors"))
    except Exception as e:  # any unreadable file is the adapter's fault
        raise AdapterError(f"adapter {name}: cannot read {path / 'adapters.safetensors'}: "
                           f"{e}") from e
    assert isinstance(weights, dict)
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, w in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterError(f"adapter {name}: {key} is not a LoRA weight (lora_a/lora_b)")
        pairs.setdefault(module, {})[leaf] = w
    out = {}
    for module, p in pairs.items():
        if set(p) != {"lora_a", "lora_b"}:
            raise AdapterError(f"adapter {name}: {module} lacks lora_a or lora_b")
        a, b = p["lora_a"], p["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(f"adapter {name}: {module}: lora_a {tuple(a.shape)} and "
                               f"lora_b {tuple(b.shape)} do not make a low-rank pair")
        out[module] = (a, b)
    if not out:
        raise AdapterError(f"adapter {name}: {path / 'adapters.safetensors'} holds no weights")
    return config, out


def _digest(path: Path) -> str:
    import hashlib
    h = hashlib.sha256()
    for f in ("adapter_config.json", "adapters.safetensors"):
        p = path / f
        h.update(f.encode() + str(p.stat().st_size).encode())
        with open(p, "rb") as fh:
            if f.endswith(".safetensors"):
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, 1 << 24)))
            else:
                h.update(fh.read())
    return h.hexdigest()[:16]


def apply_adapters(model: nn.Module, adapters: dict[str, str]) -> LoraSet | None:
    """Apply every adapter (name -> directory, indexed 1.. in name order) to `model` in place;
    None when there are none. Raises AdapterError naming the adapter and the problem."""
    if not adapters:
        return None
    embedding, vocab = _token_embedding(model)
    modules = dict(model.named_modules())
    lset = LoraSet(vocab=vocab)
    per_module: dict[str, dict[int, tuple[mx.array, mx.array, float]]] = {}
    for i, name in enumerate(sorted(adapters), start=1):
        path = Path(adapters[name]).expanduser().resolve()
        config, pairs = _read_adapter(name, path)
        scale = float(config["lora_parameters"]["scale"])
        for module_path, (a, b) in pairs.items():
            m = modules.get(module_path)
            if not isinstance(m, nn.Linear | nn.QuantizedLinear):
                what = "no such layer" if m is None else f"a {type(m).__name__}, not a linear"
                raise AdapterError(f"adapter {name}: {module_path} is {what} in the base model")
            in_dims, out_dims = _dims(m)
            if a.shape[0] != in_dims or b.shape[1] != out_dims:
                raise AdapterError(
                    f"adapter {name}: {module_path}: lora_a {tuple(a.shape)} / lora_b "
                    f"{tuple(b.shape)} do not fit the base layer ({in_dims} -> {out_dims}); "
                    "was it trained on another model?")
            per_module.setdefault(module_path, {})[i] = (a, b, scale)
        rank = max(a.shape[1] for a, _ in pairs.values())
        lset.adapters[name] = AdapterInfo(
            name, path, i, rank, scale, len(pairs),
            sum(a.nbytes + b.nbytes for a, b in pairs.values()), _digest(path))
    n = len(adapters)
    for module_path, by_index in per_module.items():
        m = modules[module_path]
        in_dims, out_dims = _dims(m)
        r = max(a.shape[1] for a, _, _ in by_index.values())
        dtype = next(iter(by_index.values()))[0].dtype
        # slot i - 1 holds adapter i (zeros where it leaves this layer alone); no slot for
        # the base: its scale (index 0) is 0
        a_rows = [mx.zeros((in_dims, r), dtype=dtype)] * n
        b_rows = [mx.zeros((r, out_dims), dtype=dtype)] * n
        scales = [0.0] * (n + 1)
        for i, (a, b, s) in by_index.items():
            pad = r - a.shape[1]
            a_rows[i - 1] = mx.pad(a.astype(dtype), [(0, 0), (0, pad)]) if pad \
                else a.astype(dtype)
            b_rows[i - 1] = mx.pad(b.astype(dtype), [(0, pad), (0, 0)]) if pad \
                else b.astype(dtype)
            scales[i] = s
        m.lora_a = mx.stack(a_rows)
        m.lora_b = mx.stack(b_rows)
        m.lora_scale = mx.array(scales, dtype=mx.float32)
        mx.eval(m.lora_a, m.lora_b, m.lora_scale)
        lset.nbytes += m.lora_a.nbytes + m.lora_b.nbytes + m.lora_scale.nbytes
        object.__setattr__(m, "_mlxd_rows", lset.rows)
        m.__class__ = _lora_class(type(m))
    object.__setattr__(embedding, "_mlxd_vocab", vocab)
    embedding.__class__ = _offset_class(type(embedding))
    object.__setattr__(model, LORA_ATTR, lset)
    _install_row_hooks()
    for info in lset.adapters.values():
        log.info("adapter %s: %s (rank %d, scale %g, %d layers, %.1f MiB)", info.name,
                 info.path, info.rank, info.scale, info.layers, info.nbytes / 2**20)
    return lset


def lora_of(model: Any) -> LoraSet | None:
    return getattr(model, LORA_ATTR, None)


# ---------------------------------------------------------------------- row hooks


def _install_row_hooks() -> None:
    """Before each forward pass of a batch, the model's LoRA layers learn each row's adapter
    (in the batch's row order), through mlx-lm's one door (once per process)."""
    from mlxd.engine.mlx_lm_internals import hook_forward_passes
    hook_forward_passes(lora_of)
