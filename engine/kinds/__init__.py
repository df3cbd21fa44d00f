"""Kinds of engine: each in a package of its own (`text/`, `vision/`, `group/`, `embedding/`),
behind the protocols of `base.py`. Only the chosen kind's package is imported (a text engine
never imports mlx-vlm, a vision one never starts a group)."""

from __future__ import annotations

from pathlib import Path

from mlxd.engine.kinds.base import Engine, EngineKind, Host


def open_engine(host: Host) -> Engine:
    """Load the model the launch names and build its engine, on the MLX thread: an encoder
    or sentence-transformers directory gets an embedding engine; a directory with a
    `vision_config` a vision engine; a `--shard` layout the rank 0 of a group; anything else
    a text engine (ModelLoadError and kin: it cannot load). A `vision_config` directory
    whose family the vision engine does not serve, or which holds no vision tower, is a text
    engine where mlx-lm loads it (`route.py`)."""
    from mlxd.engine.embeddings.models import model_use
    from mlxd.engine.kinds.vision.model import is_vision_dir
    from mlxd.engine.load.loader import resolve_model_dir
    from mlxd.protocol import faults

    launch = host.launch
    faults.hit("engine.load")
    model_dir = resolve_model_dir(launch.model, Path(launch.cache_dir), host.progress)
    if model_use(model_dir) == "embed":
        from mlxd.engine.kinds.embedding.kind import EncoderEngine
        return EncoderEngine.open(host, model_dir)
    kind: EngineKind
    if is_vision_dir(model_dir) and _vision_route(model_dir) == "vision":
        from mlxd.engine.kinds.vision.kind import VisionKind
        kind = VisionKind(launch)
    elif launch.group:
        from mlxd.engine.kinds.group.kind import GroupKind
        kind = GroupKind(launch, host.supervised)
    else:
        from mlxd.engine.kinds.text.kind import TextKind
        kind = TextKind(launch)
    from mlxd.engine.generating import GeneratingEngine
    return GeneratingEngine.open(kind, host, model_dir)


def _vision_route(model_dir: Path) -> str:
    import json
    import logging

    from mlxd.engine.kinds.route import mlx_lm_loads, route_vision_config, weight_names
    from mlxd.engine.kinds.vision.model import SUPPORTED

    config = json.loads((model_dir / "config.json").read_text())
    route = route_vision_config(config, weight_names(model_dir), SUPPORTED, mlx_lm_loads)
    if route.why:
        logging.getLogger("mlxd.engine").warning("%s: %s", model_dir.name, route.why)
    return route.kind
