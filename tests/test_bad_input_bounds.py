"""Issue 12 item 2: inputs that used to get a 500 (or reach the engine unbounded) get a 4xx in
the endpoint's own dialect, before anything touches the file system or an engine; and an
error that still escapes a handler is a JSON 500, logged once and bounded."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import httpx2 as httpx
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from mlxd.proxy.bounds import MAX_JSON_DEPTH
from mlxd.proxy.errors import MAX_LOGGED_TRACEBACK, error_middleware
from support.fuzz_requests import NOT_FUZZED
from support.harness import Daemon
from support.routes import served_routes

HI = [{"role": "user", "content": "hi"}]
DEEP = b"[" * 100_000 + b"]" * 100_000

# Every endpoint that reads a body, with a minimal valid body and its error dialect.
BODY_ENDPOINTS: dict[str, tuple[dict[str, object], str]] = {
    "/v1/chat/completions": ({"messages": HI, "max_tokens": 2}, "openai"),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2}, "openai"),
    "/v1/messages": ({"model": "MODEL", "messages": HI, "max_tokens": 2}, "anthropic"),
    "/v1/messages/count_tokens": ({"model": "MODEL", "messages": HI}, "anthropic"),
    "/api/chat": ({"model": "MODEL", "messages": HI, "stream": False,
                   "options": {"num_predict": 2}}, "ollama"),
    "/api/generate": ({"model": "MODEL", "prompt": "hi", "stream": False,
                       "options": {"num_predict": 2}}, "ollama"),
    "/api/show": ({"model": "MODEL"}, "ollama"),
    "/api/pull": ({"model": "MODEL", "stream": False}, "ollama"),
    "/v1/embeddings": ({"model": "MODEL", "input": "hi"}, "openai"),
    "/api/embed": ({"model": "MODEL", "input": "hi"}, "ollama"),
    "/api/embeddings": ({"model": "MODEL", "prompt": "hi"}, "ollama"),
    "/v1/responses": ({"model": "MODEL", "input": "hi", "max_output_tokens": 2}, "openai"),
    "/v1/rerank": ({"model": "MODEL", "query": "q", "documents": ["d"]}, "openai"),
    "/v2/rerank": ({"model": "MODEL", "query": "q", "documents": [{"text": "d"}]}, "openai"),
    "/rerank": ({"model": "MODEL", "query": "q", "documents": ["d"]}, "openai"),
    "/admin/models/load": ({"model": "MODEL"}, "openai"),
    "/admin/models/unload": ({"model": "nosuch"}, "openai"),
    "/admin/models/reset": ({"model": "nosuch"}, "openai"),
    "/admin/drain": ({"timeout": -1}, "openai"),
}
MODEL_ENDPOINTS = [p for p in BODY_ENDPOINTS if p not in ("/admin/drain",)]
# Every route that reads no body, as a concrete path ("MODEL": the daemon's model id): a body
# of deep JSON must be answered as no body is.
BODYLESS: dict[tuple[str, str], str] = {
    ("GET", "/v1/models"): "/v1/models",
    ("GET", "/v1/models/{}"): "/v1/models/MODEL",
    ("GET", "/v1/responses/{}"): "/v1/responses/resp_nosuch",
    ("DELETE", "/v1/responses/{}"): "/v1/responses/resp_nosuch",
    ("GET", "/v1/responses/{}/input_items"): "/v1/responses/resp_nosuch/input_items",
    ("GET", "/api/tags"): "/api/tags",
    ("GET", "/api/ps"): "/api/ps",
    ("GET", "/api/version"): "/api/version",
    ("GET", "/"): "/",
    ("GET", "/health"): "/health",
    ("GET", "/stats"): "/stats",
    ("GET", "/metrics"): "/metrics",
    ("POST", "/admin/cache/flush"): "/admin/cache/flush",
    ("POST", "/admin/undrain"): "/admin/undrain",
}


def served(method: str, path: str) -> None:
    """Skip a case for a route this tree does not serve yet."""
    if (method, path) not in served_routes():
        pytest.skip(f"{method} {path} is not served")


_MODEL_IDS: dict[Path, str] = {}  # a daemon's run dir -> the id of the model it serves


def model_id(d: Daemon) -> str:
    if d.run_dir not in _MODEL_IDS:
        _MODEL_IDS[d.run_dir] = d.stats()["engines"][0]["model"]
    return _MODEL_IDS[d.run_dir]


def post(d: Daemon, path: str, body: object) -> httpx.Response:
    """POST `body`: bytes as they are, anything else as JSON (where the string "MODEL" stands for
    the daemon's model id)."""
    content = body if isinstance(body, bytes) else \
        json.dumps(body).replace('"MODEL"', json.dumps(model_id(d))).encode()
    with (d.unix_http() if path.startswith("/admin/") else d.http()) as c:
        return c.post(path, content=content, headers={"Content-Type": "application/json"})


def error_of(r: httpx.Response, status: int, dialect: str, needle: str = "") -> dict:
    """The error message, after checking the status and the dialect's envelope."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    if dialect == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        message = body["error"]["message"]
    elif dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str)
        message = body["error"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        message = body["error"]["message"]
    assert needle.lower() in message.lower(), message
    assert len(message) < 3000, "an error message echoes client input unbounded"
    return body


def with_model(path: str, name: str) -> tuple[dict[str, object], str]:
    body, dialect = BODY_ENDPOINTS[path]
    return {**body, "model": name}, dialect


@pytest.mark.parametrize("path", MODEL_ENDPOINTS)
def test_100k_char_model_name_is_400_naming_the_field(daemon, path):
    served("POST", path)
    body, dialect = with_model(path, "x" * 100_000)
    got = error_of(post(daemon, path, body), 400, dialect, "model")
    if dialect == "openai":
        assert got["error"]["param"] == "model"


@pytest.mark.parametrize("name", ["x" * 300, "a/" + "b" * 300, "x" * 255 + "/" + "y" * 255,
                                  "/tmp/" + "é" * 200])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat",
                                  "/api/show", "/admin/models/load"])
def test_model_name_too_long_for_the_file_system_is_404(daemon, path, name):
    """ENAMETOOLONG from a path probe means "no such local model", never a 500; a repo id
    with a part longer than the Hub allows is no repo id (nothing is fetched or evicted)."""
    body, dialect = with_model(path, name)
    error_of(post(daemon, path, body), 404, dialect, "does not exist")


DEEP_BODIES = (DEEP, b'{"x": ' + DEEP + b"}", b'{"model": "MODEL", "x": ' + b'{"a":' * 100_000
               + b"1" + b"}" * 100_000 + b"}")


def test_every_served_route_has_a_deep_json_case():
    """Coverage by construction: every route of the proxy's router is a case below (HEAD is
    GET's handler; /admin/shutdown stops the daemon whatever the body)."""
    cases = {("POST", p) for p in BODY_ENDPOINTS} | set(BODYLESS) | set(NOT_FUZZED)
    missing = {r for r in served_routes() if r[0] != "HEAD"} - cases
    assert not missing, f"routes without a deep-JSON case: {sorted(missing)}"


@pytest.mark.parametrize("path", list(BODY_ENDPOINTS))
def test_100k_deep_json_is_400_on_every_endpoint(daemon, path):
    served("POST", path)
    _, dialect = BODY_ENDPOINTS[path]
    for raw in DEEP_BODIES:
        error_of(post(daemon, path, raw), 400, dialect)


@pytest.mark.parametrize("route", list(BODYLESS), ids=" ".join)
def test_100k_deep_json_to_a_route_without_a_body_is_ignored(daemon, route):
    method, _ = route
    served(*route)
    path = BODYLESS[route].replace("MODEL", model_id(daemon))
    with (daemon.unix_http() if path.startswith("/admin/") else daemon.http()) as c:
        plain = c.request(method, path)
        assert plain.status_code < 500, plain.text[:300]
        for raw in DEEP_BODIES:
            r = c.request(method, path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == plain.status_code, r.text[:300]


def nested(depth: int) -> dict:
    value: dict = {"type": "integer"}
    for _ in range(depth // 2):
        value = {"type": "array", "items": value}
    return value


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": nested(2 * MAX_JSON_DEPTH)}}]}),
    ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"schema": nested(2 * MAX_JSON_DEPTH)}}}),
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 500
                                                    + "]" * 500}}]}]}),
    ("/v1/messages", {"model": "MODEL", "messages": HI, "max_tokens": 2,
                      "metadata": nested(2 * MAX_JSON_DEPTH)}),
    ("/api/chat", {"model": "MODEL", "messages": HI, "format": nested(2 * MAX_JSON_DEPTH)}),
])
def test_free_form_json_nesting_is_bounded(daemon, path, body):
    error_of(post(daemon, path, body), 400, BODY_ENDPOINTS[path][1], "nests too deeply")


