"""Write a random-weight LLaVA model directory (a CLIP vision tower, a two-layer projector and
a Llama language model, all tiny): config.json, model.safetensors, the tokenizer of
`random_model.py` with an `<image>` token, preprocessor_config.json (CLIP's image processor)
and processor_config.json (LlavaProcessor). It loads through mlx-vlm's `load` like any LLaVA
checkpoint; no weights are downloaded.

    python tests/support/random_vlm.py OUT_DIR [--image-size 56]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from support.random_model import CHATML, write_tokenizer
except ImportError:  # run as a script, or with tests/support on the path (benchmarks)
    from random_model import CHATML, write_tokenizer  # type: ignore[import-not-found,no-redef]

IMAGE_TOKEN = "<image>"
PATCH = 14
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def image_tokens(image_size: int) -> int:
    """Tokens one image takes: one per patch (the CLS position is dropped)."""
    return (image_size // PATCH) ** 2


def write_random_vlm(out: Path, *, image_size: int = 56, hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                     vision_hidden: int = 32, vision_layers: int = 2, vision_heads: int = 2,
                     vocab: int = 512, context: int = 512, seed: int = 0,
                     dtype: str = "float32") -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, CHATML, extra_special=(IMAGE_TOKEN,))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos, image_id = tok.token_to_id("<|im_end|>"), tok.token_to_id(IMAGE_TOKEN)
    assert eos is not None and image_id is not None
    text = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "vocab_size": real_vocab,
            "rope_theta": 10000.0, "max_position_embeddings": context,
            "tie_word_embeddings": False}
    vision = {"model_type": "clip_vision_model", "hidden_size": vision_hidden,
              "num_hidden_layers": vision_layers, "intermediate_size": vision_hidden * 2,
              "num_attention_heads": vision_heads, "image_size": image_size, "patch_size": PATCH,
              "projection_dim": vision_hidden, "num_channels": 3, "layer_norm_eps": 1e-5}
    config = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
              "text_config": text, "vision_config": vision, "image_token_index": image_id,
              "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
              "vocab_size": real_vocab, "eos_token_id": eos,
              "max_position_embeddings": context}
    mx.random.seed(seed)
    cfg = llava.ModelConfig.from_dict(config)
    cfg.text_config = llava.TextConfig.from_dict(text)
    cfg.vision_config = llava.VisionConfig.from_dict(vision)
    model = llava.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    # As in random_model.py: a damped EOS row, so greedy answers run to max_tokens.
    emb = "language_model.model.embed_tokens.weight"
    weights[emb] = weights[emb] * EMBED_SCALE
    key = "language_model.lm_head.weight"
    head = weights[key]
    weights[key] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01, head[eos + 1:]])
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": image_size},
        "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True,
        "resample": 3}, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": PATCH,
        "vision_feature_select_strategy": "default", "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1}, indent=2))
    return out


# Gemma 3: a SigLIP tower, an average-pooling projector, a Gemma 3 language model with
# sliding-window and global layers in turn; the chat template marks an image with
# `<start_of_image>`, which the processor expands to "\n\n<start_of_image>", the soft image
# tokens and "<end_of_image>\n\n".
GEMMA_BOI, GEMMA_EOI, GEMMA_IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
GEMMA_SPECIAL = ("<bos>", "<start_of_turn>", "<end_of_turn>", GEMMA_BOI, GEMMA_EOI,
                 GEMMA_IMAGE)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GEMMA_PATCH = 14
NORM_NOISE = 0.5
EMBED_SCALE = 0.1  # a smaller token embedding: the layers, not the last token, decide the next


def write_random_gemma3(out: Path, *, image_size: int = 56, image_tokens: int = 4,
                        hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                        intermediate: int = 128, sliding_window: int = 16,
                        vision_hidden: int = 32, vision_layers: int = 2, vision_heads: int = 2,
                        vocab: int = 512, context: int = 512, seed: int = 0,
                        dtype: str = "float32") -> Path:
    """A random-weight Gemma 3 (vision) directory. `image_tokens`: positions an image takes
    (a square number; the tower's (image_size / 14)^2 patches are average-pooled to it).
    Layers 0, 2, ... attend over the last `sliding_window` tokens, 1, 3, ... over all."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import gemma3
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, GEMMA_TEMPLATE, extra_special=GEMMA_SPECIAL)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in GEMMA_SPECIAL}
    assert all(i is not None for i in ids.values())
    eos = ids["<end_of_turn>"]
    assert eos is not None
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<end_of_turn>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "boi_token": GEMMA_BOI, "eoi_token": GEMMA_EOI, "image_token": GEMMA_IMAGE,
        "extra_special_tokens": {"boi_token": GEMMA_BOI, "eoi_token": GEMMA_EOI,
                                 "image_token": GEMMA_IMAGE},
        "chat_template": GEMMA_TEMPLATE}))
    head_dim = hidden // heads
    text = {"model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim, "rms_norm_eps": 1e-6, "vocab_size": real_vocab,
            "rope_global_base_freq": 1_000_000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": sliding_window, "sliding_window_pattern": 2,
            "mm_tokens_per_image": image_tokens, "max_position_embeddings": context}
    vision = {"model_type": "siglip_vision_model", "hidden_size": vision_hidden,
              "num_hidden_layers": vision_layers, "intermediate_size": vision_hidden * 2,
              "num_attention_heads": vision_heads, "image_size": image_size,
              "patch_size": GEMMA_PATCH, "num_channels": 3, "layer_norm_eps": 1e-6,
              "vision_use_head": False}
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": text, "vision_config": vision, "image_token_index":
              ids[GEMMA_IMAGE], "boi_token_index": ids[GEMMA_BOI],
              "eoi_token_index": ids[GEMMA_EOI], "mm_tokens_per_image": image_tokens,
              "vocab_size": real_vocab, "eos_token_id": [eos], "pad_token_id": 0}
    mx.random.seed(seed)
    cfg = gemma3.ModelConfig.from_dict(config)
    cfg.text_config = gemma3.TextConfig.from_dict(text)
    cfg.vision_config = gemma3.VisionConfig.from_dict(vision)
    model = gemma3.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    # Random norms and projector (their initial ones and zeros would make the image a
    # constant), and as in random_model.py, a damped EOS row so greedy answers run long.
    for k, v in list(weights.items()):
        if k.endswith("norm.weight") or "mm_input_projection" in k:
            weights[k] = mx.random.normal(v.shape) * NORM_NOISE
    emb = "language_model.model.embed_tokens.weight"
    weights[emb] = weights[emb] * EMBED_SCALE
    key = "language_model.lm_head.weight"
    head = weights[key]
    weights[key] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01, head[eos + 1:]])
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": image_size, "width": image_size},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": None,
        "do_pan_and_scan": None, "image_seq_length": image_tokens}, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma3Processor", "image_seq_length": image_tokens}, indent=2))
    return out


