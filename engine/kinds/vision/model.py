"""A vision-language model (through mlx-vlm) served by the text engine's machinery.

The model directory decides: a `config.json` with a `vision_config` is a vision model. mlx-vlm
loads it (its model classes, its processor); what the runner drives is `VisionLM`, the model's
own language model behind the call mlx-lm's `BatchGenerator` makes (`model(tokens, cache=)`),
so vision rows join the same continuous batch as text rows, and the RAM prefix cache, the SSD
tier, checkpoints and resume work on them unchanged.

An image's place in a prompt is held by *image tokens*, ids that name the image's content
(`image_table.py`); `VisionLM` looks them up in its `ImageTable` and feeds the image's
features in their place.

Families: those whose image features replace the image token's embeddings one for one
(`SUPPORTED`):
- llava: the chat template's `<image>` is the image token, repeated once per position;
- gemma3: the template's `<start_of_image>` becomes what Gemma 3's processor makes of it
  ("\n\n<start_of_image>", the image's soft tokens, "<end_of_image>\n\n"); its language
  model's sliding-window layers get mlx-lm's `RotatingKVCache` (`VisionLM.make_cache`), so the
  caches treat them as they treat a text Gemma 3's. Attention over an image's tokens is
  causal, as in mlx-vlm's own generation (Hugging Face's Gemma 3 lets an image's tokens see
  each other both ways; mlx-vlm does not, and mlxd answers as mlx-vlm does). Pan-and-scan
  (extra crops of an image) is not applied;
- mistral3 (Pixtral's tower, a mistral language model) and pixtral (Pixtral-12B; its config
  as mlx-vlm has it: Hugging Face's llava with a pixtral tower is refused at load, mlx-vlm's
  llava having no such tower): an image's positions follow its size; the template's `[IMG]`
  becomes the processor's rows of `[IMG]` (one per merged patch of the resized image; a
  patch in Pixtral, which merges none), `[IMG_BREAK]` between rows and `[IMG_END]` after,
  and the tower is told the image's size;
- idefics3, smolvlm (a SigLIP tower, a pixel-shuffle connector, a llama language model): the
  template's `<image>` becomes the processor's tiles (the image cut into rows x columns of
  tiles, each after `<fake_token_around_image><row_R_col_C>`, then the whole image as one more
  tile, the global view); the tower runs over an image's tiles at once and each tile's
  features fill its positions in order. A request's tiles are bounded (`prompt.MAX_TILES`).
- qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe (a ViT, windowed in Qwen2.5-VL, and a Qwen2
  or Qwen3 language model with 3-D rotary positions, interleaved in Qwen3-VL): the template's
  `<|image_pad|>` becomes one per merged patch of the image as Qwen's processor resizes it
  (one rule for all, over 28-pixel merged patches, 32-pixel in Qwen3-VL); the language
  model is given each row's positions (`positions.py`: from the row's tokens and its images'
  grids, before every forward pass; Qwen3-VL numbers them as Qwen2-VL does), and the tower the
  image's grid. Qwen3-VL's tower (MoE's too) also gives DeepStack features (`DEEPSTACK`):
  one set per level, which its language model adds to its hidden states at the image's
  positions after each of its first layers. The table keeps them with the image's features,
  and each forward pass is given those of the image tokens it holds, looked up by their ids
  as the features are (`ImageTable.feed`), so an image split over prefill chunks, partly
  restored from a cache or batched with other rows gets each of its positions' own.
Where the processor rewrites the marker (all but llava), admission does so in the rendered
text (`layouts.py`) and tokenizes the result, as the processor does, and each image token
there takes the image's next id. Other families (llava-next's tiling, say) are refused at
load with a message naming the supported families.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engine.kinds.vision import fixes
from mlxd.engine.kinds.vision.image_table import Encoded, ImageTable
from mlxd.engine.kinds.vision.layouts import (
    Layout,
    Tiling,
    gemma3_layout,
    pixtral_layout,
    qwen_grid,
    repeated_layout,
    tiled_layout,
)
from mlxd.engine.kinds.vision.positions import RowPositions
from mlxd.protocol.messages import ImageInput

log = logging.getLogger("mlxd.engine")

SUPPORTED = frozenset({"llava", "gemma3", "mistral3", "pixtral", "idefics3", "smolvlm",
                       "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
PIXTRAL = frozenset({"mistral3", "pixtral"})  # Pixtral's tower: images at their own size
LLAVA_TOWERS = frozenset({"clip_vision_model", "siglip_vision_model"})  # mlx-vlm's llava's
TILED = frozenset({"idefics3", "smolvlm"})  # images cut into tiles (layouts.py)
# 3-D rotary positions that follow an image's grid
POSITIONAL = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
# The tower's features also go into the language model's first layers (DeepStack)
DEEPSTACK = frozenset({"qwen3_vl", "qwen3_vl_moe"})


def is_vision_dir(model_dir: Path) -> bool:
    """A model directory whose config has a `vision_config`: mlx-vlm serves it."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


