"""Admission lanes (engine/admission_lanes.py) and /health's verdict (proxy/health.py): pure
logic and real threads, no processes."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from mlxd.engine.admit.lanes import LARGE_PROMPT_CHARS, AdmissionLanes
from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.protocol.messages import Delta, Generate, SamplingParams
from mlxd.proxy.health import verdict


def gen(rid: str, chars: int = 10) -> Generate:
    return Generate(rid, SamplingParams(), messages=[{"role": "user", "content": "x" * chars}])


class Recorder:
    """prepare() blocks on a per-request gate; deliver/dropped record what happened."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self.events: queue.Queue[tuple[str, str]] = queue.Queue()

    def gate(self, rid: str) -> threading.Event:
        self.started.setdefault(rid, threading.Event())
        return self.gates.setdefault(rid, threading.Event())

    def prepare(self, msg: Generate) -> Answered:
        self.started.setdefault(msg.request_id, threading.Event()).set()
        gate = self.gates.get(msg.request_id)
        if gate is not None:
            assert gate.wait(10)
        return Answered([Delta(msg.request_id)])

    def deliver(self, result: Admitted | Answered) -> None:
        assert isinstance(result, Answered)  # prepare() answers every request itself
        self.events.put(("delivered", result.deltas[0].request_id))

    def dropped(self, msg: Generate) -> None:
        self.events.put(("dropped", msg.request_id))

    def next(self) -> tuple[str, str]:
        return self.events.get(timeout=10)


@pytest.fixture
def lanes():
    r = Recorder()
    lanes = AdmissionLanes(r.prepare, r.deliver, r.dropped, small_threads=1)
    yield lanes, r
    for g in r.gates.values():
        g.set()
    lanes.stop()


def test_a_large_prompt_never_holds_up_a_small_one(lanes):
    """Not on its lane, nor in a burst: the runner's burst admission is not told to wait
    for it."""
    lanes, r = lanes
    gate = r.gate("big")
    lanes.submit(gen("big", LARGE_PROMPT_CHARS + 1))
    assert r.started["big"].wait(10)
    assert lanes.preparing() == 0
    lanes.submit(gen("small"))
    assert r.next() == ("delivered", "small")
    gate.set()
    assert r.next() == ("delivered", "big")


def test_a_request_cancelled_while_prepared_is_dropped_never_delivered(lanes):
    lanes, r = lanes
    gate = r.gate("a")
    lanes.submit(gen("a"))
    assert r.started["a"].wait(10)
    lanes.cancel(["a"])
    gate.set()
    assert r.next() == ("dropped", "a")
    lanes.submit(gen("b"))
    assert r.next() == ("delivered", "b")


def test_cancel_all_drops_waiting_and_running_requests_only(lanes):
    lanes, r = lanes
    gate = r.gate("first")
    lanes.submit(gen("first"))
    assert r.started["first"].wait(10)
    lanes.submit(gen("queued"))  # waits behind "first" on the small lane
    lanes.cancel(["*"])
    gate.set()
    assert {r.next(), r.next()} == {("dropped", "first"), ("dropped", "queued")}
    lanes.cancel(["unknown"])  # nothing pending: nothing to drop later
    lanes.submit(gen("later"))
    assert r.next() == ("delivered", "later")


def test_a_burst_is_prepared_side_by_side_and_counted_by_arrival():
    """With two threads on the small lane, a small request being prepared does not hold up
    the next; `preparing(t)` counts the requests that reached the engine by t."""
    r = Recorder()
    lanes = AdmissionLanes(r.prepare, r.deliver, r.dropped, small_threads=2)
    try:
        gate = r.gate("a")
        lanes.submit(gen("a"))
        assert r.started["a"].wait(10)
        between = time.monotonic()
        gate_b = r.gate("b")
        lanes.submit(gen("b"))
        assert r.started["b"].wait(10)  # beside "a", not after it
        assert lanes.preparing(between) == 1 and lanes.preparing() == 2
        gate_b.set()
        assert r.next() == ("delivered", "b")
        assert lanes.preparing() == 1
        gate.set()
        assert r.next() == ("delivered", "a")
        assert lanes.preparing() == 0
    finally:
        for g in r.gates.values():
            g.set()
        lanes.stop()


@pytest.mark.parametrize("models,draining,ssd,expected", [
    ({}, False, None, ("ok", 200)),  # nothing resident: a request loads a model
    ({"a": "ready", "b": "ready"}, False, None, ("ok", 200)),
    ({"a": "loading"}, False, None, ("loading", 503)),
    ({"a": "ready", "b": "starting"}, False, None, ("ok", 200)),
    ({"a": "ready", "b": "backoff"}, False, None, ("degraded", 200)),
    ({"a": "failed"}, False, None, ("degraded", 503)),
    ({"a": "unresponsive"}, False, None, ("degraded", 503)),
    ({"a": "ready"}, False, "a: SSD tier degraded: disk_full", ("degraded", 200)),
    ({"a": "ready"}, True, None, ("draining", 503)),
])
def test_health_verdict(models, draining, ssd, expected):
    assert verdict(models, draining, ssd) == expected


def test_stop_waits_for_the_lane_threads_to_end():
    """A lane thread that ran MLX work (a vision tower) must not outlive the engine's stop
    into the interpreter's exit, where its teardown raced MLX's and aborted the process; one
    still preparing a request is waited for (within the stop's bound)."""
    rec = Recorder()
    lanes = AdmissionLanes(rec.prepare, rec.deliver, rec.dropped, small_threads=2)
    gate = rec.gate("slow")
    lanes.submit(gen("slow", LARGE_PROMPT_CHARS + 1))
    assert rec.started["slow"].wait(10)
    threading.Timer(0.3, gate.set).start()  # the prepare ends while stop() waits
    lanes.stop()
    assert len(lanes._running) == 3 and not any(t.is_alive() for t in lanes._running)
    assert rec.next() == ("delivered", "slow")
