"""An embedding engine: an encoder or a sentence-transformers model through mlx-embeddings. It
has no generator, no KV tiers and no adapters; its MLX thread only embeds
(`embeddings/batching.py`), in forward passes of up to 64 inputs across requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.engine.admit.prepare import Admitted, Answered, refused
from mlxd.engine.batch.timing.chunking import step_target
from mlxd.engine.embeddings.batching import Embedding
from mlxd.engine.embeddings.models import load_encoder
from mlxd.engine.kinds.base import Host
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import CacheFlushed, Embed, EngineStatus, FlushCache, Generate
from mlxd.protocol.models import model_id
from mlxd.protocol.settings import PoolShare


class EncoderEngine:
    loaded: LoadedModel | None = None  # it prepares no generation
    report = "an embedding model"

    def __init__(self, host: Host, model_dir: Path, embedding: Embedding) -> None:
        self.host = host
        self.model_dir = model_dir
        self.embedding = embedding
        self._stop = threading.Event()

    @classmethod
    def open(cls, host: Host, model_dir: Path) -> EncoderEngine:
        launch = host.launch
        stream = mx.new_stream(mx.default_device())
        embedder = load_encoder(model_dir, launch.settings.dtype, stream)
        embedding = Embedding(embedder, host.channels.outq, launch.engine_id, launch.epoch,
                              target_s=step_target(launch.hang_timeout))
        if launch.settings.warm_up:  # the kernels built, and the first pass's pace measured
            embedding.warm_up()
        return cls(host, model_dir, embedding)

    def prepare(self, msg: Generate, received_at: float) -> Admitted | Answered:
        return refused(msg.request_id, f"{model_id(self.host.launch.model)} is an embedding "
                                       "model: it does not generate text")

    def prepare_many(self, msgs: list[Generate], received_at: float
                     ) -> Iterator[Admitted | Answered]:
        return (self.prepare(m, received_at) for m in msgs)

    def admit(self, request: Any) -> None:
        raise AssertionError("an embedding engine admits no generation")

    def abort(self, request_ids: list[str]) -> None:
        self.embedding.abort(request_ids)

    def embed(self, msg: Embed) -> None:
        self.embedding.submit(msg)

    def run(self, stop: threading.Event) -> None:
        self.embedding.serve(stop)

    def stop(self, flush_timeout: float) -> None:
        pass  # `serve` ends when the lifecycle's stop event is set

    def flush(self, msg: FlushCache) -> None:
        launch = self.host.launch
        self.host.channels.outq.put(CacheFlushed(launch.engine_id, launch.epoch, msg.token,
                                                 0, 0, 0, "the SSD tier is off", "ssd_off"))

    def set_share(self, share: PoolShare) -> None:
        pass

    def storage_restarted(self) -> None:
        pass

    def status(self, status: EngineStatus) -> EngineStatus:
        return self.embedding.status(status, self.model_dir)

    def progress(self) -> tuple[int, bool, float]:
        return self.embedding.progress()

    def served(self) -> int:
        return self.embedding.counters.inputs

    def close(self) -> None:
        self.embedding.stop()


