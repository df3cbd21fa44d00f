"""The per-token stage clock (MLXD_STAGE_TRACE) and the deferred step hand-off it measured:
with the clock on, every delivered token carries every stage's stamp, in order, from the MLX
thread to the SSE write; off (the default) nothing is installed; a step's tokens reach the
output thread when the MLX thread next waits on MLX or goes idle, never later."""

from __future__ import annotations

import json
import queue
import threading

from conftest import start_daemon, stop_and_check
from mlxd.engine.batch.handoff import ReleasingInbox, StepOutbox
from mlxd.engine.batch.messages import RequestStarted, StepTokens
from mlxd.protocol import stage_trace
from mlxd.protocol.stage_trace import ENGINE_STAGES, PROXY_STAGES, REQUEST_STAGES, read
from support.harness import stream_chat


def test_every_token_is_stamped_at_every_stage_in_order(tiny_model, tmp_path):
    trace = tmp_path / "trace"
    d = start_daemon(tiny_model, "--ssd-cache", "off", "--speculative", "off", isolate=True,
                     env={"MLXD_STAGE_TRACE": str(trace)})
    try:
        text, usage = stream_chat(d, {"messages": [{"role": "user", "content": "Hello"}],
                                      "max_tokens": 12, "temperature": 0})
    finally:
        stop_and_check(d)  # every process has written its records once it has exited
    n = usage["completion_tokens"]
    assert n > 0
    records = read(trace)
    engine = {r.index: r for r in records if "next_in" in r.stamps}
    proxy = {r.index: r for r in records if "received" in r.stamps}
    assert sorted(engine) == list(range(1, n + 1)), sorted(engine)
    assert sorted(proxy) == list(range(1, n + 1)), sorted(proxy)
    rid = {r.request_id for r in records}
    assert len(rid) == 1
    for i in range(1, n + 1):
        e, p = engine[i].stamps, proxy[i].stamps
        assert list(e) == list(ENGINE_STAGES), (i, list(e))
        assert list(p) == list(PROXY_STAGES), (i, list(p))
        times = [e[s] for s in ENGINE_STAGES]
        assert times == sorted(times), (i, e)
        times = [p[s] for s in PROXY_STAGES]
        assert times == sorted(times), (i, p)
        # one clock for both processes: the proxy receives what the engine had encoded
        assert e["encoded"] <= p["received"], (i, e, p)
        if i > 1:  # each token's step starts after the previous token's step
            assert engine[i - 1].stamps["next_in"] < e["next_in"]
    assert proxy[n].chars == len(text)  # how a client's chunks are joined to tokens
    # the request's way to its first step: one record per process, every stage in order,
    # all before its first token's step
    reqs = [r for r in read(trace, requests=True) if r.request_id in rid]  # (not warm-up's)
    assert len(reqs) == 2, reqs
    stamps = {k: v for r in reqs for k, v in r.stamps.items()}
    assert list(sorted(stamps, key=stamps.__getitem__)) == list(REQUEST_STAGES), stamps
    assert stamps["inserted"] < engine[1].stamps["next_in"]
    # the step log: every runner step, the prompt's prefill among them (its tokens, its time)
    steps = [json.loads(line) for f in trace.glob("steps-*.ndjson")
             for line in f.read_text().splitlines()]
    assert sum(1 for st in steps if st["t"] >= stamps["inserted"]) >= n, steps
    assert sum(st["pre"] for st in steps if st["t"] >= stamps["inserted"]) == \
        usage["prompt_tokens"] - 1, steps  # all but the last prompt token (it decodes)
    assert all(st["gen_ms"] >= st["next_ms"] > 0 for st in steps), steps


def test_the_clock_is_off_by_default():
    assert not stage_trace.ON  # the suite runs without MLXD_STAGE_TRACE
    import importlib
    g = importlib.import_module("mlx_lm.generate")
    assert g.BatchGenerator.next.__name__ == "next"  # mlx-lm's, unwrapped
    box = StepOutbox(eager=True)
    step = StepTokens([("r", 1, None)])
    box.put(step)
    assert box.get_nowait() is step and not hasattr(step, "trace")


def test_a_step_is_held_until_the_mlx_thread_waits_or_goes_idle():
    box = StepOutbox(eager=False)
    try:
        first = StepTokens([("r", 1, None)])
        box.put(first)  # this thread put the first step: it is the MLX thread
        assert box.empty()  # held: the output thread is not woken yet
        box.release()  # the next step's mx.async_eval / mx.eval
        assert box.get_nowait() is first

        second, third = StepTokens([("r", 2, None)]), StepTokens([("r", 3, None)])
        box.put(second)
        box.put(third)
        box.put("removed")  # anything else from the MLX thread: what it holds goes first
        assert [box.get_nowait() for _ in range(3)] == [second, third, "removed"]

        started = RequestStarted("s", 0, "none")
        box.put(StepTokens([("r", 4, None)]))
        box.put(started)  # an admission loop's: held too, no wake-up per request
        assert box.empty()
        first_of_s = StepTokens([("r", 5, None), ("s", 9, None)])
        box.put(first_of_s)  # a row's first token goes at once, after what was held
        assert [box.get_nowait() for _ in range(3)][1:] == [started, first_of_s]
        again = RequestStarted("t", 0, "none")
        box.put(again)
        box.release()  # the step's mx.async_eval: the output thread learns of it then
        assert box.get_nowait() is again
        box.put(StepTokens([("s", 10, None)]))
        assert box.empty()  # s is no longer fresh
        last = StepTokens([("s", 11, "length")])
        box.put(last)  # a row's end goes at once, after what was held
        assert [box.get_nowait().rows for _ in range(2)] == [[("s", 10, None)], last.rows]

        other: list[int] = []

        def admission_lane() -> None:
            box.put("admitted")
            other.append(box.qsize())

        t = threading.Thread(target=admission_lane)
        box.put(StepTokens([("r", 4, None)]))
        t.start()
        t.join()
        assert other == [1]  # another thread's item goes at once; the step stays held
        assert box.get_nowait() == "admitted"

        inbox = ReleasingInbox(box)
        try:
            inbox.get(timeout=0.01)  # the runner idles on its inbox: nothing may stay held
        except queue.Empty:
            pass
        assert box.get_nowait().rows == [("r", 4, None)]
        box.put(StepTokens([("r", 5, None)]))
        try:
            inbox.get_nowait()  # no command: the next step follows, its MLX call releases
        except queue.Empty:
            pass
        assert box.empty()
        inbox.put("embed")
        assert inbox.get_nowait() == "embed"  # work before the next step: released first
        assert box.get_nowait().rows == [("r", 5, None)]
    finally:
        box.close()


def test_mlx_calls_of_the_generator_release_held_steps():
    from mlxd.engine.batch import handoff as step_handoff
    step_handoff.install()  # (idempotent; the engine installs it the same way)
    import importlib

    import mlx.core as mx
    g = importlib.import_module("mlx_lm.generate")
    box = StepOutbox(eager=False)
    try:
        step = StepTokens([("r", 1, None)])
        box.put(step)
        assert box.empty()
        g.mx.async_eval(mx.array([1]))  # what GenerationBatch._step calls first
        assert box.get_nowait() is step
        box.put(StepTokens([("r", 2, None)]))
        g.mx.eval(mx.array([1]))  # prompt processing's wait
        assert box.get_nowait().rows == [("r", 2, None)]
    finally:
        box.close()
