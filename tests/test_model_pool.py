"""--isolate --model-pool 2 with three tiny models: on-demand loads, LRU eviction, busy engines
never evicted, keep_alive, unknown models, two models answering at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from conftest import start_daemon, stop_and_check

CHAT = [{"role": "user", "content": "hello"}]


def resident(d) -> set[str]:
    st = d.stats()
    ids = {r["engine_id"] for r in st["pool"]["resident"]}
    return {e["model"] for e in st["engines"] if e["engine_id"] in ids}


def ask(d, model, **kw):
    with d.http() as c:
        return c.post("/v1/chat/completions",
                      json={"model": str(model), "messages": CHAT, "max_tokens": 3, **kw})


@pytest.fixture
def pool(tiny_model, tiny_model_b, tiny_model_c):
    d = start_daemon(tiny_model, "--model-pool", "2", "--model-alias", f"bee={tiny_model_b}",
                     isolate=True)
    yield d
    stop_and_check(d)


def test_lru_on_demand_loading_and_eviction(pool, tiny_model_b, tiny_model_c):
    assert resident(pool) == {"tiny-llama"}
    r = ask(pool, "bee")  # by alias: loaded on demand
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny-llama-b"
    assert resident(pool) == {"tiny-llama", "tiny-llama-b"}
    assert ask(pool, "tiny-llama").status_code == 200  # now b is least recently used
    assert ask(pool, tiny_model_c).status_code == 200  # by path: evicts b
    assert resident(pool) == {"tiny-llama", "tiny-llama-c"}
    pool.wait_until(lambda s: not any(c["model"].endswith("tiny-llama-b") for c in s["children"]),
                    what="engine b stopped")
    models = {m["id"]: m["state"] for m in pool.http().get("/v1/models").json()["data"]}
    assert models["tiny-llama-b"] == "unloaded" and models["tiny-llama-c"] == "ready"
    assert ask(pool, "bee").status_code == 200  # reloads b, evicting a (LRU)
    assert resident(pool) == {"tiny-llama-b", "tiny-llama-c"}


def test_unknown_model_is_a_404_envelope(pool):
    r = ask(pool, "no-such-model")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_bad_input_for_an_unloaded_model_loads_nothing(pool, tiny_model_c):
    for bad in ({"max_tokens": -1}, {"temperature": 9}, {"n": 0}, {"keep_alive": "soon"}):
        r = ask(pool, tiny_model_c, **bad)
        assert r.status_code == 400, (bad, r.text)
    assert resident(pool) == {"tiny-llama"}
    assert not any(c["model"].endswith("tiny-llama-c") for c in pool.stats()["children"])


def test_keep_alive_zero_unloads_after_the_request(pool, tiny_model_c):
    assert ask(pool, tiny_model_c, keep_alive=0).status_code == 200
    assert resident(pool) == {"tiny-llama"}
    assert ask(pool, "tiny-llama", keep_alive="bogus").status_code == 400


def test_admin_load_and_unload(pool, tiny_model_c):
    with pool.unix_http() as c:  # /admin/* is served on the Unix socket
        r = c.post("/admin/models/load", json={"model": str(tiny_model_c)})
        assert r.status_code == 200 and r.json()["state"] == "ready"
        assert resident(pool) == {"tiny-llama", "tiny-llama-c"}
        assert c.post("/admin/models/unload", json={"model": "tiny-llama-c"}).status_code == 200
        assert resident(pool) == {"tiny-llama"}
        assert c.post("/admin/models/unload", json={"model": "tiny-llama-c"}).status_code == 409
        assert c.post("/admin/models/load", json={}).status_code == 400


def _stream(d, model, out, key):
    t = []
    with d.http() as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "model": str(model), "messages": CHAT, "max_tokens": 30, "stream": True}) as r:
            for line in r.iter_lines():
                if '"content": "' in line:
                    t.append(time.monotonic())
                if line == "data: [DONE]":
                    out[key] = (t[0], t[-1], True)
                    return
    out[key] = (t[0] if t else 0, t[-1] if t else 0, False)


def test_busy_engines_are_never_evicted_and_two_models_answer_at_once(
        tiny_model, tiny_model_b, tiny_model_c):
    d = start_daemon(tiny_model, "--model-pool", "2", isolate=True,
                     env={"MLXD_FAULTS": "engine.step=delay@1"})  # 50 ms steps: streams overlap
    try:
        assert ask(d, tiny_model_c).status_code == 200
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(d, m, out, k))
                   for k, m in (("a", tiny_model), ("c", tiny_model_c))]
        for t in threads:
            t.start()
        d.wait_until(lambda s: s["proxy"]["in_flight"] == 2, what="two streams running")
        r = ask(d, tiny_model_b)  # both resident engines are busy: waits for one to finish
        for t in threads:
            t.join()
        assert out["a"][2] and out["c"][2], out  # neither stream was cut by an eviction
        assert r.status_code == 200, r.text
        assert out["a"][0] < out["c"][1] and out["c"][0] < out["a"][1]  # they overlapped
        assert len(resident(d)) == 2 and "tiny-llama-b" in resident(d)
    finally:
        stop_and_check(d)


def test_full_pool_queue_answers_503_pool_busy(tiny_model, tiny_model_b):
    d = start_daemon(tiny_model, "--model-pool", "1", "--pool-wait", "1", isolate=True,
                     env={"MLXD_FAULTS": "engine.step=delay@1#0"})
    try:
        out: dict = {}
        t = threading.Thread(target=_stream, args=(d, tiny_model, out, "a"))
        t.start()
        d.wait_until(lambda s: s["proxy"]["in_flight"] == 1, what="a stream running")
        r = ask(d, tiny_model_b)
        t.join()
        assert r.status_code == 503 and r.json()["error"]["code"] == "pool_busy"
        assert r.headers["Retry-After"]
        assert out["a"][2]
    finally:
        stop_and_check(d)


def test_an_engine_that_never_exits_after_its_unload_is_killed(tiny_model, tiny_model_c):
    """--model-pool 1: asking for another model unloads the resident one, but its engine is
    stopped (SIGSTOP) and would never exit, keeping its memory (and its memory share, which
    halves the new engine's) for the daemon's life. It is killed once the grace a daemon stop
    gives an engine (--shutdown-timeout + 10 s) has passed. (The hang watchdog is off: only
    the unload's own deadline acts.)"""
    d = start_daemon(tiny_model, "--model-pool", "1", "--hang-timeout", "0",
                     "--shutdown-timeout", "1", isolate=True)
    try:
        stuck = psutil.Process(next(e for e in d.stats()["engines"]
                                    if e["model"] == "tiny-llama")["pid"])
        os.kill(stuck.pid, signal.SIGSTOP)
        r = ask(d, tiny_model_c)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-llama-c"
        d.wait_until(lambda s: not any(c["role"] == "engine" and c["pid"] == stuck.pid
                                       for c in s["children"]),
                     timeout=1 + 10 + 10, what="the unloaded engine gone")
        assert not stuck.is_running() or stuck.status() == psutil.STATUS_ZOMBIE
        assert any("did not stop" in line and "unload" in line for line in d.lines)
        assert resident(d) == {"tiny-llama-c"}
    finally:
        stop_and_check(d)
