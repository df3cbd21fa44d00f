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

from pathlib import Path

try:
    from support.random_vlm import write_pixtral_tower_model
except ImportError:  # tests/support on the path (benchmarks)
    from random_vlm import write_pixtral_tower_model  # type: ignore[import-not-found,no-redef]

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
    from mlx_vlm.models import pixtral
    return write_pixtral_tower_model(
        out, pixtral, {"model_type": "llava" if llava else "pixtral",
                       "architectures": ["LlavaForConditionalGeneration"],
                       "vision_feature_select_strategy": "full"},
        PIXTRAL_PATCH, 1, longest_edge=longest_edge, hidden=hidden, layers=layers,
        heads=heads, kv_heads=kv_heads, intermediate=intermediate,
        vision_hidden=vision_hidden, vision_layers=vision_layers, vision_heads=vision_heads,
        vocab=vocab, context=context, seed=seed, dtype=dtype)
