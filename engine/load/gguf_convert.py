"""Convert a llama-architecture GGUF (as `mx.load` reads it) into an MLX model directory.

Runs in the engine process: it needs MLX. The output is a normal mlx-lm model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json), written to a
temporary sibling directory and renamed into place, so an interrupted conversion is never used.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlxd.protocol.logs import ProgressLog

log = logging.getLogger("mlxd.engine")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _scalar(meta: dict[str, Any], key: str) -> Any:
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's rotary permutation of q/k rows (rows are axis 0, for weight,
    scales and biases alike)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[stem]}.{suffix}"


def _model_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama)")
    p = f"{arch}."
    hidden = int(_scalar(meta, p + "embedding_length"))
    heads = int(_scalar(meta, p + "attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, p + "block_count")),
        "intermediate_size": int(_scalar(meta, p + "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, p + "attention.head_count_kv")),
        "rms_norm_eps": float(_scalar(meta, p + "attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base")),
        "max_position_embeddings": int(_scalar(meta, p + "context_length")),
        "head_dim": hidden // heads,
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }
    config.update(_quantization(weights))
    return config


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any]:
    """mlx-lm's quantization config: the most common (bits, group size), plus an entry for each
    module that differs (GGUF files often keep the embedding at more bits)."""
    per_module: dict[str, tuple[int, int]] = {}
    for name, w in weights.items():
        if not name.endswith(".weight") or w.dtype != mx.uint32:
            continue
        stem = name[: -len(".weight")]
        scales = weights[stem + ".scales"]
        packed_bits = w.shape[-1] * 32
        group_size = 32  # GGUF's Q4_0, Q4_1 and Q8_0 blocks hold 32 weights
        in_features = scales.shape[-1] * group_size
        per_module[_hf_name(name)[: -len(".weight")]] = (packed_bits // in_features, group_size)
    if not per_module:
        return {}
    counts: dict[tuple[int, int], int] = {}
    for q in per_module.values():
        counts[q] = counts.get(q, 0) + 1
    bits, group = max(counts, key=lambda q: counts[q])
    quant: dict[str, Any] = {"group_size": group, "bits": bits}
    for module, (b, g) in per_module.items():
        if (b, g) != (bits, group):
            quant[module] = {"group_size": g, "bits": b}
    return {"quantization": quant}


def _tokenizer_json(meta: dict[str, Any]) -> dict[str, Any]:
    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (gpt2) GGUF tokenizers are supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    merges: list[str] = list(meta["tokenizer.ggml.merges"])
    special = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, kind) in enumerate(zip(tokens, types, strict=False)) if kind == 3
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    bos = int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
    eos = int(_scalar(meta, "tokenizer.ggml.eos_token_id"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": tokens[int(_scalar(meta, "tokenizer.ggml.unknown_token_id"))],
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token"] = tokens[int(_scalar(meta, "tokenizer.ggml.padding_token_id"))]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def convert_gguf(gguf_path: Path, out_dir: Path,
                 on_progress: Callable[[str, int, int, str], None] | None = None) -> Path:
    """Convert `gguf_path` into the MLX model directory `out_dir` (atomically). Progress, one
    step per tensor and one for writing, goes to the log and to `on_progress`."""
    if (out_dir / "config.json").exists():
        return out_dir
    t0 = time.monotonic()
    log.info("converting %s into an MLX model at %s (once)", gguf_path.name, out_dir)
    # mx.load's annotation is one union for every format; a GGUF with its metadata is a pair
    weights, meta = cast(tuple[dict[str, mx.array], dict[str, Any]],
                         mx.load(str(gguf_path), return_metadata=True))
    config = _model_config(meta, weights)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    progress = ProgressLog(log, "GGUF to MLX", len(weights) + 1, "steps", on_progress)
    progress.update(0)
    converted: dict[str, mx.array] = {}
    for name, w in weights.items():
        if ".attn_q." in name:
            w = _unpermute_rows(w, heads)
        elif ".attn_k." in name:
            w = _unpermute_rows(w, kv_heads)
        converted[_hf_name(name)] = w
        mx.eval(w)
        progress.update(len(converted))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), converted, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(_tokenizer_json(meta), ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(meta), indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": config["eos_token_id"],
                        "bos_token_id": config["bos_token_id"]}))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dir_fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    progress.update(len(weights) + 1)
    log.info("converted %s (%d MiB) in %.1f s", gguf_path.name,
             sum(v.nbytes for v in converted.values()) >> 20, time.monotonic() - t0)
    return out_dir
