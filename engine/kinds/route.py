"""Which engine kind serves a model directory whose config has a `vision_config`, pure.

Such a directory is not always one to serve images from:
- many families ship one config for their text and vision parts (Qwen3.5, Gemma 3 and 4,
  Llama 4, ...), and mlx-lm serves their language model alone (its `sanitize`
  drops the tower's weights); a conversion for text (`mlx_lm.convert`) keeps that config but
  holds no tower at all;
- mlxd's vision engine serves images for some families only (`vision/model.py`, `SUPPORTED`).

So: a family the vision engine serves, with its tower's weights, is a vision engine; any
other directory that mlx-lm can load is a text engine (requests with images get a 400 that
says the model does not take images, as any text model's do); what neither can load goes to
the vision engine, whose refusal at load names the families it serves.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# A weight belongs to the vision side when one of its name's first two parts says so:
# "vision_tower.", "vision_model.", "visual.", "model.visual.", "model.vision_tower.", ...
VISION_NAME_PARTS = ("vision", "visual")
HEADER_MAX = 100 << 20  # the safetensors format's own bound on a header


@dataclass(frozen=True)
class Route:
    kind: Literal["vision", "text"]
    why: str = ""  # why a directory with a vision config is served as text (for the log)


def is_vision_weight(name: str) -> bool:
    return any(part.startswith(VISION_NAME_PARTS) for part in name.split(".")[:2])


def route_vision_config(config: dict, weight_names: Iterable[str],
                        vision_families: frozenset[str],
                        text_loads: Callable[[str], bool]) -> Route:
    """The kind for a directory with a `vision_config`: `weight_names` are its weights'
    names, `vision_families` the model types the vision engine serves, `text_loads(t)` whether
    mlx-lm has a model for model type `t`."""
    model_type = str(config.get("model_type", ""))
    if model_type in vision_families:
        if any(is_vision_weight(n) for n in weight_names):
            return Route("vision")
        if text_loads(model_type):
            return Route("text", f"{model_type} directory without a vision tower's weights: "
                                 "served as a text model")
        return Route("vision")
    if text_loads(model_type):
        return Route("text", f"mlxd serves images for the vision families "
                             f"{', '.join(sorted(vision_families))}; this {model_type} model "
                             f"is served as a text model (requests with images are refused)")
    return Route("vision")


def weight_names(model_dir: Path) -> list[str]:
    """The names of a directory's safetensors weights: from the index when there is one, else
    from each file's header (its first bytes; the tensors are not read)."""
    index = model_dir / "model.safetensors.index.json"
    try:
        return list(json.loads(index.read_text())["weight_map"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > HEADER_MAX:  # not a safetensors file (a damaged one): no names
                    continue
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            continue
        names.extend(k for k in header if k != "__metadata__")
    return names


def mlx_lm_loads(model_type: str) -> bool:
    """Whether mlx-lm has a model for `model_type` (after its own renaming)."""
    import importlib.util

    from mlx_lm.utils import MODEL_REMAPPING
    name = MODEL_REMAPPING.get(model_type, model_type)
    if not name or not name.replace("_", "").replace("-", "").isalnum():  # a module name
        return False
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False