@pytest.mark.parametrize("path,body,field", [
    ("/v1/messages", {"model": "MODEL", "messages": HI, "max_tokens": 2, "top_k": 2**64},
     "top_k"),
    ("/api/chat", {"model": "MODEL", "messages": HI, "options": {"top_k": 2**64}}, "top_k"),
    ("/api/generate", {"model": "MODEL", "prompt": "hi", "options": {"top_k": 2**64}}, "top_k"),
    ("/v1/chat/completions", {"messages": HI, "seed": 2**70}, "seed"),
    ("/api/chat", {"model": "MODEL", "messages": HI, "options": {"seed": 2**70}}, "seed"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2**64}, "max_tokens"),
    ("/api/generate", {"model": "MODEL", "prompt": "hi", "options": {"num_predict": 2**64}},
     "num_predict"),
    ("/v1/completions", {"prompt": [1, 2**64], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "keep_alive": 1e300}, "keep_alive"),
    ("/api/chat", {"model": "MODEL", "messages": HI, "keep_alive": "9" * 100 + "h"},
     "keep_alive"),
    ("/admin/drain", {"timeout": 1e300}, "timeout"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["x" * 5000]}, "stop"),
    ("/v1/messages", {"model": "MODEL", "messages": HI, "max_tokens": 2,
                      "stop_sequences": ["x" * 5000]}, "stop_sequences"),
    ("/v1/chat/completions", {"messages": [{"role": "u" * 5000, "content": "hi"}]}, "role"),
])
def test_out_of_range_numbers_and_strings_are_400_naming_the_field(daemon, path, body, field):
    try:
        error_of(post(daemon, path, body), 400, BODY_ENDPOINTS[path][1], field)
    finally:
        if path == "/admin/drain":
            with daemon.unix_http() as c:
                c.post("/admin/undrain")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f",
                                                    "arguments": json.dumps({"a": 2**70})}}]}]}),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "x-big": 2**70}}}]}),
    ("/api/chat", {"model": "MODEL", "messages": HI + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": -(2**70)}}}]}]}),
])
def test_integers_the_engine_channel_cannot_carry_are_400(daemon, path, body):
    error_of(post(daemon, path, body), 400, BODY_ENDPOINTS[path][1], "64-bit")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": "f"}}),
    ("/v1/chat/completions", {"messages": HI + [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "text", "text": 5}]}]}]}),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 2, "messages": HI,
                      "tools": [{"name": "f", "description": 5, "input_schema": {}}]}),
    ("/api/chat", {"model": "MODEL", "messages": HI + [{"role": "assistant", "tool_calls": [
        {"function": []}]}]}),
])
def test_malformed_tool_fields_are_400(daemon, path, body):
    error_of(post(daemon, path, body), 400, BODY_ENDPOINTS[path][1])


