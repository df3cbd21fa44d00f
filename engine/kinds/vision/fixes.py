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
- Every family's vision tower is evaluated in pieces (`paced`): one block at a time, and on
  MLX's CPU backend each of its modules. Left whole, a large image's tower is one graph of
  thousands of operations handed to MLX at once, on the admission lane's thread; MLX (0.32)
  lets at most 10 tasks be in flight across all streams before an `eval` waits for one to end,
  and on the CPU every operation is a task, some of a large tower's seconds long: the engine's
  decode steps, on their own stream, then waited behind the tower's operations (a 1280 x 800
  image in a random Qwen2.5-VL on this CPU: a running row's decode step took 13 s; 3.3 s with
  the tower evaluated block by block). Evaluated module by module, the tower has a few
  operations in flight at a time. On a GPU a task is a command buffer of many operations, and
  an evaluation per module would cost a synchronisation each: there, block by block. The
  tower's output is the same either way.
"""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx


def apply(vlm: Any, model_type: str) -> None:
    if model_type == "qwen2_5_vl":
        _drop_empty_windows(vlm.vision_tower)
    paced(vlm)


BLOCK_LISTS = ("layers", "blocks")  # the towers' names for their lists of blocks


def paced(vlm: Any, every_module: bool | None = None) -> int:
    """Make each block of the vision tower (`every_module`: each of its modules; by default on
    the CPU) evaluate its output when it returns; the number of modules so made."""
    tower = getattr(vlm, "vision_tower", None) or getattr(vlm, "vision_model", None)
    if tower is None:
        return 0
    if every_module is None:
        every_module = mx.default_device() == mx.cpu
    made: dict[type, type] = {}
    count = 0
    for name, module in tower.named_modules():
        parts = name.split(".")
        block = len(parts) >= 2 and parts[-2] in BLOCK_LISTS and parts[-1].isdigit()
        if not name or not (block or every_module) or getattr(type(module), "paced", False):
            continue
        cls = type(module)
        if cls not in made:
            made[cls] = _evaluating(cls)
        module.__class__ = made[cls]
        count += 1
    return count


def _evaluating(cls: type) -> type:
    call = cls.__call__

    def evaluated_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = call(self, *args, **kwargs)
        arrays = [x for x in (out if isinstance(out, (tuple, list)) else [out])
                  if isinstance(x, mx.array)]
        mx.eval(arrays)
        return out
    # the class keeps its module's name: model.py's `_held_arrays` looks into mlx-vlm's
    # objects by it (Pixtral's rotary table, on a plain object, would be left unevaluated)
    return type(cls.__name__, (cls,), {"__call__": evaluated_call, "paced": True,
                                      "__module__": cls.__module__})


def _drop_empty_windows(tower: Any) -> None:
    own = type(tower).get_window_index

    def get_window_index(self: Any, grid_thw: mx.array) -> tuple[mx.array, mx.array]:
        index, bounds = own(self, grid_thw)
        values = [int(v) for v in bounds.tolist()]
        kept = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
        return index, mx.array(kept, dtype=bounds.dtype)

    tower.get_window_index = types.MethodType(get_window_index, tower)
