"""Who owns what in an engine process, and how the threads hand things over.

Threads (one engine process, or one engine inside `mlxd serve` without --isolate):

- MLX thread (`batch/runner.Runner.run`, the caller of `EngineService.run`): the model, mlx-lm's
  BatchGenerator and the RAM prefix cache. Nothing else touches MLX arrays of live requests.
  It reads commands from `Runner.inbox` and puts `batch/messages.StepTokens` etc. on `outq`.
- I/O thread (`wire/io_thread.IoThread`): the request DEALER and the control DEALER (ZeroMQ
  sockets are never shared between threads). It decodes messages and dispatches them: requests
  to the admission lanes, aborts to the lanes and the runner, flushes and shutdowns to the
  lifecycle; it sends heartbeats and whatever is queued on `control_out`.
- Admission lanes (`admit/lanes.AdmissionLanes`: two lanes, the small one up to four
  threads): chat templates, tokenization, checks, SSD reads. A prepared request is handed over
  under the lanes' lock: its output state to the output thread (a `Registered` on `outq`), then
  its command to the runner's inbox, in that order, so the output thread knows a request before
  its first token.
- Output thread (`wire/output_thread.OutputThread`): the PUSH socket to the proxy and every
  request's output state (detokenizer, stop strings, splitters): it alone creates, reads and
  drops them. It sends one `StepOutput` per batch of queued work and the `EngineStatus`.
- Storage thread (`kv/ssd_tier.SsdTier`): the DEALER to the storage worker and slot bookkeeping.
- Flush threads (`generating.GeneratingEngine._flush`): wait for a flush to finish; the
  copies themselves run on the MLX thread as `batch/messages.Call`s.

Hand-over queues: `outq` (anything -> output thread), `Runner.inbox` (anything -> MLX thread),
`control_out` (anything -> I/O thread -> supervisor). `LoadedModel` is written once, before
the engine reports ready, and only read afterwards.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.wire.output import RequestOutput
from mlxd.protocol.messages import Delta


@dataclass(frozen=True)
class LoadedModel:
    """What the threads read once the model is loaded (never written again)."""
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    context_length: int
    eos_ids: frozenset[int]
    max_token_bytes: int  # the longest token's text: bounds how much text a prompt may have
    grammar_tokenizer: Any  # constraints.TokenizerCache
    pieces: Any = None  # admit.piece_tokens.PieceTokenizer: chat prompts tokenized by part


@dataclass
class Registered:
    """Admission -> output thread: a request's output state, before its first token, and the
    admission notice to send for it."""
    request_id: str
    output: RequestOutput
    notice: Delta


class StatusTick:
    """Wakes the output thread to send a status now (a state change, or stopping)."""


@dataclass
class Channels:
    outq: queue.Queue[Any] = field(default_factory=queue.Queue)
    control_out: queue.Queue[Any] = field(default_factory=queue.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    # set before `stop` when no proxy will read the last outputs (Shutdown.outputs_unread):
    # the output socket then closes without waiting to deliver them
    outputs_unread: threading.Event = field(default_factory=threading.Event)
