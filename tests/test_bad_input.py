"""Every kind of bad input gets a 4xx in OpenAI's envelope, and the engine keeps serving."""

from __future__ import annotations

import httpx2 as httpx
import pytest

from support.harness import Daemon

CHAT = [{"role": "user", "content": "hi"}]


def _post(d: Daemon, path: str, body: object) -> httpx.Response:
    """POST `body`: bytes as they are (no content type), anything else as JSON."""
    with d.http() as c:
        if isinstance(body, bytes):
            return c.post(path, content=body)
        return c.post(path, json=body)


def _assert_envelope(r: httpx.Response, status: int, needle: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert needle.lower() in err["message"].lower(), err["message"]
    return err


CASES: list[tuple[str, str, object, int, str]] = [
    ("malformed json", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("empty body", "/v1/chat/completions", b"", 400, "empty"),
    ("json array body", "/v1/chat/completions", [1, 2], 400, "invalid request"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "at least one"),
    ("wrong type", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("absurd max_tokens", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 10**9}, 400, "context"),
    ("bad role", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("empty chat prompt", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": ""}]}, 400, "empty"),
    ("temperature out of range", "/v1/chat/completions",
     {"messages": CHAT, "temperature": 7}, 400, "temperature"),
    ("n out of range", "/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "`n`"),
    ("image part", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "image_url"),
    ("empty completion prompt", "/v1/completions", {"prompt": ""}, 400, "empty"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**7]}, 400,
     "vocabulary"),
    ("prompt over the context", "/v1/completions",
     {"prompt": "hello world " * 400, "max_tokens": 4}, 400, "context"),
    ("unknown model", "/v1/chat/completions",
     {"model": "no-such-model", "messages": CHAT}, 404, "does not exist"),
    ("body over the size limit", "/v1/chat/completions",
     b'{"messages": "' + b"x" * (17 * 1024 * 1024) + b'"}', 413, "too large"),
    ("unknown route", "/v1/nothing", {}, 404, "no route"),
]


@pytest.mark.parametrize("name,path,body,status,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_envelope(daemon, name, path, body, status, needle):
    r = _post(daemon, path, body)
    err = _assert_envelope(r, status, needle)
    if status == 404 and "model" in needle:
        assert err["code"] == "model_not_found"


def test_bad_streaming_request_fails_before_any_byte(daemon):
    r = _post(daemon, "/v1/completions", {"prompt": "hello world " * 400, "stream": True})
    _assert_envelope(r, 400, "context")
    assert r.headers["content-type"].startswith("application/json")


def test_engine_keeps_serving_after_every_bad_input(daemon):
    for _, path, body, _, _ in CASES:
        _post(daemon, path, body)
    r = _post(daemon, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    eng = daemon.stats()["engines"][0]
    assert eng["state"] == "ready" and eng["epoch"] == 0  # never restarted
