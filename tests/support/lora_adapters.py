"""Random LoRA adapters for a base model directory, written as mlx-lm writes them after
`mlx_lm.lora` training: `adapter_config.json` and `adapters.safetensors` (the `lora_a` /
`lora_b` of every layer mlx-lm's own `linear_to_lora_layers` wraps)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_random_adapter(base: Path, out: Path, *, rank: int = 8, scale: float = 10.0,
                         num_layers: int = -1, keys: list[str] | None = None,
                         seed: int = 0, strength: float = 1.0) -> Path:
    """An adapter for `base` whose B matrices are random (not zero, as fresh training starts),
    so that it changes the model's output. `strength` scales the B values."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load(str(base))[0]
    params: dict = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params)
    mx.random.seed(seed)
    weights = {}
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, w in flat:
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lora_a":
            weights[name] = mx.random.normal(w.shape) * (1.0 / w.shape[0] ** 0.5)
        elif leaf == "lora_b":
            weights[name] = mx.random.normal(w.shape) * (strength / w.shape[1])
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"),
                        {k: v.astype(mx.float32) for k, v in weights.items()})
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params,
        "model": str(base)}, indent=2))
    return out
