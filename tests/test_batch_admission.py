"""`--batch auto` wired into the engine (issue 14 item 1) and burst admission (item 3): the
runner holds back requests the KV budget has no room for and admits them in arrival order as
rows finish; an idle engine gathers a burst of arrivals into one prefill; the daemon measures
its budget at load and shows the cap and why in /stats and /metrics."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import mlx.core as mx
import openai
import pytest
from mlx_lm.sample_utils import greedy_sampler

from conftest import start_daemon, stop_and_check
from mlxd.engine.batch.budget import CEILING, Budget
from mlxd.engine.batch.messages import AbortRequest, AddRequest, RequestStarted, StepTokens
from mlxd.engine.batch.runner import Runner
from mlxd.engine.batch.sizing import FORCED, measure_budget
from mlxd.engine.load.loader import load_model
from mlxd.engine.stage_clock import NO_CLOCK, RequestClock
from mlxd.protocol.settings import TuningSettings
from support.runner_drive import turn

TINY_KV_PER_TOKEN = 2 * 2 * (16 + 16) * 4  # layers x kv heads x (k + v head dims) x float32


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("c"))
    return m, tok


def _drive(r: Runner, outq: queue.Queue, rids: set[str]) -> tuple[list[str], int, dict]:
    """Step until every request in `rids` finished: (finish order, most rows decoded in one
    step, request id -> tokens)."""
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    peak = 0
    while len(order) < len(rids):
        turn(r)
        while not outq.empty():
            item = outq.get()
            if isinstance(item, StepTokens):
                peak = max(peak, len(item.rows))
                for rid, tok, fin in item.rows:
                    tokens.setdefault(rid, []).append(tok)
                    if fin:
                        order.append(rid)
    return order, peak, tokens


def _add(rid: str, prompt: list[int], max_tokens: int) -> AddRequest:
    return AddRequest(rid, prompt, max_tokens, greedy_sampler, [])


def test_the_budget_holds_requests_back_in_order_and_admits_them_as_rows_finish(model):
    m, tok = model
    prompt = tok.encode("Once upon a time, in a lighthouse by the sea")
    need = len(prompt) + 12  # what each request reserves
    outq: queue.Queue = queue.Queue()
    # room for two rows of `need` tokens, not three
    budget = Budget(kv_bytes=int(2.5 * need), per_token=1, explicit_cap=None, why="test")
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq, budget=budget)
    for i in range(5):
        r.inbox.put(_add(f"r{i}", prompt, 12))
    r.take_commands()
    assert [a.request_id for a in r.gate.held] == ["r2", "r3", "r4"]
    assert (r.counters.waiting, r.counters.batch_cap) == (3, 2)
    assert "memory" in r.counters.batch_why and "test" in r.counters.batch_why
    order, peak, tokens = _drive(r, outq, {f"r{i}" for i in range(5)})
    assert peak == 2  # never more rows than the budget holds
    assert order == [f"r{i}" for i in range(5)]  # none passed an earlier one
    assert all(len(t) == 12 for t in tokens.values())
    assert (r.counters.waiting, r.gate.reserved_total, r.gate.reserved) == (0, 0, {})


def _room_for_one_of_three(model, prefix: str, clock: RequestClock = NO_CLOCK
                           ) -> tuple[Runner, queue.Queue]:
    """A runner whose budget holds one row, sent three requests: PREFIX0 runs, 1 and 2 wait."""
    m, tok = model
    prompt = tok.encode("Hello there, general")
    outq: queue.Queue = queue.Queue()
    budget = Budget(kv_bytes=len(prompt) + 8, per_token=1, explicit_cap=None, why="test")
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq, budget=budget,
               clock=clock)
    for i in range(3):
        r.inbox.put(_add(f"{prefix}{i}", prompt, 8))
    r.take_commands()
    return r, outq


def test_an_aborted_request_that_waits_leaves_the_queue(model):
    r, outq = _room_for_one_of_three(model, "a")
    assert [a.request_id for a in r.gate.held] == ["a1", "a2"]
    r.inbox.put(AbortRequest("a1"))
    r.take_commands()
    assert [a.request_id for a in r.gate.held] == ["a2"]
    order, _, _ = _drive(r, outq, {"a0", "a2"})
    assert order == ["a0", "a2"]


def test_the_stage_clock_forgets_a_request_aborted_before_it_was_inserted(model, tmp_path,
                                                                          monkeypatch):
    from mlxd.protocol import stage_trace
    stamps: dict = {}
    monkeypatch.setattr(stage_trace, "ON", True)
    monkeypatch.setattr(stage_trace, "DIR", str(tmp_path))
    monkeypatch.setattr(stage_trace, "_request_stamps", stamps)
    monkeypatch.setattr(stage_trace, "_request_files", {})
    r, outq = _room_for_one_of_three(model, "t", RequestClock())
    assert set(stamps) == {"t1", "t2"}  # t0 inserted: its record is written, t1 and t2 wait
    r.inbox.put(AbortRequest("t1"))
    r.take_commands()
    assert set(stamps) == {"t2"}
    _drive(r, outq, {"t0", "t2"})
    assert stamps == {}
    stage_trace.flush_requests()
    assert {t.request_id for t in stage_trace.read(tmp_path, requests=True)} == {"t0", "t2"}


def test_an_explicit_batch_caps_rows_whatever_the_memory(model):
    m, tok = model
    prompt = tok.encode("Tell me about the sea")
    outq: queue.Queue = queue.Queue()
    budget = Budget(kv_bytes=10**9, per_token=1, explicit_cap=3, why="test")
    r = Runner(m, [], batch_size=3, prefill_step=64, outbox=outq, budget=budget)
    for i in range(5):
        r.inbox.put(_add(f"e{i}", prompt, 6))
    r.take_commands()
    assert len(r.gate.held) == 2 and r.counters.batch_cap == 3
    assert r.counters.batch_why.startswith("--batch 3")
    _, peak, _ = _drive(r, outq, {f"e{i}" for i in range(5)})
    assert peak == 3


def test_a_burst_reaching_an_idle_engine_is_prefilled_as_one_batch(model, monkeypatch):
    """Requests arriving one after another while more are still being prepared (each only
    after the runner found its inbox quiet) land in one insert, so their first tokens come
    out of the same step."""
    m, tok = model
    tuning = TuningSettings(burst_window="3,2000")  # the test's CPU may be busy
    outq: queue.Queue = queue.Queue()
    adds = [_add(f"b{i}", tok.encode(f"Story number {i} begins"), 4) for i in range(4)]
    later = adds[1:]

    def preparing(submitted_by: float) -> int:
        """The admission lanes: one more request is delivered each time the runner looks."""
        if later:
            r.inbox.put(later.pop(0))
            return 1
        return 0

    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq, preparing=preparing,
               tuning=tuning)
    r.inbox.put(adds[0])
    r.take_commands()
    started = [x for x in list(outq.queue) if isinstance(x, RequestStarted)]
    assert len(started) == 4 and r.counters.bursts == 1
    first_rows = None
    while first_rows is None:
        r.step()
        steps = [x for x in list(outq.queue) if isinstance(x, StepTokens)]
        first_rows = steps[0].rows if steps else None
    assert len(first_rows) == 4  # every first token from one step: one prefill batch


def _commands_handled_within(r: Runner, seconds: float) -> bool:
    """Whether the runner's handling of its inbox (burst gathering included) returns in time."""
    done = threading.Event()

    def handle() -> None:
        r.take_commands()
        done.set()

    threading.Thread(target=handle, daemon=True).start()
    return done.wait(seconds)


