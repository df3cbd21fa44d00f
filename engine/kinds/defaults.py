"""What most kinds of generating engine do alike, for them to inherit: no part of the SSD
namespace of their own, no status fields of their own, the plain runner, probes made with the
model itself, nothing to close."""

from __future__ import annotations

from typing import Any

from mlxd.engine.batch.runner import Runner
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import EngineStatus


class SingleProcessKind:
    def ssd_namespace(self) -> str:
        return ""

    def status(self, status: EngineStatus) -> EngineStatus:
        return status

    def runner_class(self) -> type[Runner]:
        return Runner

    def probe_model(self, model: Any, loaded: LoadedModel) -> Any:
        return model

    def close(self) -> None:
        pass
