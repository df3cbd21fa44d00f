"""The one max_tokens rule through a real daemon, in every dialect: a max_tokens the client
asked for beyond the model's context is a 400 in the dialect's own envelope and never reaches
the engine; a default one (`--max-tokens` above the context, Ollama's `num_predict: -1`) is
clamped by the engine to the context the prompt leaves."""

from __future__ import annotations

import pytest

from conftest import start_daemon, stop_and_check

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def daemon(tiny_model):
    d = start_daemon(tiny_model, "--max-tokens", "100000")
    yield d
    stop_and_check(d)


def context_of(daemon) -> int:
    daemon.wait_until(lambda st: st["engines"][0]["context_length"], what="the engine's status")
    return daemon.stats()["engines"][0]["context_length"]


@pytest.mark.parametrize("path, body, error_of", [
    ("/v1/chat/completions", lambda n: {"messages": CHAT, "max_tokens": n},
     lambda b: b["error"]["param"] == "max_tokens"),
    ("/v1/chat/completions", lambda n: {"messages": CHAT, "max_tokens": 1,
                                        "max_completion_tokens": n},
     lambda b: b["error"]["param"] == "max_tokens"),
    ("/v1/completions", lambda n: {"prompt": "Hello", "max_tokens": n},
     lambda b: b["error"]["param"] == "max_tokens"),
    ("/v1/messages", lambda n: {"model": "tiny-llama", "messages": CHAT, "max_tokens": n},
     lambda b: b["type"] == "error" and b["error"]["type"] == "invalid_request_error"),
    ("/api/chat", lambda n: {"model": "tiny-llama", "messages": CHAT, "stream": False,
                             "options": {"num_predict": n}},
     lambda b: set(b) == {"error"}),
])
def test_explicit_max_tokens_beyond_the_context_is_a_400(daemon, path, body, error_of):
    context = context_of(daemon)
    with daemon.http(timeout=120) as c:
        assert c.post(path, json=body(context)).status_code == 200  # at the limit: served
        r = c.post(path, json=body(context + 1))
    assert r.status_code == 400, r.text
    # the proxy's refusal (an engine never sees a max_tokens it would have to refuse)
    assert error_of(r.json()) and f"more than this model's context of {context}" in r.text


@pytest.mark.parametrize("path, body, tokens", [
    ("/v1/chat/completions", {"messages": CHAT},
     lambda b: (b["usage"]["prompt_tokens"], b["usage"]["completion_tokens"])),
    ("/api/chat", {"model": "tiny-llama", "messages": CHAT, "stream": False,
                   "options": {"num_predict": -1}},
     lambda b: (b["prompt_eval_count"], b["eval_count"])),
])
def test_a_default_max_tokens_beyond_the_context_is_clamped(daemon, path, body, tokens):
    with daemon.http(timeout=120) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    prompt, completion = tokens(r.json())
    assert prompt > 0 and prompt + completion == context_of(daemon)  # ran until it was full
