"""The rank 0 of a sharded engine (`--shard`): it starts and joins the group (`leader.py`),
loads its shard, and drives a runner whose generator calls its followers repeat
(`log.py`). Rows run plain steps from what rank 0 alone could know: no speculation, no
restore from the SSD tier (each rank would need its own shard's blocks), no warm-up (a
lone forward pass would leave the followers behind), no embeddings, no `--kv-bits`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.engine.batch.runner import Runner
from mlxd.engine.kinds.base import Features, KindName, Lookup, ProgressFn, Weights
from mlxd.engine.kinds.group.leader import GroupLeader, start_group
from mlxd.engine.kinds.text.lora import AdapterError
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import EngineStatus, Generate
from mlxd.protocol.models import adapters_of
from mlxd.protocol.settings import EngineLaunch

FEATURES = Features(speculative=False, restore_from_ssd=False, warm_up=False,
                    prompt_batch=False, kv_quant=False, embeddings=False)


class GroupKind:
    name: KindName = "group"
    features = FEATURES

    def __init__(self, launch: EngineLaunch, supervised: bool) -> None:
        self.launch = launch
        self.supervised = supervised
        self.leader: GroupLeader | None = None  # once started

    def load(self, model_dir: Path, progress: ProgressFn) -> Weights:
        if adapters_of(self.launch.settings.adapter, self.launch.model):
            raise AdapterError("LoRA adapters apply to text models served by one engine "
                               "(not to a sharded or a vision model)")
        self.leader = start_group(self.launch, model_dir, self.supervised)
        return Weights(*self.leader.load())

    def prepare(self, msg: Generate, model: LoadedModel, lookup: Lookup, received_at: float,
                tokens: list[int] | None = None) -> Admitted | Answered:
        assert self.leader is not None  # requests come once the model is loaded
        return self.leader.prepare(msg, model, received_at)

    def ssd_namespace(self) -> str:
        return f"|group {self.launch.group} rank 0"  # its blocks hold rank 0's shard only

    def status(self, status: EngineStatus) -> EngineStatus:
        procs = self.leader.procs if self.leader is not None else []
        return msgspec.structs.replace(status, group=self.launch.group,
                                       group_pids=[p.pid for p in procs])

    def runner_class(self) -> type[Runner]:
        assert self.leader is not None
        return self.leader.runner_class()

    def probe_model(self, model: Any, loaded: LoadedModel) -> Any:
        assert self.leader is not None
        return self.leader.probe_model(model, loaded)

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()
