"""Every kind of bad input gets a 4xx in OpenAI's envelope, and the engine keeps serving."""

from __future__ import annotations

import base64

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
    ("json array body", "/v1/chat/completions", [1, 2], 400, "expected an object"),
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


@pytest.mark.parametrize("body, param, code, message", [
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "integer_below_min_value",
     "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got 0 "
     "instead."),
    ({"messages": CHAT, "max_tokens": "ten"}, "max_tokens", "invalid_type",
     "Invalid type for 'max_tokens': expected an integer, but got a string instead."),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter",
     "Missing required parameter: 'messages[0].role'."),
    ({"messages": CHAT, "stop": ["x" * 2000]}, "stop[0]", "string_above_max_length",
     "Invalid 'stop[0]': string too long. Expected a string with maximum length 1024, but "
     "got a string with length 2000 instead."),
])
def test_validation_errors_in_openais_words(daemon, body, param, code, message):
    """A body that does not fit the schema is refused as OpenAI refuses it: its wording, the
    field in `param`, its code; never the validator's own text."""
    r = _post(daemon, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                 "param": param, "code": code}


@pytest.mark.parametrize("raw, body, openai, anthropic, ollama", [
    ("Expected `float` <= 2.0 - at `$.temperature`", {"temperature": 3.5},
     "Invalid 'temperature': decimal above maximum value. Expected a value <= 2.0, but got 3.5 "
     "instead.", "temperature: Input should be less than or equal to 2.0",
     "invalid temperature: must be less than or equal to 2.0"),
    ("Expected `int`, got `str` - at `$.logit_bias[...]`", None,
     "Invalid type for 'logit_bias[...]': expected an integer, but got a string instead.",
     "logit_bias[...]: Input should be a valid integer",
     "invalid logit_bias[...]: expected an integer, got a string"),
    ("Invalid enum value 'hex' - at `$.encoding_format`", None,
     "Invalid value for 'encoding_format': 'hex' is not a supported value.",
     "encoding_format: Input should be one of the supported values, not 'hex'",
     "invalid encoding_format: 'hex' is not a supported value"),
    ("Expected `array` of length <= 16 - at `$.stop`", {"stop": ["a"] * 17},
     "Invalid 'stop': array too long. Expected an array with maximum length 16, but got an "
     "array with length 17 instead.", "stop: List should have at most 16 items",
     "invalid stop: must have at most 16 items"),
])
def test_field_errors_are_worded_per_dialect(raw, body, openai, anthropic, ollama):
    from mlxd.proxy import field_errors
    fe = field_errors.parse(raw, body)
    assert (fe.openai(), fe.anthropic(), fe.ollama()) == (openai, anthropic, ollama)


def test_a_corrupt_image_to_a_text_model_is_refused_for_the_model(daemon):
    """The model's capabilities are checked before any image is decoded: a text model given
    a corrupt image says it takes no images, and no error text holds a Python repr."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                      + base64.b64encode(b"no image").decode()}}
    r = _post(daemon, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]})
    err = _assert_envelope(r, 400, "does not take images")
    assert "0x" not in err["message"] and "Error" not in err["message"]


def test_unknown_model_errors_name_served_ids_never_paths(daemon, tiny_model):
    r = _post(daemon, "/v1/chat/completions", {"model": "no-such-model", "messages": CHAT})
    err = _assert_envelope(r, 404, "does not exist")
    assert "tiny-llama" in err["message"] and str(tiny_model) not in r.text


def test_an_unfetchable_model_is_not_found_and_says_why(daemon):
    """A repo id neither in the local cache nor reachable (the Hub is unreachable here) is a
    404 model_not_found that says so: not a 503 that clients would retry."""
    if "--isolate" not in daemon.argv:
        pytest.skip("only a daemon with a model pool loads models on demand")
    r = _post(daemon, "/v1/chat/completions", {"model": "nobody/no-such-repo-xyz",
                                                "messages": CHAT})
    err = _assert_envelope(r, 404, "nobody/no-such-repo-xyz")
    assert err["code"] == "model_not_found" and "Retry-After" not in r.headers
    assert "could not be reached" in err["message"] or "HF_HUB_OFFLINE" in err["message"]
    with daemon.http() as c:
        m = c.post("/v1/messages", json={"model": "nobody/no-such-repo-xyz", "max_tokens": 4,
                                         "messages": CHAT})
    assert m.status_code == 404 and m.json()["error"]["type"] == "not_found_error"
    bad = _post(daemon, "/v1/chat/completions", {"model": "a/b--c", "messages": CHAT})
    assert "not a Hugging Face repo id" in _assert_envelope(bad, 404, "a/b--c")["message"]


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


def test_a_model_that_fails_to_load_says_why_without_its_paths(tiny_model, tmp_path):
    """A load error names files; the 503 any client may read keeps only their last part."""
    import shutil

    from conftest import start_daemon, stop_and_check
    broken = tmp_path / "secret-user" / "tiny-llama"
    shutil.copytree(tiny_model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    d = start_daemon(broken, isolate=True, ready_marker="model failed to load")
    try:
        r = _post(d, "/v1/chat/completions", {"model": "tiny-llama", "messages": CHAT})
        err = _assert_envelope(r, 503, "failed")
        assert err["code"] == "model_failed", err
        assert "secret-user" not in r.text and str(tmp_path) not in r.text, r.text
        assert "secret-user" in d.log()  # the log keeps the whole message
    finally:
        stop_and_check(d)
