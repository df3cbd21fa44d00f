"""Transparent resume: a client whose engine is killed mid-request receives exactly the text it
would have received without the kill (greedy and seeded sampling), with a pause instead of an
error; generation checkpoints save the recompute; a request that keeps killing engines is
failed as poison; after a full restart a repeated request skips prefill."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from support.harness import engine_pid, stream_chat

CHAT = [{"role": "user", "content": "Tell me a long story about the sea and the lighthouse."}]
SLOW = {"MLXD_FAULTS": "engine.step=delay@1#<2"}  # 50 ms steps in epochs 0 and 1: time to aim


def serve(model, *extra, env=SLOW):
    return start_daemon(model, "--restart-backoff", "0.1", "--block-tokens", "16", *extra,
                        isolate=True, env=env)








@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_streaming_resume_gives_identical_text(tiny_model, sampling):
    body = {"messages": CHAT, "max_tokens": 40, **sampling}
    d = serve(tiny_model)
    try:
        reference, ref_usage = stream_chat(d, body)
        text, usage = stream_chat(d, body, kill_after=10)
        assert text == reference
        assert usage["completion_tokens"] == ref_usage["completion_tokens"] == 40
        assert usage["resumes"] == 1 and usage["recovered_tokens"] >= 9
        assert d.stats()["proxy"]["resume"]["resumes"] == 1
    finally:
        stop(d)


def test_kills_at_several_points_including_twice_for_different_requests(tiny_model):
    body = {"messages": CHAT, "max_tokens": 40}
    d = serve(tiny_model, env={"MLXD_FAULTS": "engine.step=delay@1#<4"})
    try:
        reference, _ = stream_chat(d, body)
        near_end, _ = stream_chat(d, body, kill_after=38)
        assert near_end == reference
        early, _ = stream_chat(d, body, kill_after=1)
        assert early == reference
    finally:
        stop(d)


def test_non_streaming_request_resumes_too(tiny_model):
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0.8, "seed": 3}
    d = serve(tiny_model)
    try:
        with d.http() as c:
            reference = c.post("/v1/chat/completions", json=body).json()
        pid = engine_pid(d)

        def kill_once_running() -> None:
            d.wait_until(lambda s: s["engines"][0]["active_requests"] == 1
                         or s["proxy"]["in_flight"] == 1, what="request running")
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_running)
        killer.start()
        with d.http() as c:
            r = c.post("/v1/chat/completions", json=body)
        killer.join()
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["message"]["content"] == \
            reference["choices"][0]["message"]["content"]
        assert got["usage"]["resumes"] == 1
    finally:
        stop(d)


def test_generation_checkpoints_save_the_recompute(tiny_model):
    body = {"messages": [{"role": "user", "content": "A story about the harbour at night."}],
            "max_tokens": 60}
    results = {}
    for label, extra in (("off", []), ("every16", ["--generation-checkpoint", "16"])):
        d = serve(tiny_model, *extra)
        try:
            _, usage = stream_chat(d, body, kill_after=30)
            assert usage["resumes"] == 1
            results[label] = d.stats()["proxy"]["resume"]["recomputed_tokens"]
        finally:
            stop(d)
    # without checkpoints the new engine recomputes the prompt and all >= 30 delivered tokens;
    # with one every 16 tokens at most the tokens since the last checkpoint (< 16), plus what
    # the kill raced with, are recomputed
    assert results["off"] >= 30 + 10
    assert results["every16"] <= 16 + 2


def test_poison_request_is_failed_with_a_typed_error(tiny_model):
    d = serve(tiny_model, env={"MLXD_FAULTS": "engine.poison=exit"})
    try:
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": [
                {"role": "user", "content": "MLXD_POISON please"}], "max_tokens": 5})
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_poisoned"
        assert d.stats()["proxy"]["resume"]["poison_rejections"] == 1
        d.wait_until(lambda s: s["engines"][0]["state"] == "ready", what="engine back")
        with d.http() as c:  # and the engine serves everyone else
            assert c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3}
                          ).status_code == 200
    finally:
        stop(d)


def test_after_a_full_restart_a_checkpointed_request_skips_prefill(tiny_model, tmp_path):
    body = {"messages": CHAT, "max_tokens": 40}
    ssd = tmp_path / "kv"
    d = serve(tiny_model, "--ssd-cache", str(ssd), "--generation-checkpoint", "16", env={})
    try:
        first, _ = stream_chat(d, body)
    finally:
        stop(d)
    d = serve(tiny_model, "--ssd-cache", str(ssd), env={})
    try:
        again, usage = stream_chat(d, body)
        assert again == first
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
    finally:
        stop(d)
