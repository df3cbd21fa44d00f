"""While a prompt prefills, its stream sends keep-alives (`--stream-ping`): SSE comments on
OpenAI routes, `ping` events on /v1/messages, which the official SDKs pass over; a client gone
mid-prefill stops it, and the same request sent twice at once costs one prefill."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from support.random_model import write_random_model


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A model this CPU prefills slowly (~1,000 tokens in several seconds), no caches (every
    request prefills), keep-alives every 0.5 s."""
    path = write_random_model(tmp_path_factory.mktemp("slow") / "m", hidden=256, layers=6,
                              heads=4, kv_heads=2, intermediate=512, context=4096)
    d = start_daemon(path, "--stream-ping", "0.5", "--prompt-cache", "0", "--ssd-cache", "off",
                     isolate=True)
    yield d
    stop(d)


LONG = "The quick brown fox jumps over the lazy dog. " * 90  # ~1,000 tokens


def raw_stream(d, path: str, body: dict) -> list[str]:
    with httpx.Client(base_url=d.url, timeout=120) as c, \
            c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_openai_streams_send_comments_while_prefilling_and_the_sdk_reads_through(slow):
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 6, "stream": True}
    lines = raw_stream(slow, "/v1/chat/completions", body)
    first_token = next(i for i, line in enumerate(lines) if line.startswith("data: {")
                       and json.loads(line[6:])["choices"][0]["delta"].get("content"))
    assert lines[:first_token].count(": keep-alive") >= 2, lines[:5]  # (after the role)
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines if line.startswith("data: {"))
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", max_retries=0)
    got = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="m", messages=body["messages"], max_tokens=6, stream=True) if ch.choices)
    assert got == text and text


def test_anthropic_streams_send_pings_while_prefilling_and_the_sdk_reads_through(slow):
    body = {"model": "m", "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": LONG}]}
    lines = raw_stream(slow, "/v1/messages", body)
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events.index("message_start") >= 2 and set(
        events[:events.index("message_start")]) == {"ping"}, events[:5]
    client = anthropic.Anthropic(base_url=slow.url, api_key="x", max_retries=0)
    with client.messages.stream(model="m", max_tokens=6, messages=body["messages"]) as s:
        got = s.get_final_text()
    text = "".join(json.loads(line[6:])["delta"].get("text", "") for line in lines
                   if line.startswith("data: ") and '"content_block_delta"' in line)
    assert got == text and text


def test_a_client_gone_mid_prefill_stops_it_and_a_resend_starts_from_what_was_computed(
        tmp_path):
    """A client that gives up while its prompt prefills stops the prefill within a chunk
    (`/stats` counts the prompt tokens computed: part of the prompt, and no more once it is
    gone), and the chunks computed stay in the prefix cache: the same request sent again
    starts from them (more than nothing, less than the whole prompt: the first copy never
    finished) and computes only the rest."""
    path = write_random_model(tmp_path / "m", hidden=256, layers=6, heads=4, kv_heads=2,
                              intermediate=512, context=4096)
    d = start_daemon(path, "--stream-ping", "0.3", "--hang-timeout", "2", "--ssd-cache", "off",
                     isolate=True)
    prompt = [5 + (i * 37) % 400 for i in range(2000)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    try:
        pings = 0
        with httpx.Client(base_url=d.url, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                pings += line == ": keep-alive"
                if pings == 3:  # about a second into the prefill: the client leaves
                    break
        d.wait_until(lambda s: s["engines"][0]["active_requests"] == 0
                     and s["engines"][0]["cache"]["ram_entries"] > 0,
                     what="the abandoned request gone, its KV kept")
        gone = d.stats()["engines"][0]["cache"]["prefilled_tokens"]
        assert 0 < gone < len(prompt) - 1, gone  # computed in part, then stopped
        with d.http(timeout=300) as c:
            again = c.post("/v1/completions", json=body).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < len(prompt) - 1, cached
        d.wait_until(lambda s: s["engines"][0]["cache"]["prefilled_tokens"] - gone
                     == len(prompt) - cached, what="the re-send computing only the rest")
        assert d.stats()["engines"][0]["restarts"] == 0
    finally:
        stop(d)


def test_two_identical_long_requests_at_once_cost_one_prefill(tmp_path):
    """A client that re-sends a request while the first copy still prefills (or two agents
    sending the same context) does not prefill it twice: the copy waits for the first's
    prompt and starts from it."""
    import threading
    path = write_random_model(tmp_path / "m", hidden=256, layers=6, heads=4, kv_heads=2,
                              intermediate=512, context=4096)
    d = start_daemon(path, "--ssd-cache", "off", isolate=True)
    prompt = [5 + (i * 37) % 400 for i in range(1200)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    answers: list[dict] = []
    try:
        def send() -> None:
            with d.http(timeout=300) as c:
                answers.append(c.post("/v1/completions", json=body).json())
        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cache = d.stats()["engines"][0]["cache"]
        assert cache["prefilled_tokens"] <= len(prompt) + 1, cache  # once, and a token
        assert [a["choices"][0]["text"] for a in answers][0] == answers[1]["choices"][0]["text"]
        assert sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"]
                      for a in answers) == [0, len(prompt) - 1]
    finally:
        stop(d)
