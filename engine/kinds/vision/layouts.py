"""How each family's processor lays an image out in a prompt (`VisionParts.layout`: an image's
width and height -> the text that replaces its marker, and how many positions the image takes
there), computed from the size alone, so admission knows a prompt's tokens before (or without)
running the image processor. `load_vision` checks each layout against the processor's own
expansion of a few probe images at load, so a processor that lays images out otherwise is a
load error, never a wrong prompt.

- gemma3: a fixed text (newlines, `<start_of_image>`, the soft tokens, `<end_of_image>`);
- mistral3 (Pixtral): rows of `[IMG]`, one per merged patch of the resized image, with
  `[IMG_BREAK]` between rows and `[IMG_END]` after;
- idefics3 / smolvlm: the image resized so its longest edge is the processor's `size`, then
  up to whole tiles of `max_image_size`, cut into rows x columns of tiles, each tile
  `image_seq_len` positions after `<fake_token_around_image><row_R_col_C>`, a newline after each
  row, then the whole image resized to one tile (the global view) between
  `<fake_token_around_image><global-img>` and `<fake_token_around_image>`; an image that fits
  one tile is the global view alone;
- qwen2_vl, qwen2_5_vl, qwen3_vl: the image token once per merged patch of the image resized
  by Qwen's rule (its grid also gives the image's 3-D positions: positions.py)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Layout = Callable[[int, int], tuple[str, int]]

# The processors' absolute bound on an edge after their resize (transformers' SmolVLM and
# Idefics3 image processors: MAX_IMAGE_SIZE, "4k resolution as absolute maximum").
TILED_MAX_EDGE = 4096


def gemma3_layout(processor: Any, image_token: str) -> Layout:
    """One view per image: pan-and-scan (extra crops, more tokens) is not applied."""
    text = str(processor.full_image_sequence)
    return lambda width, height: (text, text.count(image_token))


def pixtral_layout(processor: Any, image_processor: Any) -> Layout:
    """Mistral 3's (Pixtral's) variable resolution, as its processor lays an image out: the
    image resized to fit the longest edge and rounded up to whole merged patches, then a row
    of image tokens per merged-patch row, `[IMG_BREAK]` between rows, `[IMG_END]` after."""
    from mlx_vlm.models.pixtral.image_processing_pixtral import get_resize_output_image_size
    unit = int(processor.patch_size) * int(processor.spatial_merge_size)
    size = image_processor.size
    if isinstance(size, dict) and size.get("longest_edge") is not None:
        box = (int(size["longest_edge"]),) * 2
    elif isinstance(size, dict):
        box = (int(size["height"]), int(size["width"]))
    else:
        box = (int(size),) * 2
    token, brk, end = processor.image_token, processor.image_break_token, processor.image_end_token

    def layout(width: int, height: int) -> tuple[str, int]:
        h, w = (get_resize_output_image_size((height, width), box, unit)
                if image_processor.do_resize else (height, width))
        rows, cols = h // unit, w // unit
        return brk.join([token * cols] * rows) + end, rows * cols
    return layout


@dataclass(frozen=True)
class Tiling:
    """What an Idefics3 / SmolVLM image processor does to an image's size."""
    resize: bool  # `do_resize`
    longest_edge: int | None  # `size["longest_edge"]` (None: `size` is a fixed height, width)
    fixed: tuple[int, int] | None  # `size` as (height, width), where it is one
    split: bool  # `do_image_splitting`
    tile: int  # `max_image_size["longest_edge"]`: a tile's edge, and the global view's

    @classmethod
    def of(cls, image_processor: Any) -> Tiling:
        size = _as_dict(image_processor.size)
        edge = size.get("longest_edge")
        fixed = None if edge else (int(size["height"]), int(size["width"]))
        return cls(bool(image_processor.do_resize), int(edge) if edge else None, fixed,
                   bool(image_processor.do_image_splitting),
                   int(_as_dict(image_processor.max_image_size)["longest_edge"]))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tiles an image is cut into; (0, 0): the global view alone."""
        if not self.split:
            return 0, 0
        h, w = height, width
        if self.resize and self.longest_edge:
            h, w = _to_longest_edge(h, w, self.longest_edge)
        elif self.resize and self.fixed:
            h, w = self.fixed
        # `resize_for_vision_encoder`: the longer edge up to whole tiles, the other edge scaled
        # with it (from the rounded edge, as the processor does), then up to whole tiles too.
        ratio = w / h
        if w >= h:
            w = math.ceil(w / self.tile) * self.tile
            h = math.ceil(int(w / ratio) / self.tile) * self.tile
        else:
            h = math.ceil(h / self.tile) * self.tile
            w = math.ceil(int(h * ratio) / self.tile) * self.tile
        if h > self.tile or w > self.tile:
            return math.ceil(h / self.tile), math.ceil(w / self.tile)
        return 0, 0

    def tiles(self, width: int, height: int) -> int:
        """Tiles the vision tower sees for this image, the global view included."""
        rows, cols = self.grid(width, height)
        return rows * cols + 1


def tiled_layout(processor: Any, tiling: Tiling) -> Layout:
    """Idefics3's and SmolVLM's tiles, laid out by the processor's own prompt-string function
    (`get_image_prompt_string` of its module: both take rows, columns, positions per tile, the
    fake token, the image token and the global-image token, in that order)."""
    prompt_string = sys.modules[type(processor).__module__].get_image_prompt_string
    per_tile = int(processor.image_seq_len)
    fake, token = str(processor.fake_image_token), str(processor.image_token)
    global_token = str(getattr(processor, "global_image_token", None)
                       or getattr(processor, "global_image_tag", "<global-img>"))

    def layout(width: int, height: int) -> tuple[str, int]:
        rows, cols = tiling.grid(width, height)
        text = str(prompt_string(rows, cols, per_tile, fake, token, global_token))
        return text, (rows * cols + 1) * per_tile
    return layout


def _to_longest_edge(h: int, w: int, edge: int) -> tuple[int, int]:
    """The processor's resize: the longest edge to `edge` (up or down), the other with the
    aspect ratio, made even; then both under TILED_MAX_EDGE."""
    ratio = w / h
    if w >= h:
        w, h = edge, int(edge / ratio)
        h += h % 2
    else:
        h, w = edge, int(edge * ratio)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    ratio = w / h
    if w >= h and w > TILED_MAX_EDGE:
        w, h = TILED_MAX_EDGE, int(TILED_MAX_EDGE / ratio)
    elif h > w and h > TILED_MAX_EDGE:
        h, w = TILED_MAX_EDGE, int(TILED_MAX_EDGE * ratio)
    return max(h, 1), max(w, 1)


def _as_dict(size: Any) -> dict:
    """A processor's size field: a dict, or transformers' SizeDict."""
    if isinstance(size, dict):
        return size
    return {k: getattr(size, k) for k in ("longest_edge", "height", "width")
            if getattr(size, k, None) is not None}


def qwen_grid(image_processor: Any) -> Callable[[int, int], tuple[int, int, int]]:
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's image grid in merged patches (frames, rows,
    columns): the image resized by the processor's own size rule (whole `patch_size *
    merge_size` units, 28 pixels or Qwen3-VL's 32, between its `min_pixels` and
    `max_pixels`; an aspect ratio over 200 is its ValueError), one frame for a still image."""
    merge = int(image_processor.merge_size)
    unit = int(image_processor.patch_size) * merge

    def grid(width: int, height: int) -> tuple[int, int, int]:
        h, w = image_processor._resolved_size(height, width)
        return 1, h // unit, w // unit
    return grid


def repeated_layout(image_token: str, grid: Callable[[int, int], tuple[int, int, int]]
                    ) -> Layout:
    """The image token once per merged patch in place of the template's one (Qwen: between
    the template's own `<|vision_start|>` and `<|vision_end|>`)."""
    def layout(width: int, height: int) -> tuple[str, int]:
        frames, rows, cols = grid(width, height)
        n = frames * rows * cols
        return image_token * n, n
    return layout
