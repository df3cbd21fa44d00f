"""The crash-loop breaker counts a loop, not every crash (issue 34): an engine SIGKILLed seven
times at random moments under four concurrent streams, serving tokens between deaths, is
restarted every time and never parked, and every stream ends with the text an unkilled greedy
run gives. (A model that dies at every load is still parked after five deaths:
tests/test_supervision.py, test_crash_loop_trips_the_breaker_and_admin_reset_clears_it.)"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from conftest import start_daemon
from conftest import stop_and_check as stop
from support.harness import stream_chat

PROMPTS = ["Tell me a long story about the sea and the lighthouse.",
           "Describe a walk through an old forest in autumn.",
           "Explain how a clock works, step by step.",
           "Write a letter to a friend who lives far away."]
KILLS = 10  # twice the five deaths that park a loop (the issue asks for ten)
STREAMS = 4


def body(i: int) -> dict:
    return {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 32,
            "temperature": 0}


def test_an_engine_killed_again_and_again_while_serving_is_never_parked(tiny_model):
    d = start_daemon(tiny_model, "--restart-backoff", "0.1", "--batch", "4", isolate=True)
    try:
        references = [stream_chat(d, body(i))[0] for i in range(STREAMS)]
        chunks = [0]  # content chunks received by every stream, together
        cond = threading.Condition()
        done = threading.Event()
        results: list[tuple[int, str, dict]] = []
        failures: list[BaseException] = []

        def counted(_n: int) -> None:
            with cond:
                chunks[0] += 1
                cond.notify_all()

        def streamer(i: int) -> None:
            try:
                while not done.is_set():  # a stream at a time, until the kills are over
                    text, usage = stream_chat(d, body(i), on_chunk=counted)
                    results.append((i, text, usage))
            except BaseException as e:  # noqa: BLE001  the main thread reports it
                failures.append(e)
                with cond:
                    cond.notify_all()

        threads = [threading.Thread(target=streamer, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        rng = random.Random(34)
        try:
            for epoch in range(KILLS):
                d.wait_until(lambda s, e=epoch: s["engines"][0]["state"] == "ready"
                             and s["engines"][0]["epoch"] == e, timeout=60,
                             what=f"the engine ready at epoch {epoch}")
                with cond:  # this life serves tokens before it dies
                    seen = chunks[0]

                    def served(seen: int = seen) -> bool:
                        return chunks[0] >= seen + 4 or bool(failures)

                    assert cond.wait_for(served, 60), "no tokens from the restarted engine"
                assert not failures, failures
                time.sleep(rng.uniform(0, 0.3))  # a random moment of this life
                engine = d.stats()["engines"][0]
                assert engine["epoch"] == epoch and engine["state"] == "ready", engine
                os.kill(engine["pid"], signal.SIGKILL)
        finally:
            done.set()
            for t in threads:
                t.join(120)
        assert not failures, failures
        assert not any(t.is_alive() for t in threads)
        wrong = [(i, text) for i, text, _ in results if text != references[i]]
        assert not wrong, wrong
        assert sum(u.get("resumes", 0) for _, _, u in results) >= KILLS
        assert len({i for i, _, _ in results}) == STREAMS
        stats = d.stats()
        child = next(c for c in stats["children"] if c["role"] == "engine")
        assert child["restarts"] == KILLS and child["state"] == "ready", child
        assert child["reason"] is None
        assert stats["proxy"]["resume"]["poison_rejections"] == 0
    finally:
        stop(d)
