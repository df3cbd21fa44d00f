"""Driving an engine `Runner` on the test's own thread, without the engine's other threads."""

from __future__ import annotations

import queue
from typing import Any

from mlxd.engine.batch.messages import AddRequest, RequestStarted, StepTokens
from mlxd.engine.batch.runner import Runner


def turn(runner: Runner) -> None:
    """One turn of the runner's loop: commands, a step if rows run, held requests admitted
    once rows finished (what `Runner.run` does between steps)."""
    runner.take_commands()
    runner.turn_tail()


def run_one(runner: Runner, outq: queue.Queue, add: AddRequest
            ) -> tuple[list[int], RequestStarted]:
    """Admit `add`, step until it finishes; its tokens and its `RequestStarted`."""
    runner.inbox.put(add)
    runner.take_commands()
    tokens: list[int] = []
    started: Any = None
    while True:
        runner.step()
        while not outq.empty():
            item = outq.get()
            if isinstance(item, RequestStarted):
                started = item
            if isinstance(item, StepTokens):
                for _rid, tok, fin in item.rows:
                    tokens.append(tok)
                    if fin:
                        assert isinstance(started, RequestStarted)  # sent before any token
                        return tokens, started


def run_together(runner: Runner, outq: queue.Queue, adds: list[AddRequest],
                 finishes: dict[str, str] | None = None
                 ) -> tuple[dict[str, list[int]], dict[str, RequestStarted]]:
    """Admit `adds` in one turn (as a burst reaches the runner), step until all finish; each
    request's tokens and its `RequestStarted`, by request id (and into `finishes`, when
    given, each request's finish reason)."""
    for add in adds:
        runner.inbox.put(add)
    runner.take_commands()
    tokens: dict[str, list[int]] = {a.request_id: [] for a in adds}
    started: dict[str, RequestStarted] = {}
    done: set[str] = set()
    while len(done) < len(adds):
        runner.step()
        while not outq.empty():
            item = outq.get()
            if isinstance(item, RequestStarted):
                started[item.request_id] = item
            elif isinstance(item, StepTokens):
                for rid, tok, fin in item.rows:
                    tokens[rid].append(tok)
                    if fin:
                        done.add(rid)
                        if finishes is not None:
                            finishes[rid] = fin
    return tokens, started


class LogprobsRecorder(queue.Queue):
    """A runner's outbox that keeps every step's log-probabilities (`StepTokens.logprobs`) as
    they are put, in `logprobs`."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[dict] = []

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, StepTokens) and item.logprobs:
            self.logprobs.append(item.logprobs)
        super().put(item, block, timeout)
