"""End to end through a real daemon (in-process and --isolate) with the official openai client."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from support.harness import Daemon

CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}]


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def test_health_models_and_stats(daemon, tiny_model):
    # The "ready" log line and the proxy's own view of the engine travel on two channels.
    daemon.wait_until(lambda st: st["engines"] and st["engines"][0]["state"] == "ready",
                      what="the proxy to see the engine ready")
    with daemon.http() as c:
        assert c.get("/health").json()["status"] == "ok"
    models = client(daemon).models.list()
    ids = [m.id for m in models.data]
    assert ids == ["tiny-llama"]
    st = daemon.stats()
    eng = st["engines"][0]
    assert eng["state"] == "ready" and eng["pid"] > 0 and eng["epoch"] == 0
    assert str(tiny_model) in eng["names"]


def test_chat_non_streaming_over_tcp(daemon):
    r = client(daemon).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=12)
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage is not None
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_model_can_be_named_by_path_or_omitted(daemon, tiny_model):
    base = client(daemon).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=6)
    by_path = client(daemon).chat.completions.create(model=str(tiny_model), messages=CHAT,
                                                     max_tokens=6)
    with daemon.http() as c:
        omitted = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6}).json()
    texts = {base.choices[0].message.content, by_path.choices[0].message.content,
             omitted["choices"][0]["message"]["content"]}
    assert len(texts) == 1  # greedy: the same model gives the same text


def test_streaming_matches_non_streaming(daemon):
    c = client(daemon)
    full = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=16)
    chunks = list(c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks
                if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 16


def test_unix_socket_serves_the_same_api(daemon):
    import os
    import stat
    mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    assert mode == 0o600
    http = daemon.unix_http()
    c = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http,
                      max_retries=0)
    r = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=5)
    assert r.usage is not None and r.usage.completion_tokens == 5
    s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=5, stream=True) if ch.choices)
    assert s == r.choices[0].message.content


def test_completions_endpoint_and_stop_strings(daemon):
    c = client(daemon)
    r = c.completions.create(model="tiny-llama", prompt="Hello, how are", max_tokens=20)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length" and text
    # Cut at a stop string taken from the greedy output: text ends before it, reason "stop".
    stop = text[5:8]
    assert stop.strip(), text
    cut = c.completions.create(model="tiny-llama", prompt="Hello, how are", max_tokens=20,
                               stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-llama", prompt="Hello, how are", max_tokens=20, stop=[stop], stream=True))
    assert streamed == cut.choices[0].text


def test_seeded_sampling_is_reproducible(daemon):
    c = client(daemon)

    def sampled(seed: int = 1234, temperature: float = 0.9) -> str | None:
        return c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=16,
                                         temperature=temperature, seed=seed
                                         ).choices[0].message.content

    a = sampled()
    b = sampled()
    other = sampled(seed=99)
    greedy = sampled(temperature=0)
    assert a == b
    assert other != a or greedy != a


async def test_eight_concurrent_streams_decode_together(daemon):
    ac = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    before = daemon.stats()["engines"][0]["steps"]

    async def one(i: int) -> str:
        stream = await ac.chat.completions.create(
            model="tiny-llama", max_tokens=48, stream=True,
            messages=[{"role": "user", "content": f"Request number {i}: tell me a story"}])
        parts = []
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
        return "".join(parts)

    texts = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(texts)
    daemon.wait_until(lambda s: s["engines"][0]["peak_batch"] == 8, what="peak_batch 8")
    eng = daemon.stats()["engines"][0]
    # Decoded together: far fewer steps than 8 requests x 48 tokens one after another.
    assert eng["steps"] - before < 8 * 48 / 2
    await ac.close()


def test_cancelled_stream_frees_its_row(daemon):
    with daemon.http() as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content": "' in line:
                    seen += 1
                    if seen == 3:
                        break
        # the connection is closed here, mid-stream
    daemon.wait_until(lambda s: s["engines"][0]["active_requests"] == 0
                      and s["proxy"]["in_flight"] == 0, what="the row to be freed")
    gen = daemon.stats()["engines"][0]["generated_tokens_total"]
    # and the engine still serves
    r = client(daemon).chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=4)
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert daemon.stats()["engines"][0]["generated_tokens_total"] < gen + 100


def test_logprobs_chat_and_completions(daemon):
    c = client(daemon)
    r = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=8,
                                  logprobs=True, top_logprobs=3)
    assert r.choices[0].logprobs is not None and r.usage is not None
    entries = r.choices[0].logprobs.content
    assert entries is not None and len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        tops = e.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted(
            (t.logprob for t in tops), reverse=True)
        assert e.logprob <= 0 and sum(math.exp(t.logprob) for t in tops) <= 1.0 + 1e-5
        assert (e.token, e.logprob) == (tops[0].token, pytest.approx(tops[0].logprob))  # greedy
        assert e.bytes == list(e.token.encode())
    streamed = [e for ch in c.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3,
        stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries])
    plain = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None
    comp = c.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=5, logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    assert lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}),
])
def test_bad_logprobs_are_400(daemon, path, body):
    with daemon.http() as c:
        r = c.post(path, json={**body, "max_tokens": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
