"""Repairs to mlx-vlm model code that mlxd serves, applied to a loaded model (never to the
library's files), each with the version it was found in and what goes wrong without it.

- Qwen2.5-VL's vision tower (mlx-vlm 0.7.10) splits an image into attention windows and pads
  a side of the merged grid that is a multiple of the window with a whole row of empty
  windows. It means to drop their repeated boundaries (`cu_window_seqlens`), but compares
  MLX scalars by identity, so none is dropped and the attention runs over empty windows: on
  CUDA that crashes the process (SIGFPE in bfloat16, an error in float32; H200), for any image
  whose merged grid has a side divisible by the window (448 x 448 with Qwen's 112-pixel
  windows). Without empty windows the tower's output is the same. (Qwen2-VL's tower attends
  over the whole image, without windows: nothing to repair there.)
"""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx


def apply(vlm: Any, model_type: str) -> None:
    if model_type == "qwen2_5_vl":
        _drop_empty_windows(vlm.vision_tower)


def _drop_empty_windows(tower: Any) -> None:
    own = type(tower).get_window_index

    def get_window_index(self: Any, grid_thw: mx.array) -> tuple[mx.array, mx.array]:
        index, bounds = own(self, grid_thw)
        values = [int(v) for v in bounds.tolist()]
        kept = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
        return index, mx.array(kept, dtype=bounds.dtype)

    tower.get_window_index = types.MethodType(get_window_index, tower)
