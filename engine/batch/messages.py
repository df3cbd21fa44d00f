"""What goes into the MLX thread's inbox (`Runner.inbox`: requests to insert, aborts, a stop,
calls to run between steps) and what comes out of it on the output queue (a step's tokens, a
request's start, removed requests). Plain data, apart from the runner, so that the threads and
modules that only send or read these (admission, the output thread, the step hand-off, the
stage clock) do not import mlx-lm's generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxd.protocol.messages import CacheSource, FinishReason

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.kv.prefix_cache import RestoredPrefix


@dataclass
class AddRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampler: Callable[[mx.array], mx.array]
    processors: list
    restored: RestoredPrefix | None = None  # KV read from the SSD tier, if it beats RAM
    received_at: float = 0.0  # monotonic time the engine received the request
    logprobs: int = -1  # top alternatives to report per token (-1: no log-probabilities)
    group: str = ""  # n > 1: the answers to one prompt share one prefill (`PrefillGroup`)
    group_size: int = 1
    # More positions at which a model with state layers (sliding windows, recurrent states)
    # snapshots them while prefilling, so that another prompt sharing the head up to there
    # restores it (a vision prompt: where each image ends).
    snapshot_at: tuple[int, ...] = ()
    # False: its row never speculates (a vision prompt with images: a verify pass would have
    # to feed their features again)
    speculate: bool = True


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class StopRunner:
    pass


@dataclass
class Call:
    """Run `fn(runner)` on the MLX thread (flushes, cache maintenance)."""
    fn: Callable[[Runner], None]


@dataclass
class StepTokens:
    """One step: (request_id, token, finish_reason) for every row that produced a token."""
    rows: list[tuple[str, int, FinishReason | None]]
    # request_id -> (the token's logprob, [(token id, logprob)] most likely first), for the
    # rows that asked for log-probabilities
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class RequestStarted:
    request_id: str
    cached_tokens: int
    source: CacheSource


@dataclass
class RequestsRemoved:
    request_ids: list[str]
    error: str | None = None
