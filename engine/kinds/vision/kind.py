"""A vision engine: mlx-vlm's language model behind the call mlx-lm's generator makes, images
turned into hash-derived token ids at admission (`prompt.py`) and into features in the
forward pass (`model.py`). Rows whose prompt holds images run plain steps (a verify pass would
feed their features again, and in the Qwen families their 3-D positions); rows without images
speculate as a text model's do, by prompt lookup (a verify pass is outside the generator's
hooks: in the Qwen families its positions are the cache's offsets, which are a row's own
where no image came before), not with `--draft-model` (a draft model is checked against text
models only). mlxd does not make its caches (no `--kv-bits`)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.engine.kinds.base import Features, KindName, Lookup, ProgressFn, Weights
from mlxd.engine.kinds.defaults import SingleProcessKind
from mlxd.engine.kinds.text.lora import AdapterError
from mlxd.engine.kinds.vision.model import load_vision
from mlxd.engine.kinds.vision.prompt import VisionAdmission
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import EngineStatus, Generate
from mlxd.protocol.models import adapters_of
from mlxd.protocol.settings import EngineLaunch


class VisionKind(SingleProcessKind):
    name: KindName = "vision"

    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        self.admission: VisionAdmission | None = None  # set by `load`

    @property
    def features(self) -> Features:
        settings = self.launch.settings
        return Features(speculative=settings.speculative
                        and not settings.draft_model, prompt_batch=False, kv_quant=False)

    def load(self, model_dir: Path, progress: ProgressFn) -> Weights:
        if adapters_of(self.launch.settings.adapter, self.launch.model):
            raise AdapterError("LoRA adapters apply to text models served by one engine "
                               "(not to a sharded or a vision model)")
        model, tokenizer, config, parts = load_vision(model_dir, self.launch.settings.dtype)
        if model.positions is not None:  # its rows' positions follow their tokens' images
            from mlxd.engine.mlx_lm_internals import hook_row_tokens
            hook_row_tokens(lambda m: getattr(m, "positions", None))
        self.admission = VisionAdmission(parts)
        return Weights(model, tokenizer, config)

    def prepare(self, msg: Generate, model: LoadedModel, lookup: Lookup, received_at: float,
                tokens: list[int] | None = None) -> Admitted | Answered:
        assert self.admission is not None  # requests come once the model is loaded
        return self.admission.prepare(msg, model, lookup, received_at)

    def status(self, status: EngineStatus) -> EngineStatus:
        return msgspec.structs.replace(status, capabilities=[*status.capabilities, "vision"])
