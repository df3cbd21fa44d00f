"""The engine's side of the per-token stage clock (see `protocol/stage_trace.py`), installed
only when MLXD_STAGE_TRACE is set.

MLX thread: without a line in the runner, the step's boundaries are taken where mlx-lm makes
them: `BatchGenerator.next` (in, out), `GenerationBatch._step` (out: tokens read back) and the
`mx.async_eval` / `mx.eval` calls inside that step (graph built, dispatched, device done), by
wrapping those two methods and giving `mlx_lm.generate` a module object whose `eval` and
`async_eval` stamp before delegating to the module it had. The runner's put and the hand-off
are stamped by the output queue (`step_handoff.StepOutbox`), which attaches the step's stamps
to its `StepTokens`.
The output thread adds its own stamps per row (`OutputTrace`).

The benchmark's in-process reference installs the same hooks (`install`), so both sides of
the comparison are measured by the same clock at the same places.
"""

from __future__ import annotations

import types
from typing import Any

from mlxd.engine.batch.messages import StepTokens
from mlxd.protocol.messages import Delta
from mlxd.protocol.stage_trace import TokenTrace, TraceFile, flush_requests, now

_current: dict[str, int] | None = None  # the step under way (MLX thread only)
_in_step = False  # inside GenerationBatch._step: its eval calls are the step's
last_step: dict[str, int] = {}  # the latest finished step's stamps
steps: list[dict[str, int]] = []  # every finished step's, when `keep_steps` (in-process)
keep_steps = False
_installed = False


def attach() -> OutputTrace:
    """The engine under the trace: mlx-lm's step boundaries wrapped (the output queue,
    `step_handoff.StepOutbox`, stamps the put and the hand-off of each step's tokens)."""
    install()
    return OutputTrace()


def install() -> None:
    """Wrap mlx-lm's step boundaries once per process."""
    global _installed
    if _installed:
        return
    import importlib

    g: Any = importlib.import_module("mlx_lm.generate")  # (mlx_lm.generate is also a function)
    mx = g.mx  # mlx.core, or step_handoff's module over it

    next_, step_ = g.BatchGenerator.next, g.GenerationBatch._step

    def traced_next(self: Any) -> Any:
        global _current, last_step
        cur = _current = {"next_in": now()}
        try:
            return next_(self)
        finally:
            cur["next_out"] = now()
            _current = None
            if "read_back" in cur:  # a decode step (not prompt processing alone)
                last_step = cur
                if keep_steps:
                    steps.append(cur)

    def traced_step(self: Any) -> Any:
        global _in_step
        _in_step = True
        try:
            return step_(self)
        finally:
            _in_step = False
            if _current is not None:
                _current["read_back"] = now()

    def async_eval(*args: Any) -> Any:
        cur = _current if _in_step else None
        if cur is not None and "graph_built" not in cur:
            cur["graph_built"] = now()
            out = mx.async_eval(*args)
            cur["dispatched"] = now()
            return out
        return mx.async_eval(*args)

    def eval_(*args: Any) -> None:
        mx.eval(*args)  # (after step_handoff's release, when installed)
        cur = _current if _in_step else None
        if cur is not None and "device_done" not in cur:
            cur["device_done"] = now()

    shim = types.ModuleType("mlx.core")  # mlx.core for mlx-lm's generate module, stamping
    shim.__dict__.update({k: v for k, v in vars(mx).items() if not k.startswith("__")})
    shim.__dict__.update(async_eval=async_eval, eval=eval_)
    g.mx = shim
    from mlxd.engine.speculative.step import Speculator
    speculate = Speculator._speculate

    def traced_speculate(self: Any, gen: Any, gb: Any) -> Any:
        global last_step
        t0 = now()
        out = speculate(self, gen, gb)
        if out is not None:  # tokens of a draft-and-verify step, not of gen.next()
            last_step = {"next_in": t0, "next_out": now(), "speculative": 1}
            if keep_steps:
                steps.append(last_step)
        return out

    Speculator._speculate = traced_speculate  # type: ignore[method-assign]
    g.BatchGenerator.next = traced_next
    g.GenerationBatch._step = traced_step
    _installed = True


class OutputTrace:
    """The output thread's stamps: a row's delta after its step was taken and its token
    detokenized; encode and send times once its StepOutput went out."""

    def __init__(self, file: TraceFile | None = None) -> None:
        self.file = file or TraceFile("engine")
        self._pending: list[tuple[Delta, dict[str, int], int]] = []

    def taken(self, step: StepTokens) -> dict[str, int]:
        return {**getattr(step, "trace", {}), "taken": now()}

    def detokenized(self, delta: Delta, stamps: dict[str, int], rows: int) -> None:
        if delta.token_ids:  # a token (an EOS ends a request without one)
            self._pending.append((delta, {**stamps, "detokenized": now()}, rows))

    def sent(self, encoded: int, sent: int, finished: bool) -> None:
        for delta, stamps, rows in self._pending:
            stamps["encoded"], stamps["sent"] = encoded, sent
            self.file.add(TokenTrace(delta.request_id, delta.completion_tokens, stamps, rows))
        self._pending.clear()
        if finished:
            self.file.flush()
            flush_requests()
