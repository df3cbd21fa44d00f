"""A text engine: an mlx-lm model, with its LoRA adapters (`lora.py`) when some are registered
on it. The kind every feature applies to: speculation (not with adapters: their forward
passes take more than tokens), a burst's prompts tokenized together, `--kv-bits`."""

from __future__ import annotations

from pathlib import Path

from mlxd.engine.admit.prepare import Admitted, Answered, prepare, refused
from mlxd.engine.kinds.base import Features, KindName, Lookup, ProgressFn, Weights
from mlxd.engine.kinds.defaults import SingleProcessKind
from mlxd.engine.kinds.text.lora import LoraSet, apply_adapters, mark_prompt, unmarked_processors
from mlxd.engine.load.loader import load_model
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import Generate
from mlxd.protocol.models import adapters_of, model_id
from mlxd.protocol.settings import EngineLaunch


class TextKind(SingleProcessKind):
    name: KindName = "text"

    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        self.lora: LoraSet | None = None  # adapters registered on this base, once loaded

    @property
    def features(self) -> Features:
        return Features(speculative=self.launch.settings.speculative and self.lora is None)

    def load(self, model_dir: Path, progress: ProgressFn) -> Weights:
        launch = self.launch
        model, tokenizer, config = load_model(str(model_dir), Path(launch.cache_dir),
                                              launch.settings.dtype, progress)
        self.lora = apply_adapters(model, adapters_of(launch.settings.adapter, launch.model))
        return Weights(model, tokenizer, config)

    def prepare(self, msg: Generate, model: LoadedModel, lookup: Lookup, received_at: float,
                tokens: list[int] | None = None) -> Admitted | Answered:
        if msg.images:
            return refused(msg.request_id, f"{model_id(self.launch.model)} does not take images")
        if msg.adapter:
            return self._prepare_adapter(msg, model, lookup, received_at)
        return prepare(msg, model, lookup.restore, received_at, tokens)

    def _prepare_adapter(self, msg: Generate, model: LoadedModel, lookup: Lookup,
                         received_at: float) -> Admitted | Answered:
        """An adapter's request: its prompt's first token marked with the adapter (see
        lora.py), so that its rows run the adapter and its cache keys are the adapter's."""
        lora = self.lora
        index = lora.index(msg.adapter) if lora is not None else None
        if lora is None or index is None:
            return refused(msg.request_id, f"{model_id(self.launch.model)} has no adapter "
                                           f"{msg.adapter[:200]!r}")
        vocab = lora.vocab
        result = prepare(msg, model, lambda p: lookup.restore(mark_prompt(p, index, vocab)),
                         received_at)
        if isinstance(result, Admitted):
            result.request.prompt = mark_prompt(result.request.prompt, index, vocab)
            result.request.processors = unmarked_processors(result.request.processors, vocab)
        return result

    def ssd_namespace(self) -> str:
        # what each adapter index means: blocks computed under one are keyed apart
        return f"|lora {self.lora.identity()}" if self.lora is not None else ""
