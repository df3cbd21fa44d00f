"""What differs between engines, as two protocols.

- `EngineKind`: what one kind of generating engine decides (text with adapters, vision, the
  rank 0 of a sharded group): how its model loads, how a request is prepared, which features
  its rows may use, its part of the SSD namespace, its status fields and the runner it drives.
  `generating.GeneratingEngine` builds everything they share (runner, RAM and SSD tiers, KV
  budget, embeddings between steps, flushes) around one.
- `Engine`: a loaded engine as the lifecycle (`service.py`) drives it, whatever its kind: a
  `GeneratingEngine`, or an encoder's (`kinds/embedding/`), which only embeds.

`kinds.open_engine` picks the kind from the model directory and the launch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import zmq

from mlxd.engine.stage_clock import RequestClock
from mlxd.engine.state import Channels, LoadedModel
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.messages import Embed, EngineStatus, FlushCache, Generate
from mlxd.protocol.settings import EngineLaunch, PoolShare

if TYPE_CHECKING:
    from mlxd.engine.admit.prepare import Admitted, Answered
    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.kv.prefix_cache import RestoredPrefix

KindName = Literal["text", "vision", "group", "embedding"]
ProgressFn = Callable[[str, int, int, str], None]  # (task, done, total, unit) of a long step


@dataclass(frozen=True)
class Features:
    """What the rows of one kind of generating engine may use."""
    speculative: bool = False  # drafted and verified steps for a row decoding alone
    restore_from_ssd: bool = True  # rows start from the SSD tier's blocks
    warm_up: bool = True  # generations before ready (a sharded group cannot run one alone)
    prompt_batch: bool = True  # a burst's chat prompts tokenized in one call
    kv_quant: bool = True  # --kv-bits (mlxd makes this kind's caches)
    embeddings: bool = True  # /v1/embeddings from the model's hidden states


@dataclass(frozen=True)
class Weights:
    model: Any  # an mlx-lm model (or mlx-vlm's language model behind the same call)
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: dict


@dataclass(frozen=True)
class Lookup:
    """The cache tiers as admission asks them, on an admission lane."""
    restore: Callable[[list[int]], RestoredPrefix | None]  # SSD blocks better than RAM's
    peek: Callable[[list[int]], int]  # tokens the RAM tier would serve now


@dataclass(frozen=True)
class Host:
    """What the lifecycle gives an engine: its launch, its process's sockets and queues."""
    launch: EngineLaunch
    supervised: bool
    ctx: zmq.Context
    endpoints: Endpoints
    channels: Channels
    preparing: Callable[[float], int]  # requests still on an admission lane (burst admission)
    progress: ProgressFn  # the load's long steps, for the status
    clock: RequestClock  # the stage clock's hooks (no-ops when it is off)


class EngineKind(Protocol):
    name: KindName

    @property
    def features(self) -> Features: ...

    def load(self, model_dir: Path, progress: ProgressFn) -> Weights:
        """The model, on the MLX thread (ModelLoadError, AdapterError: it cannot)."""

    def prepare(self, msg: Generate, model: LoadedModel, lookup: Lookup, received_at: float,
                tokens: list[int] | None = None) -> Admitted | Answered:
        """A request made ready for the runner, on an admission lane; `tokens`: its prompt,
        where a lane already tokenized it (`Features.prompt_batch`)."""

    def ssd_namespace(self) -> str:
        """What the kind adds to the SSD tier's namespace ("" nothing): blocks of another
        meaning (an adapter's, a shard's) must never be read for this engine's rows."""

    def status(self, status: EngineStatus) -> EngineStatus:
        """The status with the kind's own fields."""

    def runner_class(self) -> type[Runner]:
        """The runner its MLX thread drives."""

    def probe_model(self, model: Any, loaded: LoadedModel) -> Any:
        """The model for start-up forward passes (KV layout, batch budget)."""

    def close(self) -> None:
        """After the MLX loop ended."""


class Engine(Protocol):
    """A loaded engine, as the lifecycle drives it from its threads."""
    @property
    def loaded(self) -> LoadedModel | None:
        """The tokenizer and limits requests are prepared with (None: no generation)."""

    @property
    def report(self) -> str:
        """How its load went, for the log's "ready" line."""

    def prepare(self, msg: Generate, received_at: float) -> Admitted | Answered: ...

    def prepare_many(self, msgs: list[Generate], received_at: float
                     ) -> Iterator[Admitted | Answered]: ...

    def admit(self, request: AddRequest) -> None:
        """A prepared request to the MLX thread (under the admission lanes' lock)."""

    def abort(self, request_ids: list[str]) -> None: ...

    def embed(self, msg: Embed) -> None: ...

    def run(self, stop: threading.Event) -> None:
        """The MLX loop, on the calling thread, until stopped."""

    def stop(self, flush_timeout: float) -> None:
        """Stop the MLX loop after making the cache durable (bounded); never blocks."""

    def flush(self, msg: FlushCache) -> None: ...

    def set_share(self, share: PoolShare) -> None: ...

    def storage_restarted(self) -> None: ...

    def status(self, status: EngineStatus) -> EngineStatus: ...

    def progress(self) -> tuple[int, bool, float]:
        """The MLX thread's step counter, whether it is busy, and how long a step takes now
        (the hang watchdog's figures: `batch/timing/pace.py`)."""

    def served(self) -> int:
        """Tokens generated (inputs embedded) in this engine's life: the supervisor's crash-loop
        breaker counts only deaths of engines that served none (daemon/restart_policy.py)."""

    def close(self) -> None: ...