# Mistral 3 (Mistral Small 3.1 / 3.2): a Pixtral tower at the image's own resolution (up to
# `longest_edge`, rounded up to whole 2 x 2 merges of 14-pixel patches), a patch merger and
# projector, a Mistral language model; the chat template marks an image with `[IMG]`, which the
# processor expands into a row of `[IMG]` per merged-patch row, `[IMG_BREAK]` between rows and
# `[IMG_END]` after: an image's positions depend on its size.
MISTRAL_IMAGE, MISTRAL_BREAK, MISTRAL_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
MISTRAL_SPECIAL = ("<s>", "</s>", "[INST]", "[/INST]", MISTRAL_IMAGE, MISTRAL_BREAK, MISTRAL_END)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ '[INST]' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '[IMG]' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '[/INST]' }}{% endif %}{% endfor %}")
MISTRAL_PATCH, MISTRAL_MERGE = 14, 2


def mistral3_image_tokens(width: int, height: int, longest_edge: int = 112) -> int:
    """Positions an image of this size takes (the [IMG] tokens; breaks and the end aside)."""
    unit = MISTRAL_PATCH * MISTRAL_MERGE
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(height // ratio), int(width // ratio)
    return ((height - 1) // unit + 1) * ((width - 1) // unit + 1)


def write_random_mistral3(out: Path, *, longest_edge: int = 112, hidden: int = 64,
                          layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          intermediate: int = 128, vision_hidden: int = 32,
                          vision_layers: int = 2, vision_heads: int = 2, vocab: int = 512,
                          context: int = 512, seed: int = 0, dtype: str = "float32") -> Path:
    """A random-weight Mistral 3 directory; images are resized to fit `longest_edge` pixels."""
    from mlx_vlm.models import mistral3
    return write_pixtral_tower_model(
        out, mistral3, {"model_type": "mistral3",
                        "architectures": ["Mistral3ForConditionalGeneration"],
                        "spatial_merge_size": MISTRAL_MERGE, "multimodal_projector_bias": False},
        MISTRAL_PATCH, MISTRAL_MERGE, longest_edge=longest_edge, hidden=hidden, layers=layers,
        heads=heads, kv_heads=kv_heads, intermediate=intermediate,
        vision_hidden=vision_hidden, vision_layers=vision_layers, vision_heads=vision_heads,
        vocab=vocab, context=context, seed=seed, dtype=dtype)


def write_pixtral_tower_model(out: Path, module: Any, top: dict, patch: int, merge: int, *,
                              longest_edge: int, hidden: int, layers: int, heads: int,
                              kv_heads: int, intermediate: int, vision_hidden: int,
                              vision_layers: int, vision_heads: int, vocab: int, context: int,
                              seed: int, dtype: str) -> Path:
    """A random-weight directory of mlx-vlm's `module` (mistral3, pixtral: Pixtral's tower and
    a Mistral language model), `top` the config's own keys (model type, architecture, ...)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
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
            "max_position_embeddings": context, "tie_word_embeddings": False}
    vision = {"model_type": "pixtral", "hidden_size": vision_hidden,
              "num_hidden_layers": vision_layers, "intermediate_size": vision_hidden * 2,
              "num_attention_heads": vision_heads, "head_dim": vision_hidden // vision_heads,
              "image_size": longest_edge, "patch_size": patch, "num_channels": 3,
              "rope_theta": 10000.0}
    config = {**top, "text_config": text, "vision_config": vision,
              "image_token_index": ids[MISTRAL_IMAGE], "vision_feature_layer": -1,
              "projector_hidden_act": "gelu", "vocab_size": real_vocab, "eos_token_id": eos}
    mx.random.seed(seed)
    cfg = module.ModelConfig.from_dict(config)
    cfg.text_config = module.TextConfig.from_dict(text)
    cfg.vision_config = module.VisionConfig.from_dict(vision)
    model = module.Model(cfg)
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
        "patch_size": {"height": patch, "width": patch}, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": patch,
        "spatial_merge_size": merge, "image_token": MISTRAL_IMAGE,
        "image_break_token": MISTRAL_BREAK, "image_end_token": MISTRAL_END}, indent=2))
    return out


# SmolVLM / Idefics3: a SigLIP tower that sees an image as square tiles of `tile` pixels (the
# image resized to `longest_edge`, then to whole tiles) plus the whole image resized to one tile
# (the global view); a pixel shuffle and a linear connector make each tile `tile_tokens`
# positions; a Llama language model. The chat template marks an image with `<image>`, which the
# processor expands into, per tile, `<fake_token_around_image><row_R_col_C>` and its `<image>`
# tokens, a newline after each row of tiles, then the global view between
# `<fake_token_around_image><global-img>` and `<fake_token_around_image>`.
SMOL_IMAGE, SMOL_FAKE, SMOL_GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"
SMOL_EOS = "<end_of_utterance>"
SMOL_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}")
SMOL_PATCH = 14


def smolvlm_tiles(width: int, height: int, longest_edge: int = 168, tile: int = 56
                  ) -> tuple[int, int]:
    """(rows, columns) of tiles the processor cuts an image of this size into (the global
    view aside); (0, 0): not split (the image fits one tile)."""
    import math
    if width >= height:  # the longest edge resized to `longest_edge` (up or down)
        w, h = longest_edge, int(longest_edge / (width / height))
        h += h % 2
    else:
        h, w = longest_edge, int(longest_edge * (width / height))
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    ratio = w / h  # then both edges to whole tiles
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / ratio) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * ratio) / tile) * tile
    if h > tile or w > tile:
        return math.ceil(h / tile), math.ceil(w / tile)
    return 0, 0


def write_random_smolvlm(out: Path, *, model_type: str = "smolvlm", longest_edge: int = 168,
                         tile: int = 56, scale_factor: int = 2, hidden: int = 64,
                         layers: int = 2, heads: int = 4, kv_heads: int = 2,
                         intermediate: int = 128, vision_hidden: int = 32,
                         vision_layers: int = 2, vision_heads: int = 2, vocab: int = 512,
                         context: int = 1024, seed: int = 0, dtype: str = "float32") -> Path:
    """A random-weight SmolVLM (or, `model_type="idefics3"`, Idefics3) directory: images
    resized to `longest_edge` pixels and cut into tiles of `tile` pixels, each tile
    (tile / 14 / scale_factor)^2 positions."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import idefics3, smolvlm
    from tokenizers import Tokenizer

    family = smolvlm if model_type == "smolvlm" else idefics3
    most = -(-longest_edge // tile)
    rows_cols = tuple(f"<row_{r}_col_{c}>" for r in range(1, most + 1)
                      for c in range(1, most + 1))
    special = (SMOL_EOS, SMOL_FAKE, SMOL_IMAGE, SMOL_GLOBAL, *rows_cols)
    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, vocab, SMOL_TEMPLATE, extra_special=special)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special}
    assert all(i is not None for i in ids.values())
    eos = ids[SMOL_EOS]
    assert eos is not None
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": SMOL_EOS, "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "fake_image_token": SMOL_FAKE, "image_token": SMOL_IMAGE,
        "global_image_token": SMOL_GLOBAL, "end_of_utterance_token": SMOL_EOS,
        "chat_template": SMOL_TEMPLATE}))
    text = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "vocab_size": real_vocab,
            "rope_theta": 100000.0, "max_position_embeddings": context,
            "tie_word_embeddings": False}
    vision = {"model_type": "smolvlm_vision" if model_type == "smolvlm" else "idefics3",
              "hidden_size": vision_hidden, "num_hidden_layers": vision_layers,
              "intermediate_size": vision_hidden * 2, "num_attention_heads": vision_heads,
              "image_size": tile, "patch_size": SMOL_PATCH, "num_channels": 3,
              "layer_norm_eps": 1e-6}
    config = {"model_type": model_type, "architectures": [
                  "SmolVLMForConditionalGeneration" if model_type == "smolvlm"
                  else "Idefics3ForConditionalGeneration"],
              "text_config": text, "vision_config": vision, "image_token_id": ids[SMOL_IMAGE],
              "scale_factor": scale_factor, "vocab_size": real_vocab, "eos_token_id": [eos]}
    mx.random.seed(seed)
    cfg = family.ModelConfig.from_dict(config)
    cfg.text_config = family.TextConfig.from_dict(text)
    cfg.vision_config = family.VisionConfig.from_dict(vision)
    model = family.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    for k, v in list(weights.items()):  # random norms: their ones would flatten the tiles
        if k.endswith("norm.weight"):
            weights[k] = mx.random.normal(v.shape) * NORM_NOISE + 1
    emb = "language_model.embed_tokens.weight"
    weights[emb] = weights[emb] * EMBED_SCALE
    key = "language_model.lm_head.weight"
    head = weights[key]
    weights[key] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01, head[eos + 1:]])
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    processor = "SmolVLMProcessor" if model_type == "smolvlm" else "Idefics3Processor"
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": processor.replace("Processor", "ImageProcessor"),
        "processor_class": processor, "do_resize": True,
        "size": {"longest_edge": longest_edge}, "max_image_size": {"longest_edge": tile},
        "do_image_splitting": True, "do_pad": True, "resample": 1, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}, indent=2))
    tile_tokens = (tile // SMOL_PATCH) ** 2 // scale_factor ** 2
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": processor, "image_seq_len": tile_tokens}, indent=2))
    return out


# Qwen2-VL and Qwen2.5-VL: a ViT (windowed in 2.5) over 14-pixel patches of the image resized
# to whole 28-pixel units (Qwen's smart resize, between `min_pixels` and `max_pixels`), 2 x 2
# patches merged into one position; a Qwen2 language model with 3-D rotary positions (time,
# row, column: an image's positions follow its grid, the text after it resumes past the grid's
# largest side). The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for an
# image; the processor repeats `<|image_pad|>` once per merged patch.
QWEN_START, QWEN_IMAGE, QWEN_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
QWEN_SPECIAL = (QWEN_START, QWEN_IMAGE, QWEN_END, "<|video_pad|>", "<|vision_pad|>")
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def qwen2_5_vl_grid(width: int, height: int, min_pixels: int = 112 * 112,
                    max_pixels: int = 168 * 168) -> tuple[int, int]:
    """(rows, columns) of merged 28-pixel patches an image of this size takes (Qwen2-VL's rule
    too)."""
    import math
    h, w = round(height / 28) * 28, round(width / 28) * 28
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(28, math.floor(height / beta / 28) * 28)
        w = max(28, math.floor(width / beta / 28) * 28)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return h // 28, w // 28


@dataclass(frozen=True)
class QwenShape:
    """What Qwen2-VL's and Qwen2.5-VL's writers share: the language model's size, the
    processor's pixel bounds, the seed and dtype."""
    min_pixels: int = 112 * 112
    max_pixels: int = 168 * 168
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    context: int = 1024
    seed: int = 0
    dtype: str = "float32"


def _write_random_qwen_vl(out: Path, module: Any, architecture: str, processor: str,
                          vision: dict, shape: QwenShape) -> Path:
    """A random-weight Qwen-VL directory of mlx-vlm's `module` (qwen2_vl, qwen2_5_vl), its
    `vision` config given; the tokenizer, template, language model and processor shared."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    real_vocab = write_tokenizer(out, shape.vocab, QWEN_TEMPLATE, extra_special=QWEN_SPECIAL)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (*QWEN_SPECIAL, "<|im_end|>")}
    assert all(i is not None for i in ids.values())
    eos = ids["<|im_end|>"]
    assert eos is not None
    half = shape.hidden // shape.heads // 2  # the rotary frequencies: time, rows, columns
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = {"model_type": vision["model_type"], "architectures": [architecture],
              "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
              "intermediate_size": shape.intermediate, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "rms_norm_eps": 1e-6,
              "vocab_size": real_vocab, "rope_theta": 1_000_000.0,
              "max_position_embeddings": shape.context, "tie_word_embeddings": False,
              "rope_scaling": {"type": "mrope", "mrope_section": section},
              "image_token_id": ids[QWEN_IMAGE], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids[QWEN_START], "vision_end_token_id": ids[QWEN_END],
              "vision_token_id": ids["<|vision_pad|>"], "eos_token_id": eos,
              "vision_config": vision}
    mx.random.seed(shape.seed)
    cfg = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    cfg.text_config = module.TextConfig.from_dict(cfg.text_config)
    cfg.vision_config = module.VisionConfig.from_dict(vision)
    model = module.Model(cfg)
    weights = dict(tree_flatten(model.parameters()))
    emb = "language_model.model.embed_tokens.weight"
    weights[emb] = weights[emb] * EMBED_SCALE
    key = "language_model.lm_head.weight"
    head = weights[key]
    weights[key] = mx.concatenate([head[:eos], head[eos:eos + 1] * 0.01, head[eos + 1:]])
    weights = {k: v.astype(getattr(mx, shape.dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": shape.min_pixels, "max_pixels": shape.max_pixels, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "do_convert_rgb": True}, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor},
                                                          indent=2))
    return out


def write_random_qwen2_5_vl(out: Path, *, min_pixels: int = 112 * 112, max_pixels: int = 168 * 168,
                            hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                            intermediate: int = 128, vision_hidden: int = 32,
                            vision_layers: int = 2, vision_heads: int = 2, vocab: int = 512,
                            context: int = 1024, seed: int = 0, dtype: str = "float32",
                            window_size: int = 56) -> Path:
    """A random-weight Qwen2.5-VL directory; images resized to between `min_pixels` and
    `max_pixels` (whole 28-pixel units). `window_size`: the tower's attention windows in
    pixels (Qwen2.5-VL's own: 112). A grid side that is a whole number of windows gets an
    empty window in mlx-vlm 0.7.10 (`get_window_index` pads a full window, and its dedupe of
    `cu_window_seqlens` compares mx.array scalars by identity, so it drops none): harmless on
    the CPU, a SIGFPE on CUDA (attention over zero tokens)."""
    from mlx_vlm.models import qwen2_5_vl
    vision = {"model_type": "qwen2_5_vl", "depth": vision_layers, "hidden_size": vision_hidden,
              "intermediate_size": vision_hidden * 2, "out_hidden_size": hidden,
              "num_heads": vision_heads, "patch_size": 14, "spatial_patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": window_size,
              "fullatt_block_indexes": [vision_layers - 1], "in_channels": 3}
    shape = QwenShape(min_pixels, max_pixels, hidden, layers, heads, kv_heads, intermediate,
                      vocab, context, seed, dtype)
    return _write_random_qwen_vl(out, qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration",
                                 "Qwen2_5_VLProcessor", vision, shape)


def write_random_qwen2_vl(out: Path, *, min_pixels: int = 112 * 112, max_pixels: int = 168 * 168,
                          hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          intermediate: int = 128, vision_hidden: int = 32,
                          vision_layers: int = 2, vision_heads: int = 2, vocab: int = 512,
                          context: int = 1024, seed: int = 0, dtype: str = "float32") -> Path:
    """A random-weight Qwen2-VL directory: Qwen2.5-VL's language model, tokenizer and
    processor rule, and a tower that attends over the whole image (no windows), of
    `vision_hidden` (its `embed_dim`; `hidden_size` is the language model's, the merger's
    output)."""
    from mlx_vlm.models import qwen2_vl
    # mlp_ratio an int, as in Qwen's configs: transformers' Qwen2VLVisionConfig refuses a float
    vision = {"model_type": "qwen2_vl", "depth": vision_layers, "embed_dim": vision_hidden,
              "hidden_size": hidden, "num_heads": vision_heads, "mlp_ratio": 2,
              "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_channels": 3}
    shape = QwenShape(min_pixels, max_pixels, hidden, layers, heads, kv_heads, intermediate,
                      vocab, context, seed, dtype)
    return _write_random_qwen_vl(out, qwen2_vl, "Qwen2VLForConditionalGeneration",
                                 "Qwen2VLProcessor", vision, shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--image-size", type=int, default=56)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_random_vlm(a.out, image_size=a.image_size, hidden=a.hidden, layers=a.layers,
                     seed=a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
