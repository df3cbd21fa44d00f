"""Every kind of bad input gets a 4xx in OpenAI's envelope, and the engine keeps serving."""

from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "hi"}]


def _post(d, path, **kw):
    with d.http() as c:
        return c.post(path, **kw)


def _assert_envelope(r, status, needle):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert needle.lower() in err["message"].lower(), err["message"]
    return err


CASES = [
    ("malformed json", "/v1/chat/completions", {"content": b"{not json"}, 400, "not valid JSON"),
    ("empty body", "/v1/chat/completions", {"content": b""}, 400, "empty"),
    ("json array body", "/v1/chat/completions", {"json": [1, 2]}, 400, "invalid request"),
    ("missing messages", "/v1/chat/completions", {"json": {"max_tokens": 3}}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"json": {"messages": []}}, 400, "at least one"),
    ("wrong type", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": "ten"}}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": -5}}, 400, "max_tokens"),
    ("absurd max_tokens", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": 10**9}}, 400, "context"),
    ("bad role", "/v1/chat/completions",
     {"json": {"messages": [{"role": "wizard", "content": "x"}]}}, 400, "role"),
    ("empty chat prompt", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": ""}]}}, 400, "empty"),
    ("temperature out of range", "/v1/chat/completions",
     {"json": {"messages": CHAT, "temperature": 7}}, 400, "temperature"),
    ("n > 1", "/v1/chat/completions", {"json": {"messages": CHAT, "n": 3}}, 400, "n=1"),
    ("image part", "/v1/chat/completions", {"json": {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
     400, "image_url"),
    ("empty completion prompt", "/v1/completions", {"json": {"prompt": ""}}, 400, "empty"),
    ("token id out of vocab", "/v1/completions", {"json": {"prompt": [1, 10**7]}}, 400,
     "vocabulary"),
    ("prompt over the context", "/v1/completions",
     {"json": {"prompt": "hello world " * 400, "max_tokens": 4}}, 400, "context"),
    ("unknown model", "/v1/chat/completions",
     {"json": {"model": "no-such-model", "messages": CHAT}}, 404, "does not exist"),
    ("body over the size limit", "/v1/chat/completions",
     {"content": b'{"messages": "' + b"x" * (17 * 1024 * 1024) + b'"}'}, 413, "too large"),
    ("unknown route", "/v1/nothing", {"json": {}}, 404, "no route"),
]


@pytest.mark.parametrize("name,path,kw,status,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_envelope(daemon, name, path, kw, status, needle):
    r = _post(daemon, path, **kw)
    err = _assert_envelope(r, status, needle)
    if status == 404 and "model" in needle:
        assert err["code"] == "model_not_found"


def test_bad_streaming_request_fails_before_any_byte(daemon):
    r = _post(daemon, "/v1/completions", json={"prompt": "hello world " * 400, "stream": True})
    _assert_envelope(r, 400, "context")
    assert r.headers["content-type"].startswith("application/json")


def test_engine_keeps_serving_after_every_bad_input(daemon):
    for name, path, kw, status, needle in CASES:
        _post(daemon, path, **kw)
    r = _post(daemon, "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    eng = daemon.stats()["engines"][0]
    assert eng["state"] == "ready" and eng["epoch"] == 0  # never restarted
