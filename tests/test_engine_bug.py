"""An unexpected error in an engine (a bug, not a refused model) never leaves requests waiting:
with `--isolate` the engine process exits as a crash and is restarted (without it, the engine
thread's model fails with the reason: engine/service.py, `EngineService.run`; fault points are
armed only in child processes, so that path is not driven from here)."""

from __future__ import annotations

from conftest import start_daemon, stop_and_check

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def test_a_bug_at_load_crashes_an_isolated_engine_which_is_restarted(tiny_model):
    d = start_daemon(tiny_model, "--restart-backoff", "0.1", isolate=True,
                     env={"MLXD_FAULTS": "engine.load=bug#0"})  # the first epoch only
    try:
        d.wait_until(lambda s: any(c["role"] == "engine" and c["state"] == "ready"
                                   for c in s["children"]), what="the engine restarted")
        child = next(c for c in d.stats()["children"] if c["role"] == "engine")
        assert child["restarts"] == 1 and child["epoch"] == 1, child
        assert "RuntimeError: bug injected at engine.load" in d.log()
        with d.http() as c:
            r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
    finally:
        stop_and_check(d)