def test_a_lone_request_is_not_held_for_the_window(model, monkeypatch):
    m, tok = model
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq,
               preparing=lambda submitted_by: 0, tuning=TuningSettings(burst_window="3,5000"))
    r.inbox.put(_add("solo", tok.encode("Hi"), 2))
    assert _commands_handled_within(r, 1.0)  # after the quiet gap, not the 5 s window
    assert len(r.rows) == 1


class SlowLanes:
    """Admission lanes that prepare requests more slowly than the burst window: each request
    has the time it reached the engine; each look of the runner hands one more over."""

    def __init__(self, inbox: queue.Queue, arrivals: list[tuple[float, AddRequest]]) -> None:
        self.inbox = inbox
        self.arrivals = arrivals

    def preparing(self, submitted_by: float) -> int:
        due = [a for a in self.arrivals if a[0] <= submitted_by]
        if due:
            self.arrivals.remove(due[0])
            self.inbox.put(due[0][1])  # handed over, no longer counted
        return len(due) - 1 if due else 0


def test_a_burst_still_being_prepared_when_the_window_closes_is_waited_for(model, monkeypatch):
    """Requests that reached the engine within the window join the burst even when their
    preparation ends after it; one that reached it after the window does not."""
    m, tok = model
    closed = TuningSettings(burst_window="3,0,30000")  # the window closed at once
    outq: queue.Queue = queue.Queue()
    now = time.monotonic()
    arrived = [(now, _add(f"w{i}", tok.encode(f"Story number {i} begins"), 2))
               for i in range(4)]
    late = (now + 3600, _add("late", tok.encode("A later story"), 2))
    lanes = SlowLanes(queue.Queue(), [*arrived, late])
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq,
               preparing=lanes.preparing, tuning=closed)
    lanes.inbox = r.inbox
    r.inbox.put(_add("first", tok.encode("The first story"), 2))
    r.take_commands()
    started = {x.request_id for x in list(outq.queue) if isinstance(x, RequestStarted)}
    assert started == {"first", "w0", "w1", "w2", "w3"} and r.counters.bursts == 1
    assert lanes.arrivals == [late]


