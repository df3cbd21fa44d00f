"""Every model family with state beyond plain KV cached, through real `--isolate` daemons:
sliding windows (gemma3_text, gpt_oss), gated-delta and convolution hybrids (qwen3_next,
qwen3_5 in its multimodal checkpoint's config, lfm2)
and a pure recurrent model (mamba2), each a tiny random-weight model directory (plain KV, the
llama family, is what test_ssd_tier.py, test_resume.py and test_runner_cache.py run).

For each: the same prompt twice and a conversation extended after the model's answer hit the
RAM tier; a prompt differing in one middle token never reuses a state past the difference;
after flush, stop and a new start the SSD tier gives the same hits; a kill -9 mid-stream
resumes with the same text and the new engine prefills less than the context. The text is
always compared with a daemon whose every cache is off. Prompts are token ids (longer than the
16-token windows, so the rings have wrapped)."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mlx_lm.sample_utils import greedy_sampler

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.cli.client import format_status
from support.harness import Daemon
from support.random_model import write_random_model

FAMILIES = ["gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5", "lfm2", "mamba2"]
BLOCK = 16
ANSWER = 12


def complete(d: Daemon, prompt: list[int], max_tokens: int = ANSWER) -> dict:
    with d.http() as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"], "prompt": out["usage"]["prompt_tokens"],
            "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"]}


def stream_with_kill(d: Daemon, prompt: list[int], max_tokens: int, kill_after: int,
                     persisted: Callable[[], bool]) -> str:
    """A streamed completion during which the engine is killed (SIGKILL) after `kill_after`
    chunks, once `persisted()` says the SSD tier holds what the prompt left (its writes are
    behind the stream: a kill may beat them, and then there is nothing to resume from); the
    text the client saw."""
    out: list[str] = []
    killed = False
    with d.http() as c, c.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for ch in obj.get("choices") or []:
                if ch.get("text"):
                    out.append(ch["text"])
                    if not killed and len(out) >= kill_after:
                        deadline = time.monotonic() + 20
                        while not persisted():
                            assert time.monotonic() < deadline, "the prompt never reached SSD"
                            time.sleep(0.02)  # files on disk: no event to await
                        os.kill(d.stats()["engines"][0]["pid"], signal.SIGKILL)
                        killed = True
    assert killed
    return "".join(out)


def first_answer_tokens(model_dir: Path, prompt: list[int]) -> list[int]:
    """The greedy answer's token ids (the API answers text): the engine's runner, in this
    process, with no cache."""
    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from support.runner_drive import run_one
    model, _, _ = load_model(str(model_dir), model_dir.parent / "cache")
    outq: queue.Queue = queue.Queue()
    r = Runner(model, [], batch_size=2, prefill_step=512, outbox=outq, cache_bytes=0)
    return run_one(r, outq, AddRequest("x", prompt, ANSWER, greedy_sampler, []))[0]


def both(*makers):
    """Start daemons side by side (each start waits for its model to load)."""
    out: list = [None] * len(makers)
    errors: list[BaseException] = []

    def run(i, make):
        try:
            out[i] = make()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(makers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for d in out:
            if d is not None:
                stop(d)
        raise errors[0]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_hits_both_tiers_and_resumes_with_the_text_of_no_cache(family, tmp_path):
    model = write_random_model(tmp_path / family, family=family, context=2048)
    ssd = tmp_path / "kv"
    rng = random.Random(7)
    prompt = [rng.randrange(5, 300) for _ in range(120)]
    turn = [rng.randrange(5, 300) for _ in range(20)]
    mid = list(prompt)
    mid[60] = mid[60] % 250 + 7  # one token in the middle differs
    answer = first_answer_tokens(model, prompt)
    extended = prompt + answer + turn
    longer = [rng.randrange(5, 300) for _ in range(600)]  # > snapshot_points.PERSIST_MIN

    def cached():
        return start_daemon(model, "--ssd-cache", str(ssd), "--block-tokens", str(BLOCK),
                            "--restart-backoff", "0.1", isolate=True)
    d, cold = both(cached, lambda: start_daemon(model, "--prompt-cache", "0", "--ssd-cache",
                                                "off", isolate=True))
    try:
        want = {name: complete(cold, p)["text"] for name, p in
                (("prompt", prompt), ("extended", extended), ("mid", mid))}
        want_longer = complete(cold, longer, 400)["text"]
        stop(cold)
        first = complete(d, prompt)
        assert first["cached"] == 0 and first["text"] == want["prompt"]
        again = complete(d, prompt)  # (a) the same prompt: all but the token always fed
        assert again["cached"] >= len(prompt) - 1 - BLOCK and again["text"] == want["prompt"]
        nxt = complete(d, extended)  # (b) the next turn, after the model's answer
        assert nxt["cached"] >= len(prompt) + len(answer) - BLOCK
        assert nxt["text"] == want["extended"]
        diff = complete(d, mid)  # (f) never past the token that differs
        assert diff["cached"] <= 60 and diff["text"] == want["mid"]
        cache = d.stats()["engines"][0]["cache"]
        assert cache["cache_unsupported"] == "" and cache["ram_bytes"] > 0
        if family != "llama":
            assert cache["ram_snapshots"] >= 2
        status = format_status(d.stats())  # what `mlxd status` prints
        assert f"{family}: {cache['cache_layers']}" in status and "counted" in status
        # (d) kill -9 mid-stream: the same text, and the new engine prefills less than the
        # context (the prompt's snapshot, or its blocks, were persisted as it ended)
        epoch = d.stats()["engines"][0]["epoch"]
        files = {p.name for p in ssd.rglob("*.*")}
        suffix, count = (".blk", len(longer) // BLOCK) if family == "llama" else (".snp", 1)
        # (more blocks than the tier's 16 slots: later steps write the rest)
        seen = stream_with_kill(d, longer, 400, kill_after=4, persisted=lambda: len(
            [p for p in ssd.rglob("*" + suffix) if p.name not in files]) >= count)
        assert seen == want_longer
        d.wait_until(lambda st: st["engines"][0]["epoch"] > epoch and st["engines"][0][
            "cache"]["prompt_tokens"] >= len(longer), what="the new engine's figures")
        resumed = d.stats()["engines"][0]["cache"]
        assert 0 < resumed["prefilled_tokens"] < len(longer), resumed
        with d.unix_http() as c:
            assert c.post("/admin/cache/flush").json()["durable"]
    finally:
        stop(d)
    if family != "llama":
        assert list(ssd.rglob("*.snp")), "no snapshot reached the disk"
    d = cached()  # (c) a new start: the SSD tier gives the same hits and text
    try:
        again = complete(d, prompt)
        assert again["cached"] >= len(prompt) - 1 - BLOCK and again["text"] == want["prompt"]
        nxt = complete(d, extended)
        assert nxt["cached"] >= len(prompt) + len(answer) - BLOCK
        assert nxt["text"] == want["extended"]
        assert d.stats()["engines"][0]["cache"]["ssd_hits"] >= 2
    finally:
        stop(d)
