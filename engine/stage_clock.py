"""The engine's side of the per-token stage clock (see `protocol/stage_trace.py`), installed
only when the hidden setting `stage_trace` (`MLXD_STAGE_TRACE=DIR`) is set; a request's stamps
go through a `RequestClock`, a no-op (`NO_CLOCK`) when it is not.

MLX thread: without a line in the runner, the step's boundaries are taken where mlx-lm makes
them: the generator's `next` (in, out), and inside a decode step its graph built, dispatched,
the device done and the tokens read back (`mlx_lm_internals.observe_steps`). The runner's put
and the hand-off are stamped by the output queue (`batch/handoff.StepOutbox`), which attaches
the step's stamps to its `StepTokens`.
The output thread adds its own stamps per row (`OutputTrace`).

The benchmark's in-process reference installs the same hooks (`install`), so both sides of
the comparison are measured by the same clock at the same places.
"""

from __future__ import annotations

from typing import Any

from mlxd.engine.batch.messages import StepTokens
from mlxd.protocol.messages import Delta
from mlxd.protocol.stage_trace import (
    TokenTrace,
    TraceFile,
    flush_requests,
    forget_request,
    now,
    stamp_request,
)

_current: dict[str, int] | None = None  # the step under way (MLX thread only)
last_step: dict[str, int] = {}  # the latest finished step's stamps
_last_call: dict[str, int] = {}  # the latest generator call's, a decode step or not
steps: list[dict[str, int]] = []  # every finished step's, when `keep_steps` (in-process)
keep_steps = False
_installed = False


def attach() -> OutputTrace:
    """The engine under the trace: mlx-lm's step boundaries wrapped (the output queue,
    `batch/handoff.StepOutbox`, stamps the put and the hand-off of each step's tokens)."""
    install()
    return OutputTrace()


def install() -> None:
    """Observe mlx-lm's step boundaries once per process (through mlx-lm's one door), and
    stamp the speculative step's."""
    global _installed
    if _installed:
        return
    from mlxd.engine.mlx_lm_internals import observe_steps
    from mlxd.engine.speculative.step import Speculator
    observe_steps(_StepStamps())
    speculate = Speculator._speculate

    def traced_speculate(self: Any, gen: Any, batch: Any) -> Any:
        global last_step
        t0 = now()
        out = speculate(self, gen, batch)
        if out is not None:  # tokens of a draft-and-verify step, not of gen.next()
            last_step = {"next_in": t0, "next_out": now(), "speculative": 1}
            if keep_steps:
                steps.append(last_step)
        return out

    Speculator._speculate = traced_speculate  # type: ignore[method-assign]
    _installed = True


class _StepStamps:
    """A generator call's stamps: in and out of `next`; inside a decode step, the graph
    built (its first async_eval), dispatched, the device done (its first eval) and the
    tokens read back."""

    def next_started(self) -> None:
        global _current
        _current = {"next_in": now()}

    def next_ended(self) -> None:
        global _current, last_step, _last_call
        cur = _current
        _current = None
        if cur is None:
            return
        cur["next_out"] = now()
        _last_call = cur
        if "read_back" in cur:  # a decode step (not prompt processing alone)
            last_step = cur
            if keep_steps:
                steps.append(cur)

    def step_read_back(self) -> None:
        if _current is not None:
            _current["read_back"] = now()

    def dispatching(self) -> None:
        if _current is not None and "graph_built" not in _current:
            _current["graph_built"] = now()

    def dispatched(self) -> None:
        if _current is not None and "dispatched" not in _current:
            _current["dispatched"] = now()

    def device_done(self) -> None:
        if _current is not None and "device_done" not in _current:
            _current["device_done"] = now()


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


class RequestClock:
    """A request's way to its first step, stamped at the boundaries between the engine's
    rooms (one hook each): received by the I/O thread and handed to the admission lanes,
    taken by a lane, tokenized (the lane asks the cache tiers), the tiers answered, handed over
    to the MLX thread, taken from its inbox, inserted into the generator. `forget`: a request
    that will not reach its last stamp (refused, cancelled, failed). `NO_CLOCK` is the one
    used when the stage clock is off: every hook a no-op."""

    def received(self, request_id: str) -> None:
        stamp_request(request_id, "engine_in", "engine")

    def lane(self, request_id: str) -> None:
        stamp_request(request_id, "lane", "engine")

    def tokenized(self, request_id: str) -> None:
        stamp_request(request_id, "tokenized", "engine")

    def tiers_asked(self, request_id: str) -> None:
        stamp_request(request_id, "restore_checked", "engine")

    def prepared(self, request_id: str) -> None:
        stamp_request(request_id, "prepared", "engine")

    def taken(self, request_id: str) -> None:
        stamp_request(request_id, "taken", "engine")

    def inserted(self, request_id: str) -> None:
        stamp_request(request_id, "inserted", "engine", True)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            forget_request(rid)


class _NoClock(RequestClock):
    def received(self, request_id: str) -> None:
        pass

    def lane(self, request_id: str) -> None:
        pass

    def tokenized(self, request_id: str) -> None:
        pass

    def tiers_asked(self, request_id: str) -> None:
        pass

    def prepared(self, request_id: str) -> None:
        pass

    def taken(self, request_id: str) -> None:
        pass

    def inserted(self, request_id: str) -> None:
        pass

    def forget(self, request_ids: list[str]) -> None:
        pass


NO_CLOCK: RequestClock = _NoClock()


class StepLog:
    """Every runner step under the stage clock, one JSON line each in DIR/steps-<pid>.ndjson
    (not .jsonl: the token records' readers take those), written as it ends: a diagnosis of
    where a turn's time goes (benchmarks/agent_session.py with MLXD_STAGE_TRACE). Its start,
    its milliseconds in the generator's call, in the rest of the step and in the hand-over to
    the tiers, the tokens it prefilled, the rows it decoded, the chunk it allowed, and the
    attention passes the CUDA router sent each way (`cuda_attention.COUNTS`)."""

    def __init__(self) -> None:
        import json
        import os

        from mlxd.protocol import stage_trace
        self._dumps = json.dumps
        self._path = os.path.join(stage_trace.DIR or ".", f"steps-{os.getpid()}.ndjson")
        self._f: Any = None

    def record(self, rec: dict[str, Any]) -> None:
        if self._f is None:  # (the directory is made by the first trace written)
            import os
            os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
            self._f = open(self._path, "a", buffering=1)
        self._f.write(self._dumps(rec) + "\n")


def step_log() -> StepLog | None:
    from mlxd.protocol import stage_trace
    return StepLog() if stage_trace.ON else None


def request_clock() -> RequestClock:
    """The clock for this process: stamping when the stage clock is on, else `NO_CLOCK`."""
    from mlxd.protocol import stage_trace
    return RequestClock() if stage_trace.ON else NO_CLOCK


def first_tokens_read(moved: int, moved_done: int) -> None:
    """A step's first tokens were read back early (the runner's `_send_first_tokens`): when the
    step ran no decode pass, they get the step's stamps from the generator call's start, the
    last tokens' pass (dispatched from `moved` to `moved_done`) and their read (now)."""
    global last_step
    if last_step is _last_call and "read_back" in last_step:
        return  # the step's decode pass stands for it, as for its other rows' tokens
    t = now()
    last_step = {"next_in": _last_call.get("next_in", moved), "graph_built": moved,
                 "dispatched": moved_done, "device_done": t, "read_back": t, "next_out": t}
    if keep_steps:
        steps.append(last_step)