def test_top_k_beyond_the_vocabulary_samples_normally(daemon):
    """A top_k of the whole vocabulary or more filters nothing (it used to fail the step)."""
    for k in (100_000, 2**31 - 1):
        r = post(daemon, "/v1/chat/completions", {"messages": HI, "max_tokens": 3,
                                                  "temperature": 0.7, "top_k": k, "seed": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_engine_unharmed(daemon):
    r = post(daemon, "/v1/chat/completions", {"messages": HI, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    eng = daemon.stats()["engines"][0]
    assert eng["state"] == "ready" and eng["epoch"] == 0


# ---------------------------------------------------------------- the error middleware
# A bare app with the product's error middleware (which reads the body limit from aiohttp's
# own `client_max_size`).
async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application(client_max_size=1024, middlewares=[error_middleware])
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat", "/stream"):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_unhandled_error_is_a_json_500_in_the_dialect_logged_once_bounded(caplog):
    async def broken(request: web.Request) -> web.StreamResponse:
        if request.path == "/stream":
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"data: partial\n\n")
        raise RuntimeError("secret client data " + "x" * 100_000)

    runner, url = await _serve(broken)
    try:
        async with aiohttp.ClientSession() as s:
            for path, check in (("/v1/chat/completions", lambda b: b["error"]["type"]),
                                ("/v1/messages", lambda b: b["error"]["type"] == "api_error"),
                                ("/api/chat", lambda b: b["error"])):
                caplog.clear()
                with caplog.at_level(logging.ERROR, logger="mlxd.proxy"):
                    async with s.post(url + path, data=b"{}") as r:
                        assert r.status == 500
                        assert r.content_type == "application/json"
                        body = await r.json()
                assert check(body), body
                assert "x" * 1000 not in json.dumps(body)  # the client sees no internals
                records = [rec for rec in caplog.records if rec.name == "mlxd.proxy"]
                assert len(records) == 1
                assert len(records[0].getMessage()) < MAX_LOGGED_TRACEBACK + 500
            # Once the response has started, the connection ends: no second status line.
            async with s.post(url + "/stream", data=b"{}") as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
    finally:
        await runner.cleanup()


async def test_content_length_over_the_limit_is_413_before_the_body_arrives():
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"n": len(await request.read())})

    runner, url = await _serve(echo)
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 413 ")
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()
