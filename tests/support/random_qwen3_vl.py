"""A random-weight Qwen3-VL directory (mlx-vlm's `qwen3_vl` classes, tiny; no download).

Qwen3-VL: a ViT over 16-pixel patches of the image resized to whole 32-pixel units (Qwen's
smart resize, between the processor's `size.shortest_edge` and `size.longest_edge` pixels),
2 x 2 patches merged into one position; a Qwen3 language model with 3-D rotary positions
(interleaved M-RoPE: time, row and column frequencies alternate), which follow an image's
grid as in Qwen2-VL. DeepStack: the tower also gives features from some of its blocks
(`deepstack_visual_indexes`), each through its own merger, and the language model adds the
k-th to its hidden states at the image's positions after its k-th layer. The chat template
writes `<|vision_start|><|image_pad|><|vision_end|>` for an image; the processor repeats
`<|image_pad|>` once per merged patch. Qwen3-VL-MoE (`qwen3_vl_moe`): the same with a
mixture-of-experts language model (`experts`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

try:
    from support.random_model import write_tokenizer
    from support.random_vlm import (
        EMBED_SCALE,
        NORM_NOISE,
        QWEN_END,
        QWEN_IMAGE,
        QWEN_SPECIAL,
        QWEN_START,
        QWEN_TEMPLATE,
    )
except ImportError:  # tests/support on the path (benchmarks)
    from random_model import write_tokenizer  # type: ignore[import-not-found,no-redef]
    from random_vlm import (  # type: ignore[import-not-found,no-redef]
        EMBED_SCALE,
        NORM_NOISE,
        QWEN_END,
        QWEN_IMAGE,
        QWEN_SPECIAL,
        QWEN_START,
        QWEN_TEMPLATE,
    )

QWEN3_PATCH = 16
QWEN3_UNIT = 32  # a merged patch: 2 x 2 patches of 16 pixels


def qwen3_vl_grid(width: int, height: int, min_pixels: int = 128 * 128,
                  max_pixels: int = 192 * 192) -> tuple[int, int]:
    """(rows, columns) of merged 32-pixel patches an image of this size takes."""
    unit = QWEN3_UNIT
    h, w = round(height / unit) * unit, round(width / unit) * unit
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(unit, math.floor(height / beta / unit) * unit)
        w = max(unit, math.floor(width / beta / unit) * unit)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / unit) * unit, math.ceil(width * beta / unit) * unit
    return h // unit, w // unit


def write_random_qwen3_vl(out: Path, *, min_pixels: int = 128 * 128,
                          max_pixels: int = 192 * 192, hidden: int = 64, layers: int = 2,
                          heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                          vision_hidden: int = 32, vision_layers: int = 2,
                          vision_heads: int = 2, deepstack: tuple[int, ...] = (0, 1),
                          vocab: int = 512, context: int = 1024, seed: int = 0,
                          dtype: str = "float32", experts: int = 0) -> Path:
    """A random-weight Qwen3-VL directory, laid out as the released ones are (`text_config`
    and `vision_config` nested, the processor's pixel bounds in `size`). `deepstack`: the
    tower blocks whose features the language model adds after its first len(deepstack)
    layers. `experts`: a Qwen3-VL-MoE, every layer's MLP that many experts (two a token)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen3_vl, qwen3_vl_moe
    from tokenizers import Tokenizer

    model_type, module = ("qwen3_vl_moe", qwen3_vl_moe) if experts else ("qwen3_vl", qwen3_vl)

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, QWEN_TEMPLATE, extra_special=QWEN_SPECIAL)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (*QWEN_SPECIAL, "<|im_end|>")}
    assert all(i is not None for i in ids.values())
    eos = ids["<|im_end|>"]
    assert eos is not None
    head_dim = hidden // heads
    half = head_dim // 2  # the rotary frequencies, interleaved over time, rows, columns
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = {"model_type": f"{model_type}_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
            "vocab_size": real_vocab, "rope_theta": 5_000_000.0,
            "max_position_embeddings": context, "tie_word_embeddings": False,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": section,
                             "rope_type": "default"}, "eos_token_id": eos}
    if experts:
        text |= {"num_experts": experts, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "moe_intermediate_size": intermediate // 2}
    vision = {"model_type": model_type, "depth": vision_layers, "hidden_size": vision_hidden,
              "intermediate_size": vision_hidden * 2, "out_hidden_size": hidden,
              "num_heads": vision_heads, "patch_size": QWEN3_PATCH, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "num_position_embeddings": 64, "in_channels": 3,
              "deepstack_visual_indexes": list(deepstack)}
    config = {"model_type": model_type, "architectures": [
                  "Qwen3VLMoeForConditionalGeneration" if experts
                  else "Qwen3VLForConditionalGeneration"],
              "text_config": text, "vision_config": vision,
              "image_token_id": ids[QWEN_IMAGE], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids[QWEN_START], "vision_end_token_id": ids[QWEN_END],
              "tie_word_embeddings": False}
    mx.random.seed(seed)
    cfg = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    cfg.text_config = module.TextConfig.from_dict(json.loads(json.dumps(text)))
    cfg.vision_config = module.VisionConfig.from_dict(vision)
    model = module.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    # Random norms in the deepstack mergers (their initial ones would make each merger's
    # features nearly alike for every image), and as in random_model.py, a smaller token
    # embedding and a damped EOS row so greedy answers run long.
    for k, v in list(weights.items()):
        if "deepstack_merger_list" in k and k.endswith("norm.weight"):
            weights[k] = mx.random.normal(v.shape) * NORM_NOISE + 1
    emb = "language_model.model.embed_tokens.weight"
    weights[emb] = weights[emb] * EMBED_SCALE
    key = "language_model.lm_head.weight"
    head = weights[key]
    weights[key] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01, head[eos + 1:]])
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor", "patch_size": QWEN3_PATCH,
        "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True},
        indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Qwen3VLProcessor"}, indent=2))
    return out