def test_a_request_prepared_for_too_long_does_not_hold_the_burst(model, monkeypatch):
    m, tok = model
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq,
               preparing=lambda submitted_by: 1,  # a prompt that never finishes
               tuning=TuningSettings(burst_window="3,0,50"))
    r.inbox.put(_add("solo", tok.encode("Hi"), 2))
    assert _commands_handled_within(r, 5.0)
    assert len(r.rows) == 1


def test_the_budget_is_measured_from_the_model(model):
    m, _ = model
    b = measure_budget(m, "auto", mx.new_stream(mx.default_device()))
    assert b.per_token == TINY_KV_PER_TOKEN and b.explicit_cap is None
    assert b.why.startswith("RAM (") and b.kv_tokens > 1000
    assert measure_budget(m, 16, mx.default_stream(mx.default_device())).explicit_cap == 16


def test_a_daemon_with_little_memory_serves_what_fits_and_queues_the_rest(tiny_model):
    """Room for two rows at full context (256 tokens) beside the weights and the RAM prefix
    cache's 4 GiB: four streams are served two at a time, each with the text it gets alone;
    /stats and /metrics show the cap and why."""
    weights = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors"))
    memory = int((weights + 4 * 2**30 + 2.5 * 256 * TINY_KV_PER_TOKEN) / 0.9)
    d = start_daemon(tiny_model, "--prompt-cache", "4",
                     env={"MLXD_ENGINE_MEMORY": str(memory / 2**30)})
    try:
        d.wait_until(lambda s: s["engines"][0]["state"] == "ready", what="the engine ready")
        eng = d.stats()["engines"][0]
        assert eng["batch_cap"] == 2 and FORCED in eng["batch_why"], eng

        async def one(ac: openai.AsyncOpenAI, i: int) -> str:
            r = await ac.chat.completions.create(
                model="tiny-llama",  # the default max_tokens, clamped to the context: 256
                messages=[{"role": "user", "content": f"Request {i}: a story"}])
            return r.choices[0].message.content or ""

        async def all_of(n: int, together: bool) -> list[str]:
            ac = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
            try:
                if together:
                    return list(await asyncio.gather(*(one(ac, i) for i in range(n))))
                return [await one(ac, i) for i in range(n)]
            finally:
                await ac.close()

        together = asyncio.run(all_of(4, together=True))
        eng = d.stats()["engines"][0]
        assert eng["peak_batch"] == 2, eng  # the other two waited for rows to finish
        assert eng["waiting_requests"] == 0 and eng["active_requests"] == 0
        assert eng["batch_cap"] == 2 and eng["batch_why"].startswith("memory: ")
        alone = asyncio.run(all_of(4, together=False))
        assert together == alone and all(together)
        with d.http() as c:
            metrics = c.get("/metrics").text
        assert 'mlxd_engine_batch_cap{model="tiny-llama"} 2.0' in metrics
        assert 'mlxd_engine_waiting_requests{model="tiny-llama"} 0.0' in metrics
    finally:
        stop_and_check(d)
