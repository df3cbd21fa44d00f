"""The warm-up: short generations through the real path before an engine says it is ready:
admission (chat template, tokenizer, sampler), the MLX thread's generator (prefill and decode
kernels compiled or JIT-built, buffers allocated) and each row's output state (detokenizer,
stop strings). They run in a runner of their own, with no RAM or SSD tier and their own
counters, so no cache content and no figure users see is touched; fault points neither fire
nor count. A failure is logged: the engine serves anyway.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

from mlxd.engine.admit import prepare as admission
from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.engine.batch.budget import ceiling
from mlxd.engine.batch.messages import RequestsRemoved, StepTokens, StopRunner
from mlxd.engine.batch.runner import Runner
from mlxd.engine.state import LoadedModel
from mlxd.protocol import faults
from mlxd.protocol.messages import Generate, SamplingParams
from mlxd.protocol.settings import EngineSettings

log = logging.getLogger("mlxd.engine")

# The warm-up: a greedy chat request (the chat template rendered), then a sampled plain prompt
# (the other sampler path), each alone in the batch as a first request usually is (on a GPU
# kernels are built per shape), each a prefill and a few decode steps. The prompts are short:
# on a CPU a prefill costs seconds. A template that refuses a system message gets the user's
# alone; a model without one gets the plain prompt.
WARM_UP_TOKENS = 2  # a prefill, then one decode step
WARM_UP_CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                 [{"role": "user", "content": "Hi!"}]]
WARM_UP_PROMPT = "Hi"
WARM_UP_SAMPLING = [SamplingParams(max_tokens=WARM_UP_TOKENS),
                    SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=WARM_UP_TOKENS)]



@dataclass
class WarmUp:
    seconds: float  # the whole warm-up
    # seconds per prompt token of the cheapest of its requests (their steps' time over the
    # prompt tokens they prefilled, decode steps included: a figure that errs long), or None:
    # the serving runner's first step is sized and paced by it (batch/timing/)
    token_s: float | None = None


def warm_up(model: Any, loaded: LoadedModel, stream: Any, settings: EngineSettings) -> WarmUp:
    """Run the warm-up on this (the MLX) thread."""
    t0 = time.monotonic()
    rates: list[float] = []
    try:
        with faults.quiet():
            problem = _warm_up(model, loaded, stream, settings, rates)
    except Exception as e:  # noqa: BLE001  a model that cannot warm up may still serve
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        log.warning("warm-up failed (the first request will be slower): %s", problem)
    return WarmUp(time.monotonic() - t0, min(rates) if rates else None)


class _WarmUpOutbox(queue.Queue):
    """The warm-up runner's outbox: each row's tokens go through its output state, as the
    output thread would send them; once every row is done the runner is told to stop."""

    def __init__(self, outputs: dict[str, Any]) -> None:
        super().__init__()
        self.outputs = outputs
        self.inbox: queue.Queue[Any] | None = None  # the runner's, once it exists
        self.error: str | None = None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, StepTokens):
            for rid, token, finish in item.rows:
                out = self.outputs.get(rid)
                if out is None:
                    continue
                delta = out.add(token, finish)
                if finish is not None or (delta is not None and delta.finish_reason):
                    del self.outputs[rid]
        elif isinstance(item, RequestsRemoved):
            self.error = self.error or item.error
            for rid in item.request_ids:
                self.outputs.pop(rid, None)
        if not self.outputs and self.inbox is not None:
            self.inbox.put(StopRunner())


def _warm_up(model: Any, loaded: LoadedModel, stream: Any, settings: Any,
             rates: list[float]) -> str | None:
    """Run the warm-up generations on this (the MLX) thread; what went wrong, or None. Each
    request's seconds per prompt token go to `rates`."""
    for i, sampling in enumerate(WARM_UP_SAMPLING):
        rid = f"warm-up-{i}"
        tries = [Generate(rid, sampling, messages=m) for m in WARM_UP_CHATS] if i == 0 else []
        tries.append(Generate(rid, sampling, prompt=WARM_UP_PROMPT))
        for msg in tries:
            result = admission.prepare(msg, loaded, lambda _: None, 0.0)
            if isinstance(result, Admitted):
                break
        if isinstance(result, Answered):
            return "; ".join(d.error or "" for d in result.deltas)
        outbox = _WarmUpOutbox({rid: result.output})
        runner = Runner(model, sorted(loaded.eos_ids), batch_size=ceiling(settings.batch),
                        prefill_step=settings.prefill_step, outbox=outbox, stream=stream)
        outbox.inbox = runner.inbox
        runner.inbox.put(result.request)
        runner.run()
        if outbox.error is not None:
            return outbox.error
        c = runner.counters
        if c.prefilled_tokens > 0 and c.step_s > 0:
            rates.append(c.step_s / c.prefilled_tokens)
    return None


