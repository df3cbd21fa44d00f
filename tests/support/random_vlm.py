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
from pathlib import Path

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