class VisionLM(nn.Module):
    """What the runner drives: mlx-vlm's language model, fed image features for image token
    ids. `layers` and the call are what mlx-lm's generator and cache helpers use."""

    def __init__(self, vlm: Any, images: ImageTable, positional: bool = False) -> None:
        super().__init__()
        self.vlm = vlm
        self.images = images
        # 3-D rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each row's, from its tokens
        # (positions.py)
        self.positions = RowPositions(images.locate) if positional else None

    @property
    def layers(self) -> list[Any]:
        return list(self.vlm.language_model.layers)

    def make_cache(self) -> list[Any]:
        """mlx-lm's caches for the language model's layers: plain KV, or a sliding window
        where the model's own `make_cache` (mlx-vlm's cache classes) has one."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache
        own = getattr(self.vlm.language_model, "make_cache", None)
        if own is None:
            return [KVCache() for _ in self.layers]
        caches: list[Any] = []
        for c in own():
            kind = type(c).__name__
            if kind == "KVCache":
                caches.append(KVCache())
            elif kind == "RotatingKVCache":
                caches.append(RotatingKVCache(max_size=c.max_size, keep=c.keep))
            else:
                raise ValueError(f"a language model cache of kind {kind} is not served")
        return caches

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        lm = self.vlm.language_model
        # the token embedding: under `model` (llava, gemma3, mistral3) or the LM's own (idefics3)
        fed = self.images.feed(inputs, getattr(lm, "model", lm).embed_tokens)
        embeds = fed.embeds if fed is not None else None
        extra: dict[str, Any] = {}
        if fed is not None and fed.deepstack is not None:  # this pass's image positions
            extra["visual_pos_masks"] = fed.mask
            extra["deepstack_visual_embeds"] = fed.deepstack
        if self.positions is not None:
            rows = self.positions(*inputs.shape[:2])
            if rows is not None:
                extra["position_ids"] = mx.array(rows)
            elif embeds is not None:  # never 1-D positions for an image's tokens
                raise RuntimeError("a forward pass with image tokens and no rows' positions")
            else:  # a pass outside the generator (no images): positions from the offset on
                offset = cache[0].offset if cache else 0
                if isinstance(offset, mx.array):
                    offset = offset.reshape(-1, 1)
                extra["position_ids"] = mx.broadcast_to(
                    mx.arange(inputs.shape[1])[None] + offset, (3, *inputs.shape[:2]))
        out = lm(inputs, inputs_embeds=embeds, cache=cache, **extra)
        return out.logits if hasattr(out, "logits") else out


def _held_arrays(vlm: Any) -> list[mx.array]:
    """Every array the model holds: its parameters, and what its parts keep outside them
    (Pixtral's rotary table sits on a plain object, computed lazily on the loading thread's
    stream). All are evaluated at load: the tower runs on an admission lane's thread, whose
    stream cannot run work left pending on another thread's."""
    found: list[mx.array] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        if type(obj).__module__.startswith(("mlx_vlm", "mlx.")) and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v)

    walk(vlm)
    return found


