"""Crash isolation under --isolate: real processes killed, hung and crash-looping."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from conftest import start_daemon
from conftest import stop_and_check as finish
from support.harness import LISTENING

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
FAST = ["--restart-backoff", "0.1"]
NO_RESUME = [*FAST, "--resume", "off"]  # the plain error behaviour (tests/test_resume.py: resume)


def engine(d, model="tiny-llama"):
    return next(e for e in d.stats()["engines"] if e["model"] == model)


def wait_engine_ready(d, epoch, model="tiny-llama", timeout=30):
    d.wait_until(lambda s: any(e["model"] == model and e["state"] == "ready"
                               and e["epoch"] == epoch for e in s["engines"]),
                 timeout, what=f"{model} ready at epoch {epoch}")


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False




@pytest.fixture
def iso(tiny_model):
    d = start_daemon(tiny_model, *NO_RESUME, isolate=True)
    yield d
    finish(d)


def test_kill_9_mid_stream_gives_in_band_error_then_engine_returns(iso):
    pid = engine(iso)["pid"]
    with iso.http() as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 3:
                    os.kill(pid, signal.SIGKILL)
    assert events[-1].startswith('data: {"error"'), events[-3:]
    assert "engine_crashed" in events[-1]
    assert not any(e == "data: [DONE]" for e in events)
    wait_engine_ready(iso, 1)
    child = next(c for c in iso.stats()["children"] if c["role"] == "engine")
    assert child["restarts"] == 1 and child["last_exit"] == "signal SIGKILL"
    with iso.http() as c:
        ok = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_kill_9_before_first_byte_gives_503_with_retry_after(tiny_model):
    import threading
    d = start_daemon(tiny_model, *NO_RESUME, isolate=True,
                     env={"MLXD_FAULTS": "engine.step=delay@1#0"})  # 50 ms steps: time to aim
    try:
        pid = engine(d)["pid"]

        def kill_once_running() -> None:
            d.wait_until(lambda s: s["proxy"]["in_flight"] == 1, what="request running")
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_running)
        killer.start()
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 200})
        killer.join()
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"]
        assert r.json()["error"]["code"] == "engine_crashed"
        wait_engine_ready(d, 1)
        with d.http() as c:  # epoch 1 has no delay fault
            assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}
                          ).status_code == 200
    finally:
        finish(d)


def test_proxy_killed_is_respawned_and_engines_keep_their_pids(iso):
    before = iso.stats()
    proxy_pid, engine_pid = before["proxy"]["pid"], before["engines"][0]["pid"]
    os.kill(proxy_pid, signal.SIGKILL)
    iso.wait_for_line(LISTENING, start=len(iso.lines))

    def respawned(s):
        return s["proxy"]["pid"] != proxy_pid and s["engines"][0]["state"] == "ready"
    iso.wait_until(respawned, what="a new proxy that sees the engine")
    after = iso.stats()
    assert after["engines"][0]["pid"] == engine_pid
    with iso.http() as c:
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200


def test_a_connection_made_while_the_proxy_is_dead_waits_for_the_next_one(iso):
    """The supervisor holds the listening sockets; each proxy inherits them. A client that
    connects after the proxy died and before its successor listens is queued by the kernel
    and answered by the successor, on TCP and on the Unix socket, instead of refused."""
    proxy = psutil.Process(iso.stats()["proxy"]["pid"])
    proxy.kill()
    proxy.wait(10)  # gone, its successor not yet started (--restart-backoff 0.1, then Python)
    body = {"messages": CHAT, "max_tokens": 3}
    with iso.http() as c:
        r = c.post("/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    with iso.unix_http() as c:
        assert c.post("/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert iso.stats()["proxy"]["pid"] != proxy.pid


def test_a_proxy_killed_again_and_again_is_never_parked(iso):
    """Six kills of the proxy within a minute: the crash-loop breaker would mark a model's
    engine failed for --crash-cooldown, but a parked proxy is a daemon that serves nobody. It
    is respawned after each (its backoff grows), and the engine keeps its model throughout."""
    engine_pid = iso.stats()["engines"][0]["pid"]
    for _ in range(6):
        proxy_pid = iso.stats()["proxy"]["pid"]
        os.kill(proxy_pid, signal.SIGKILL)
        iso.wait_for_line(LISTENING, start=len(iso.lines), timeout=60)
        iso.wait_until(lambda s, old=proxy_pid: s["proxy"]["pid"] != old
                       and s["engines"][0]["state"] == "ready", what="a respawned proxy")
    stats = iso.stats()
    proxy = next(c for c in stats["children"] if c["role"] == "proxy")
    assert proxy["restarts"] == 6 and proxy["state"] == "ready"
    assert stats["engines"][0]["pid"] == engine_pid
    with iso.http() as c:
        assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3}
                      ).status_code == 200


def test_model_that_cannot_load_is_failed_with_reason_and_not_retried(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    d = start_daemon(bad, *FAST, isolate=True, ready_marker="failed")
    try:
        d.wait_until(lambda s: any(c["role"] == "engine" and c["state"] == "failed"
                                   for c in s["children"]), what="the engine child failed")
        st = d.stats()
        child = next(c for c in st["children"] if c["role"] == "engine")
        assert child["restarts"] == 0 and child["last_exit"] == "code 78"
        assert "config.json" in st["engines"][0]["error"]
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": CHAT})
            models = c.get("/v1/models").json()["data"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed"
        assert "config.json" in r.json()["error"]["message"]
        assert models[0]["state"] == "failed"
    finally:
        finish(d)


def test_crash_loop_trips_the_breaker_and_admin_reset_clears_it(tiny_model):
    d = start_daemon(tiny_model, *FAST, isolate=True, ready_marker="listening",
                     env={"MLXD_FAULTS": "engine.load=exit#<5"})
    try:
        d.wait_until(lambda s: s["engines"][0]["state"] == "failed", timeout=60,
                     what="the crash-loop breaker")
        child = next(c for c in d.stats()["children"] if c["role"] == "engine")
        assert child["restarts"] == 4 and "crashed 5 times" in child["reason"]
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": CHAT})
            assert r.status_code == 503 and "crashed 5 times" in r.json()["error"]["message"]
            with d.unix_http() as u:
                assert u.post("/admin/models/reset", json={"model": "tiny-llama"}
                              ).status_code == 200
        wait_engine_ready(d, 5)
        with d.http() as c:
            assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}
                          ).status_code == 200
    finally:
        finish(d)


def test_hung_engine_is_killed_and_restarted_within_hang_timeout(tiny_model):
    d = start_daemon(tiny_model, *NO_RESUME, "--hang-timeout", "2", isolate=True,
                     env={"MLXD_FAULTS": "engine.step=hang@5#0"})
    try:
        t0 = time.monotonic()
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 50})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_crashed"
        wait_engine_ready(d, 1)
        assert time.monotonic() - t0 < 2 + 3 + 15  # timeout + SIGKILL grace + respawn
        assert any("Thread" in line and "most recent call first" in line for line in d.lines), \
            "no faulthandler stack dump in the log"
        with d.http() as c:
            assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 60}
                          ).status_code == 200
    finally:
        finish(d)


def test_an_engine_stopped_while_it_loads_is_replaced_and_the_waiting_request_completes(
        tiny_model):
    """SIGSTOP reaches a restarted engine before it is ready (it sends no Ready, and a load
    may be silent for minutes, so heartbeats do not judge it). The watchdog still sees a
    process that stays stopped, kills it, and a request that waited for the engine gets its
    answer instead of waiting out --load-wait. (Epoch 1's load is held at its start by a fault,
    so the stop surely lands before it is ready.)"""
    d = start_daemon(tiny_model, *FAST, "--hang-timeout", "2", isolate=True,
                     env={"MLXD_FAULTS": "engine.load=hang#1"})
    try:
        body = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
        with d.http() as c:
            reference = c.post("/v1/chat/completions", json=body).json()
        os.kill(engine(d)["pid"], signal.SIGKILL)
        d.wait_until(lambda s: s["engines"][0]["epoch"] == 1 and s["engines"][0]["pid"],
                     what="the engine's next epoch to be spawned")
        starting = engine(d)
        os.kill(starting["pid"], signal.SIGSTOP)
        t0 = time.monotonic()
        with d.http() as c:
            r = c.post("/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == reference["choices"][0]["message"]
        assert time.monotonic() - t0 < 2 + 3 + 20  # timeout + SIGKILL grace + respawn
        after = engine(d)
        assert after["epoch"] == 2 and after["pid"] != starting["pid"]
        assert any("stopped for" in line and "while starting" in line for line in d.lines)
    finally:
        finish(d)


def test_a_flush_waiting_on_an_engine_that_hangs_ends_when_it_is_replaced(tiny_model):
    """The engine is stopped (SIGSTOP) before the flush reaches it: no answer will come. The
    flush answers 503 `engine_restarted` once the watchdog replaced it, not after its own
    120 s timeout; a flush of the new engine is durable."""
    d = start_daemon(tiny_model, *NO_RESUME, "--hang-timeout", "2", isolate=True)
    try:
        with d.http() as c:
            assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}
                          ).status_code == 200
        pid = engine(d)["pid"]
        os.kill(pid, signal.SIGSTOP)
        with d.unix_http() as c:
            r = c.post("/admin/cache/flush", timeout=60)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"]
        body = r.json()
        assert body["durable"] is False
        assert [e["error_code"] for e in body["engines"]] == ["engine_restarted"], body
        wait_engine_ready(d, 1)
        with d.unix_http() as c:
            r = c.post("/admin/cache/flush", timeout=60)
        assert r.status_code == 200 and r.json()["durable"] is True, r.text
    finally:
        finish(d)


def test_supervisor_sigkill_children_follow_and_next_start_cleans_up(tiny_model):
    d = start_daemon(tiny_model, isolate=True)
    run_dir = d.run_dir
    try:
        kids = psutil.Process(d.proc.pid).children(recursive=True)
        assert len(kids) == 3  # proxy, engine, storage worker
        os.kill(d.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        alive = kids
        while alive and time.monotonic() - t0 < 2.0:
            _, alive = psutil.wait_procs(alive, timeout=0.1)
            alive = [p for p in alive if _running(p)]  # an unreaped zombie has exited
        assert not alive, f"children outlived the supervisor by 2 s: {alive}"
        assert (run_dir / "ctl.sock").exists()  # the dead daemon's leftovers
        d.proc.wait()
        d2 = start_daemon(tiny_model, isolate=True, run_dir=run_dir)
        try:
            with d2.http() as c:
                assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}
                              ).status_code == 200
        finally:
            finish(d2)
    finally:
        d.cleanup()
