"""The storage worker at a stop it did not expect (issue 34, item 6): SIGTERM to the daemon's
whole process group (a terminal's Ctrl-\\ or `kill -- -PGID`, a service manager's group kill)
reaches the storage worker while the engines are still flushing through it; it serves them
until they are done, so the flush completes and a restarted daemon serves every prompt from the
SSD tier."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop

BLOCK = 16
# 50 ms per block written: the burst's writes are still queued when the signal comes
SLOW_DISK = {"MLXD_FAULTS": "storage.write=delay"}
PROMPTS = [f"Question {i}: tell me about the sea, the wind, the lighthouse and its keeper."
           for i in range(6)]


def chat(d, user: str) -> dict:
    with d.http() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": user}], "max_tokens": 24,
            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def serve(model, ssd: Path, isolate: bool, **kw):
    return start_daemon(model, "--ssd-cache", str(ssd), "--block-tokens", str(BLOCK),
                        isolate=isolate, **kw)


@pytest.mark.parametrize("isolate", [True, False], ids=["isolate", "inprocess"])
def test_sigterm_to_the_process_group_flushes_the_write_queue(tiny_model, tmp_path, isolate):
    ssd = tmp_path / "kv"
    d = serve(tiny_model, ssd, isolate, new_session=True, env=SLOW_DISK)
    try:
        for p in PROMPTS:  # the burst: each answer queues its blocks behind it
            chat(d, p)
        d.record_descendants()
        os.killpg(d.proc.pid, signal.SIGTERM)  # every process at once, the storage worker too
        assert d.proc.wait(60) == 0, d.log()
        log = "\n".join(d.lines)
        assert "not durable" not in log, d.log()
        assert "SIGTERM: serving 1 connected engines' writes" in log, d.log()
        assert "BufferError" not in log and "Traceback" not in log, d.log()
        stop(d)  # exited already: reaps and checks that nothing is left
    finally:
        d.cleanup()
    d2 = serve(tiny_model, ssd, isolate)
    try:
        for p in PROMPTS:  # every prompt's blocks reached the disk: all but the fed token
            usage = chat(d2, p)["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == \
                usage["prompt_tokens"] - 1, (p, usage)
    finally:
        stop(d2)
