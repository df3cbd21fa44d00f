"""A random-weight Pixtral directory (mlx-vlm's `pixtral` classes, tiny; no download).

Pixtral (Pixtral-12B): Mistral 3's tower at the image's own resolution without the patch
merger (16-pixel patches, one position each, `spatial_merge_size` 1), a two-layer projector
and a Mistral language model; the chat template marks an image with `[IMG]`, which the
processor expands into a row of `[IMG]` per patch row, `[IMG_BREAK]` between rows and
`[IMG_END]` after. The config is mlx-vlm's: `model_type` "pixtral" (Hugging Face's
mistral-community/pixtral-12b says "llava" with a pixtral `vision_config`, which mlx-vlm's
llava cannot load; `write_random_pixtral(llava=True)` writes that config, for the load test).
"""

from __future__ import annotations

import json
from pathlib import Path

try:
    from support.random_model import write_tokenizer
    from support.random_vlm import (
        CLIP_MEAN,
        CLIP_STD,
        MISTRAL_BREAK,
        MISTRAL_END,
        MISTRAL_IMAGE,
        MISTRAL_SPECIAL,
        MISTRAL_TEMPLATE,
    )
except ImportError:  # tests/support on the path (benchmarks)
    from random_model import write_tokenizer  # type: ignore[import-not-found,no-redef]
    from random_vlm import (  # type: ignore[import-not-found,no-redef]
        CLIP_MEAN,
        CLIP_STD,
        MISTRAL_BREAK,
        MISTRAL_END,
        MISTRAL_IMAGE,
        MISTRAL_SPECIAL,
        MISTRAL_TEMPLATE,
    )

PIXTRAL_PATCH = 16


def pixtral_image_tokens(width: int, height: int, longest_edge: int = 112) -> int:
    """Positions an image of this size takes (the [IMG] tokens; breaks and the end aside)."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(height // ratio), int(width // ratio)
    unit = PIXTRAL_PATCH
    return ((height - 1) // unit + 1) * ((width - 1) // unit + 1)


def write_random_pixtral(out: Path, *, longest_edge: int = 112, hidden: int = 64,
                         layers: int = 2, heads: int = 4, kv_heads: int = 2,
                         intermediate: int = 128, vision_hidden: int = 32,
                         vision_layers: int = 2, vision_heads: int = 2, vocab: int = 512,
                         context: int = 512, seed: int = 0, dtype: str = "float32",
                         llava: bool = False) -> Path:
    """A random-weight Pixtral directory; images are resized to fit `longest_edge` pixels.
    `llava`: the config as Hugging Face's conversion writes it (`model_type` "llava")."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import pixtral
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, MISTRAL_TEMPLATE, extra_special=MISTRAL_SPECIAL)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in MISTRAL_SPECIAL}
    assert all(i is not None for i in ids.values())
    eos = ids["</s>"]
    assert eos is not None
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False,
        "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": MISTRAL_TEMPLATE}))
    text = {"model_type": "mistral", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-5,
            "vocab_size": real_vocab, "rope_theta": 1_000_000.0,
            "max_position_embeddings": context}
    vision = {"model_type": "pixtral", "hidden_size": vision_hidden,
              "num_hidden_layers": vision_layers, "intermediate_size": vision_hidden * 2,
              "num_attention_heads": vision_heads, "head_dim": vision_hidden // vision_heads,
              "image_size": longest_edge, "patch_size": PIXTRAL_PATCH, "num_channels": 3,
              "rope_theta": 10000.0}
    config = {"model_type": "llava" if llava else "pixtral",
              "architectures": ["LlavaForConditionalGeneration"],
              "text_config": text, "vision_config": vision,
              "image_token_index": ids[MISTRAL_IMAGE], "vision_feature_layer": -1,
              "vision_feature_select_strategy": "full", "projector_hidden_act": "gelu",
              "vocab_size": real_vocab, "eos_token_id": eos}
    mx.random.seed(seed)
    cfg = pixtral.ModelConfig.from_dict(config)
    cfg.text_config = pixtral.TextConfig.from_dict(text)
    cfg.vision_config = pixtral.VisionConfig.from_dict(vision)
    model = pixtral.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    key = "language_model.lm_head.weight"
    head = weights[key]
    weights[key] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01, head[eos + 1:]])
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "do_resize": True, "size": {"longest_edge": longest_edge},
        "patch_size": {"height": PIXTRAL_PATCH, "width": PIXTRAL_PATCH}, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": PIXTRAL_PATCH,
        "spatial_merge_size": 1, "image_token": MISTRAL_IMAGE,
        "image_break_token": MISTRAL_BREAK, "image_end_token": MISTRAL_END}, indent=2))
    return out