@dataclass(frozen=True)
class VisionParts:
    """What admission needs to turn images into prompt tokens."""
    image_processor: Any  # pixel values for the vision tower (off the MLX thread)
    image_token: str  # the text that marks an image in a rendered prompt ("<image>")
    image_token_id: int  # the id of each of an image's positions in the processor's output
    tokens_per_image: int  # what the processor gave a 32 x 32 image
    images: ImageTable
    model_type: str
    # Families whose processor replaces the marker in the prompt's text (gemma3, mistral3):
    # (width, height) -> (the text in place of that image's marker, which holds the image
    # token once per position; the image's positions). None: the marker is the image token
    # (llava), one id in the tokenized prompt per image, `tokens_per_image` positions.
    layout: Callable[[int, int], tuple[str, int]] | None = None
    # Tiling families (idefics3, smolvlm): (width, height) -> the tiles the tower sees for the
    # image (the global view included), which a request's budget (MAX_TILES) bounds.
    tiles: Callable[[int, int], int] | None = None
    # Positional families (the Qwen ones): (width, height) -> the image's merged-patch
    # grid (frames, rows, columns), which its positions follow (positions.py).
    grid: Callable[[int, int], tuple[int, int, int]] | None = None


def load_vision(model_dir: Path, dtype: str) -> tuple[VisionLM, Any, dict, VisionParts]:
    """(the model the runner drives, mlx-lm's tokenizer wrapper, config, VisionParts)."""
    from mlx_lm.utils import load_tokenizer

    from mlxd.engine.load.loader import ModelLoadError, _cast_for_device
    try:
        from mlx_vlm.utils import load_image_processor, load_model, load_processor
        from PIL import Image
    except ImportError as e:
        raise ModelLoadError(f"{model_dir.name} is a vision model: serving it needs mlx-vlm "
                             "and Pillow: install mlxd's vision extra (pip install -e "
                             f"'.[vision]' in mlxd's checkout): {e}") from e
    config = json.loads((model_dir / "config.json").read_text())
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED:
        raise ModelLoadError(f"{model_dir.name} is a {model_type or 'unknown'} vision model; "
                             f"mlxd serves vision models of the families "
                             f"{', '.join(sorted(SUPPORTED))}")
    if model_type == "mistral3" and config.get("text_config", {}).get("model_type") not in (
            None, "mistral", "llama"):
        raise ModelLoadError(f"{model_dir.name}: a mistral3 vision model with a "
                             f"{config['text_config']['model_type']} language model is not "
                             "served (Mistral Small 3.1 / 3.2's mistral one is)")
    tower = str((config.get("vision_config") or {}).get("model_type", ""))
    if model_type == "llava" and tower not in LLAVA_TOWERS:
        hint = (" (Pixtral as Hugging Face's mistral-community/pixtral-12b writes it: mlx-vlm "
                "serves Pixtral under model_type \"pixtral\", as its conversions write it)"
                if tower == "pixtral" else "")
        raise ModelLoadError(f"{model_dir.name}: a llava vision model with a {tower or 'unknown'}"
                             f" vision tower is not served{hint}; mlxd serves llava with "
                             f"{' or '.join(sorted(LLAVA_TOWERS))} towers")
    layout: Layout | None = None
    tiling: Tiling | None = None
    options: dict[str, Any] = {}  # the image processor's options, as the processor sets them
    unit = 0  # mistral3, pixtral: pixels per merged patch (an image's positions follow its size)
    per_tile = 0  # idefics3, smolvlm: positions per tile
    grid: Callable[[int, int], tuple[int, int, int]] | None = None  # POSITIONAL
    try:
        vlm = load_model(model_dir)
        fixes.apply(vlm, model_type)
        _cast_for_device(vlm, dtype)
        mx.eval(_held_arrays(vlm))
        processor = load_processor(model_dir, add_detokenizer=False)
        custom = load_image_processor(model_dir)
        image_processor: Any = custom if custom is not None else processor.image_processor
        eos = config.get("eos_token_id") or config.get("text_config", {}).get("eos_token_id")
        tokenizer = load_tokenizer(model_dir, eos_token_ids=eos)
        image_token = str(getattr(processor, "image_token", "<image>"))
        image_token_id = int(config.get("image_token_index", config.get("image_token_id", -1)))
        if image_token_id < 0:
            image_token_id = int(tokenizer.convert_tokens_to_ids(image_token))
        marker = image_token
        probes = [(32, 32)]
        if model_type == "gemma3":  # the template writes <start_of_image>; see the docstring
            marker = str(processor.boi_token)
            layout = gemma3_layout(processor, image_token)
            options = {"do_pan_and_scan": False}
        elif model_type in PIXTRAL:
            layout = pixtral_layout(processor, image_processor)
            unit = int(processor.patch_size) * int(processor.spatial_merge_size)
            options = {"patch_size": unit}
        elif model_type in TILED:
            tiling = Tiling.of(image_processor)
            layout = tiled_layout(processor, tiling)
            per_tile = int(processor.image_seq_len)
            probes += [(100, 30), (30, 100), (tiling.tile, tiling.tile)]
        elif model_type in POSITIONAL:
            grid = qwen_grid(image_processor)
            layout = repeated_layout(image_token, grid)
            probes += [(100, 30), (30, 100), (300, 200)]
        # The processor's own expansion of one image marker: how many positions an image takes
        # (and, where the family lays images out itself, that it agrees, for each probe size).
        n = 0
        for width, height in probes:
            probe = Image.new("RGB", (width, height), (127, 127, 127))
            out = processor(images=[probe], text=[marker])
            theirs = np.array(out["input_ids"])[0].tolist()
            got = theirs.count(image_token_id)
            n = n or got
            if layout is None:
                continue
            text, want = layout(width, height)
            ours = list(tokenizer.encode(text, add_special_tokens=False))
            if want != got or (tiling is not None and theirs[-len(ours):] != ours):
                raise ModelLoadError(f"{model_dir.name}: its processor lays a {width} x "
                                     f"{height} image out otherwise ({got} image tokens) than "
                                     f"mlxd does ({want})")
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load vision model from {model_dir}: {e}") from e
    if n < 1:
        raise ModelLoadError(f"{model_dir.name}: its processor gives an image no image tokens")

    def encode(pixel_values: np.ndarray, grid_of: tuple[int, int, int] | None) -> Encoded:
        extra: dict[str, Any] = {}
        count = n
        if unit:  # the pixels' size (one image: no padding) says how many positions
            h, w = pixel_values.shape[-2:]
            extra["image_sizes"] = [(h, w)]
            count = (h // unit) * (w // unit)
        elif per_tile:  # (1, tiles, channels, height, width): the tiles say how many
            count = pixel_values.shape[1] * per_tile
        elif grid_of is not None:  # (patches, values): the grid in patches, not merged ones
            frames, rows, cols = grid_of
            merge = int(image_processor.merge_size)
            extra["image_grid_thw"] = mx.array([[frames, rows * merge, cols * merge]])
            count = frames * rows * cols
        ids = mx.array([[image_token_id] * count])
        got = vlm.get_input_embeddings(input_ids=ids, pixel_values=mx.array(pixel_values),
                                       mask=mx.ones(ids.shape, dtype=mx.int32), **extra)
        levels = list(got.deepstack_visual_embeds or []) if model_type in DEEPSTACK else []
        if levels:  # each (tokens, hidden)
            return got.inputs_embeds[0], mx.stack(levels)
        return got.inputs_embeds[0]

    def preprocess(image: ImageInput) -> np.ndarray:
        pil = Image.frombytes("RGB", (image.width, image.height), image.pixels)
        values = image_processor(images=[pil], return_tensors="np", **options)["pixel_values"]
        return np.asarray(values, dtype=np.float32)

    table = ImageTable(encode, preprocess)
    parts = VisionParts(image_processor, marker, image_token_id, n, table, model_type, layout,
                        tiling.tiles if tiling is not None else None, grid)
    config = {**config.get("text_config", {}), **{k: v for k, v in config.items()
                                                  if not isinstance(v, dict)}}
    return VisionLM(vlm, table, positional=grid is not None), tokenizer, config, parts
