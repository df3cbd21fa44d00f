"""Hostile requests for every endpoint of mlxd, and the check every response must pass.

Shared by tests/test_fuzz.py (a bounded, repeatable run in CI) and benchmarks/soak.py (a long
run): `requests(endpoint, model)` is a hypothesis strategy of `FuzzRequest`s for one endpoint,
`iter_requests(count, model, seed)` yields requests over every endpoint without a test runner,
and `problems(req, status, headers, body)` lists what is wrong with a response (nothing: fine).
`covered_routes(model)` is every (method, path template) the generators send to; a test checks
it against the proxy's router (tests/support/routes.py), so a route without a generator fails.

Bodies are schema-shaped (the endpoint's keys, with sane or wild values: huge, negative, null
or non-finite numbers, integers past 2**64, 100 kB strings, deep nesting, wrong types, odd
unicode, empty containers) or raw garbage. A generated request never asks for something a
client may legitimately ask that would change the daemon's state: no repo-id-like model names
(they would load a model), no keep_alive that unloads, no valid /admin/drain or /admin/shutdown.
So after any number of them the engine must still be serving, on the same epoch.

Requests to /admin/* must be sent over the Unix socket (`FuzzRequest.unix`).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seeded
from hypothesis import strategies as st

from mlxd.proxy.admin_routes import DrainBody, ModelBody
from mlxd.proxy.bounds import decode_body
from mlxd.proxy.engines.pool import looks_like_repo_id, parse_keep_alive
from mlxd.proxy.errors import APIError, dialect_of


class FuzzRequest(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def unix(self) -> bool:
        """/admin/* is served on the Unix socket only."""
        return self.path.startswith("/admin/")


class Endpoint(NamedTuple):
    """One generator and the routes, (method, path template with `{}` placeholders), it hits."""
    routes: frozenset[tuple[str, str]]
    requests: st.SearchStrategy


# Routes no generator may send to, and why.
NOT_FUZZED = {("POST", "/admin/shutdown"): "any request to it stops the daemon: it reads no "
                                           "body, so there is nothing to refuse"}


class Raw(str):
    """JSON text put into a body as is (nesting too deep for json.dumps, invalid numbers)."""


def encode(value: Any) -> bytes:
    """JSON bytes of `value`, where Raw parts go in verbatim and NaN/Infinity stay invalid."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Raw):
            out.append(v)
        elif isinstance(v, dict):
            parts: list[Any] = [Raw("{")]
            for i, (k, item) in enumerate(v.items()):
                if i:
                    parts.append(Raw(","))
                parts += [Raw(json.dumps(str(k)) + ":"), item]
            parts.append(Raw("}"))
            stack.extend(reversed(parts))
        elif isinstance(v, list):
            parts = [Raw("[")]
            for i, item in enumerate(v):
                if i:
                    parts.append(Raw(","))
                parts.append(item)
            parts.append(Raw("]"))
            stack.extend(reversed(parts))
        else:
            out.append(json.dumps(v))  # NaN and Infinity come out as the invalid NaN/Infinity
    return "".join(out).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------- values

BOUNDARY_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                 2**70, -(2**63) - 1, -(2**64), 10**30, -(10**30)]
DEEP = [65, 300, 1_000, 100_000]


def deep(n: int, kind: str = "[") -> Raw:
    if kind == "[":
        return Raw("[" * n + "]" * n)
    return Raw('{"a":' * n + "1" + "}" * n)


def long_text(n: int, unit: str = "x") -> str:
    return unit * n


ints = st.one_of(st.sampled_from(BOUNDARY_INTS), st.integers())
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([1e308, -1e308, 5e-324, -0.0, math.nan, math.inf]))
texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "\ud800", "\u202e", "é" * 20, "🦙" * 10, "{{x}}",
                     "{% for x in y %}", "<|im_end|>", "</s>", "../" * 5, "~nosuchuser/x",
                     "a\x00b", "\n" * 10]),
    st.sampled_from([300, 5_000, 100_000]).map(long_text))
deep_values = st.builds(deep, st.sampled_from(DEEP), st.sampled_from(["[", "{"]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
wild = st.recursive(st.one_of(scalars, deep_values),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=8), inner,
                                                            max_size=3)),
                    max_leaves=6)


def either(sane: st.SearchStrategy) -> st.SearchStrategy:
    """A value that is sane two times in three, else wild."""
    return st.one_of(sane, sane, wild)


def shaped(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]
           ) -> st.SearchStrategy:
    """Objects with an endpoint's keys: every value sane (a request that should succeed), one
    value wild (so the checks behind the first are reached too), or any mix of sane and wild;
    or something else entirely."""
    all_sane = st.fixed_dictionaries(required, optional=optional)
    keys = sorted({*required, *optional, "unknown_field"})
    one_wild = st.tuples(all_sane, st.sampled_from(keys), wild).map(
        lambda t: {**t[0], t[1]: t[2]})
    mixed = st.fixed_dictionaries({k: either(v) for k, v in required.items()},
                                  optional={k: either(v) for k, v in optional.items()})
    return st.one_of(all_sane, one_wild, one_wild, mixed, wild)


def is_safe_model_name(name: Any) -> bool:
    """A wrong model name that cannot make the pool load anything: not a repo id (one with a
    part over 96 characters is no repo id either: mlxd refuses it)."""
    return not (isinstance(name, str) and looks_like_repo_id(name)
                and all(len(part) <= 96 for part in name.split("/")))


def bad_model_names(model: str) -> st.SearchStrategy:
    odd = ["x" * 300, "a/" + "b" * 300, "é" * 200, "x" * 255 + "/" + "y" * 255, "/" + "x" * 300,
           "/tmp/" * 300, "nosuch:latest", model + "\x00", model.upper(), model + ":latest:x"]
    return st.one_of(texts, st.integers(0, len(odd) - 1).map(odd.__getitem__),
                     wild).filter(is_safe_model_name)


def model_names(model: str) -> st.SearchStrategy:
    return st.one_of(st.just(model), bad_model_names(model))


# ---------------------------------------------------------------- bodies per endpoint

HI = [{"role": "user", "content": "hi"}]
TOOL_PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}}}


def chat_messages() -> st.SearchStrategy:
    call = shaped({"id": st.just("c1"), "type": st.just("function"), "function": shaped(
        {"name": st.just("f")}, {"arguments": st.sampled_from(['{"a": 1}', "{}", "[1]", "{"])})},
        {})
    message = shaped({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                      "content": st.one_of(st.sampled_from(["hi", ""]), st.lists(shaped(
                          {"type": st.just("text"), "text": st.just("hi")}, {}), max_size=2))},
                     {"name": st.just("n")})
    history = st.builds(lambda calls: HI + [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}], st.lists(call, max_size=2))
    return st.one_of(st.just(HI), st.lists(message, min_size=1, max_size=3), history)


def openai_tools() -> st.SearchStrategy:
    function = shaped({"name": st.just("f")}, {"description": st.just("d"), "parameters":
                                               st.sampled_from([TOOL_PARAMS, {}])})
    return st.lists(shaped({"type": st.just("function"), "function": function}, {}),
                    max_size=2)


def openai_body(model: str, chat: bool) -> st.SearchStrategy:
    fields = {
        "model": model_names(model), "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}), "max_tokens": st.integers(1, 4),
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 100_000), "min_p": st.floats(0, 1),
        "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.sampled_from(["\n", "x"]),
                                                            max_size=2),
        "repetition_penalty": st.floats(0.5, 2), "n": st.just(1), "user": st.just("u"),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "keep_alive": st.sampled_from([-1, "1h", "-1"])}
    if chat:
        required = {"messages": chat_messages()}
        fields |= {"tools": openai_tools(), "tool_choice": st.sampled_from(
            ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
            "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
                "type": "json_schema", "json_schema": {"schema": TOOL_PARAMS}}]),
            "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
            "max_completion_tokens": st.integers(1, 4), "parallel_tool_calls": st.booleans()}
    else:
        required = {"prompt": st.one_of(st.just("hello"), st.lists(st.integers(0, 300),
                                                                   min_size=1, max_size=4))}
        fields |= {"echo": st.just(False), "best_of": st.just(1), "logprobs": st.integers(0, 3)}
    return shaped(required, fields)


def anthropic_body(model: str, count: bool) -> st.SearchStrategy:
    block = st.one_of(
        shaped({"type": st.just("text"), "text": st.just("hi")}, {}),
        shaped({"type": st.just("tool_use"), "id": st.just("t1"), "name": st.just("f"),
                "input": st.just({"a": 1})}, {}),
        shaped({"type": st.just("tool_result"), "tool_use_id": st.just("t1")},
               {"content": st.sampled_from(["42", [{"type": "text", "text": "42"}]])}),
        shaped({"type": st.just("thinking"), "thinking": st.just("hmm")}, {}))
    message = shaped({"role": st.sampled_from(["user", "assistant"]),
                      "content": st.one_of(st.just("hi"), st.lists(block, max_size=2))}, {})
    history = st.builds(lambda use, result: [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]}], block, block)
    tool = shaped({"name": st.just("f"), "input_schema": st.just(TOOL_PARAMS)},
                  {"description": st.just("d"), "type": st.just("custom")})
    fields = {"system": st.one_of(st.just("be brief"), st.lists(block, max_size=1)),
              "tools": st.lists(tool, max_size=2),
              "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {
                  "type": "tool", "name": "f"}, {"type": "none"}]),
              "thinking": st.just({"type": "disabled"})}
    if not count:
        fields |= {"stop_sequences": st.lists(st.just("x"), max_size=2),
                   "stream": st.booleans(), "temperature": st.floats(0, 1),
                   "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 100_000),
                   "metadata": st.just({"user_id": "u"}), "service_tier": st.just("auto")}
    required = {"model": model_names(model),
                "messages": st.one_of(st.lists(message, min_size=1, max_size=2), history)}
    if not count:
        required["max_tokens"] = st.integers(1, 4)
    return shaped(required, fields)


def ollama_body(model: str, chat: bool) -> st.SearchStrategy:
    options = shaped({}, {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 100_000), "num_predict": st.integers(-2, 4),
        "stop": st.lists(st.just("x"), max_size=2), "seed": st.integers(0, 2**63 - 1),
        "repeat_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2)})
    call = shaped({"function": shaped({"name": st.just("f")}, {
        "arguments": st.just({"a": 1})})}, {})
    fields = {"stream": st.booleans(), "format": st.sampled_from(["json", TOOL_PARAMS, ""]),
              "options": options, "keep_alive": st.sampled_from([-1, "1h", "-1m"]),
              "think": st.booleans()}
    if chat:
        fields |= {"messages": st.one_of(chat_messages(), st.builds(lambda calls: HI + [
            {"role": "assistant", "content": "", "tool_calls": calls}],
            st.lists(call, min_size=1, max_size=2))), "tools": openai_tools()}
    else:
        fields |= {"prompt": st.just("hello"), "system": st.just("be brief"),
                   "raw": st.booleans(), "context": st.lists(st.integers(0, 300), max_size=3)}
    return shaped({"model": model_names(model)}, fields)


def embeddings_body(model: str, api: str) -> st.SearchStrategy:
    """OpenAI's /v1/embeddings (`openai`), Ollama's /api/embed (`embed`) and /api/embeddings."""
    keep = st.sampled_from([-1, "1h", "-1"])
    if api == "openai":
        token_ids = st.lists(st.integers(0, 300), min_size=1, max_size=4)
        inputs = st.one_of(st.just("hello"), st.lists(st.sampled_from(["hi", "a b", "é"]),
                                                      min_size=1, max_size=3),
                           token_ids, st.lists(token_ids, min_size=1, max_size=2))
        return shaped({"input": inputs}, {
            "model": model_names(model), "encoding_format": st.sampled_from(["float", "base64"]),
            "dimensions": st.integers(1, 64), "user": st.just("u"), "keep_alive": keep})
    fields: dict[str, st.SearchStrategy] = {"options": st.just({"temperature": 0}),
                                            "keep_alive": keep}
    if api == "embed":
        fields |= {"input": st.one_of(st.just("hi"), st.lists(st.just("hi"), max_size=3)),
                   "truncate": st.booleans(), "dimensions": st.integers(1, 64)}
    else:
        fields["prompt"] = st.sampled_from(["hi", ""])
    return shaped({"model": model_names(model)}, fields)


def rerank_body(model: str) -> st.SearchStrategy:
    """/v1/rerank, /v2/rerank, /rerank: Cohere's and Jina's shape (documents as strings or
    `{"text"}` objects)."""
    document = st.one_of(st.sampled_from(["a fox", "", "é"]), texts,
                         shaped({"text": st.just("a fox")}, {"title": st.just("t")}))
    return shaped({"query": st.sampled_from(["fox?", ""]),
                   "documents": st.lists(document, max_size=4)},
                  {"model": model_names(model), "top_n": st.integers(-1, 5),
                   "return_documents": st.booleans(), "keep_alive": st.sampled_from([-1, "1h"])})


def responses_body(model: str) -> st.SearchStrategy:
    item = st.one_of(
        shaped({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                "content": st.sampled_from(["hi", [{"type": "input_text", "text": "hi"}]])},
               {"type": st.just("message")}),
        shaped({"type": st.just("function_call"), "call_id": st.just("c1"),
                "name": st.just("f"), "arguments": st.sampled_from(['{"a": 1}', "{", "[]"])}, {}),
        shaped({"type": st.just("function_call_output"), "call_id": st.just("c1"),
                "output": st.just("42")}, {}))
    tool = shaped({"type": st.just("function"), "name": st.just("f")},
                  {"parameters": st.sampled_from([TOOL_PARAMS, {}]), "description": st.just("d")})
    text_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "name": "x", "schema": TOOL_PARAMS}])
    return shaped({"input": st.one_of(st.just("hi"), st.lists(item, min_size=1, max_size=3))}, {
        "model": model_names(model), "instructions": st.just("be brief"),
        "previous_response_id": st.sampled_from(["resp_nosuch", "x" * 300]),
        "stream": st.booleans(), "max_output_tokens": st.integers(1, 4),
        "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
        "tools": st.lists(tool, max_size=2), "tool_choice": st.sampled_from(
            ["auto", "none", "required", {"type": "function", "name": "f"}]),
        "parallel_tool_calls": st.booleans(), "text": st.builds(lambda f: {"format": f},
                                                                text_format),
        "include": st.just(["message.output_text.logprobs"]), "top_logprobs": st.integers(0, 3),
        "store": st.booleans(), "metadata": st.just({"k": "v"}), "user": st.just("u"),
        "truncation": st.sampled_from(["disabled", "auto"]), "reasoning": st.just({}),
        "background": st.just(False), "keep_alive": st.sampled_from([-1, "1h", "-1"])})


def pull_body(model: str) -> st.SearchStrategy:
    """Ollama's /api/pull, for names that are served or cannot be fetched (no repo ids)."""
    return shaped({"model": model_names(model)}, {
        "name": model_names(model), "insecure": st.booleans(), "stream": st.booleans()})


def harmless(body: Any) -> Any:
    """A generated body with what would legitimately change the daemon's state taken out:
    a keep_alive that unloads the model soon (0 or a few seconds) becomes "pin"."""
    if isinstance(body, dict) and "keep_alive" in body:
        try:
            seconds = parse_keep_alive(body["keep_alive"])
        except (ValueError, TypeError, OverflowError):
            seconds = None
        if seconds is not None and 0 <= seconds < 3600:
            body = {**body, "keep_alive": -1}
    return body


def _admin_body_is_harmless(decode: Callable[[bytes], Any]) -> Callable[[bytes], bool]:
    def check(body: bytes) -> bool:
        try:
            parsed = decode(body)
        except APIError:
            return True  # refused: exactly what the fuzzer wants to see
        except Exception:  # noqa: BLE001 - a crash in the check itself: let the daemon decide
            return True
        return parsed is None
    return check


def _model_body(body: bytes) -> Any:
    name = decode_body(body, ModelBody).model  # "" names the default model: excluded too
    return None if name and is_safe_model_name(name) else name  # an unknown name: a 404


def _drain_body(body: bytes) -> Any:
    return decode_body(body, DrainBody) if body.strip() else "drain"  # a valid drain: excluded


# ---------------------------------------------------------------- requests

_ODD_BODIES = [b"", b" ", b"null", b"[]", b"{}", b'"x"', b"1e999", b"NaN", b"{" * 1000,
               b"[" * 100_000, b"\xff\xfe{}", b"\xef\xbb\xbf{}", b'{"a":1,"a":2}',
               b'{"model": "x"', b"\x00" * 64, encode(deep(100_000, "{"))]
GARBAGE = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(0, len(_ODD_BODIES) - 1).map(_ODD_BODIES.__getitem__))
GET_PATHS = ["/v1/models", "/api/tags", "/api/ps", "/api/version", "/health", "/stats",
             "/metrics", "/"]


def _headers() -> st.SearchStrategy:
    return st.one_of(
        st.just({"Content-Type": "application/json"}), st.just({}),
        st.sampled_from([{"Content-Type": "text/plain"},
                         {"Content-Type": "application/json; charset=latin-1"},
                         {"Origin": "https://evil.example"}, {"Accept": "text/html"},
                         {"Content-Type": "multipart/form-data; boundary=x"},
                         {"Authorization": "Bearer " + "k" * 5000}]))


def _routes(*routes: tuple[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset(routes)


def _post(path: str, bodies: st.SearchStrategy) -> Endpoint:
    """A POST whose body is the endpoint's schema-shaped JSON, or (1 in 4) raw garbage."""
    encoded = bodies.map(harmless).map(encode)
    return Endpoint(_routes(("POST", path)), st.builds(
        FuzzRequest, st.just("POST"), st.just(path), _headers(),
        st.one_of(encoded, encoded, encoded, GARBAGE)))


QUERIES = st.one_of(st.just(""), st.text(max_size=30).map(  # what an HTTP client would send
    lambda q: "?" + "".join(c for c in q if c.isprintable() and c not in " #")),
    st.just("?" + "a=" + "x" * 5000))


NO_PARTS = st.just(())


def _get(template: str, parts: st.SearchStrategy = NO_PARTS,
         methods: Iterable[str] = ("GET", "GET", "HEAD", "POST", "DELETE", "PUT"),
         queries: st.SearchStrategy = QUERIES, serves: Iterable[str] = ("GET", "HEAD")
         ) -> Endpoint:
    """Requests to a route read without a body, `{}` in `template` filled from `parts`
    (tuples of path segments): every method in `methods` (those not in `serves`, the methods
    the route has, are a 405), with a garbage body now and then."""
    methods = list(methods)
    return Endpoint(_routes(*((m, template) for m in serves)), st.builds(
        lambda p, q, method, headers, body: FuzzRequest(method, template.format(*p) + q,
                                                        headers, body),
        parts, queries, st.sampled_from(methods), _headers(), st.one_of(st.just(b""), GARBAGE)))


# Path segments as a client might send them: ids that exist nowhere, long, odd, percent-encoded
# (at most 2,000 characters: with QUERIES' 5,000 the request line stays under --max-header,
# past which aiohttp's own parser answers a plain-text 400 before mlxd sees the request).
SEGMENTS = st.one_of(
    st.sampled_from(["resp_nosuch", "x" * 300, "x" * 2000, "%00", "..", "%2e%2e", "%2F",
                     "%C3%A9", "%FF", "a%20b", "-1", "0", "null", "{id}", "input_items"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@%", min_size=1,
            max_size=40))


def _model_segments(model: str) -> st.SearchStrategy:
    """A model id in a path (`/v1/models/{model:.+}` takes slashes too)."""
    return st.one_of(st.just(model), st.just(model + ":latest"), SEGMENTS,
                     st.sampled_from(["a/b", "a/b/c", "/" + "x" * 300, "x" * 255 + "/" + "y" * 255,
                                      "..%2F..%2Fetc"]))


def _admin(path: str, bodies: st.SearchStrategy, keep: Callable[[bytes], bool]) -> Endpoint:
    raw = st.one_of(bodies.map(encode), GARBAGE).filter(keep)
    return Endpoint(_routes(("POST", path)),
                    st.builds(FuzzRequest, st.just("POST"), st.just(path), _headers(), raw))


def _unknown_route() -> Endpoint:
    path = st.one_of(st.sampled_from(["/v1/", "/v1/chat", "/api/", "/admin/", "/v2/models",
                                      "/api/delete", "/v1/responses/", "/v1/embeddings/x"]),
                     st.text(alphabet=string.ascii_letters + string.digits + "-._~/!$&'()*+,;=:@",
                             max_size=40).map(lambda p: "/x/" + p))
    return Endpoint(frozenset(), st.builds(
        FuzzRequest, st.sampled_from(["GET", "POST", "PATCH", "DELETE", "OPTIONS"]), path,
        _headers(), GARBAGE))


def _all(model: str) -> dict[str, Endpoint]:
    """Every endpoint's generator, by name."""
    model_body = st.one_of(st.fixed_dictionaries({}, optional={"model": either(
        model_names(model)), "name": wild}), wild)
    admin_model = st.one_of(st.fixed_dictionaries({"model": bad_model_names(model)}), wild)
    drain = st.one_of(st.fixed_dictionaries({"timeout": st.one_of(
        st.floats(max_value=-0.001), st.sampled_from([1e30, 1e308]), texts, wild)}),
        st.fixed_dictionaries({"timeout": st.just(1), "unknown": wild}), wild)
    out = {
        "chat": _post("/v1/chat/completions", openai_body(model, chat=True)),
        "completions": _post("/v1/completions", openai_body(model, chat=False)),
        "messages": _post("/v1/messages", anthropic_body(model, count=False)),
        "count_tokens": _post("/v1/messages/count_tokens", anthropic_body(model, count=True)),
        "ollama_chat": _post("/api/chat", ollama_body(model, chat=True)),
        "ollama_generate": _post("/api/generate", ollama_body(model, chat=False)),
        "ollama_show": _post("/api/show", model_body),
        "ollama_pull": _post("/api/pull", pull_body(model)),
        "embeddings": _post("/v1/embeddings", embeddings_body(model, "openai")),
        "ollama_embed": _post("/api/embed", embeddings_body(model, "embed")),
        "ollama_embeddings": _post("/api/embeddings", embeddings_body(model, "embeddings")),
        "rerank": _post("/v1/rerank", rerank_body(model)),
        "rerank_v2": _post("/v2/rerank", rerank_body(model)),
        "rerank_alias": _post("/rerank", rerank_body(model)),
        "responses": _post("/v1/responses", responses_body(model)),
        "response": _get("/v1/responses/{}", st.tuples(SEGMENTS),
                         serves=("GET", "HEAD", "DELETE")),
        "response_input_items": _get(
            "/v1/responses/{}/input_items", st.tuples(SEGMENTS), ("GET", "GET", "HEAD", "POST"),
            st.one_of(QUERIES, st.builds(lambda k, v: f"?{k}={v}", st.sampled_from(
                ["limit", "order", "after", "before", "include"]), st.sampled_from(
                ["1", "0", "-1", "100", "101", "2147483648", "asc", "desc", "x", "", "msg_x"])))),
        "model": _get("/v1/models/{}", st.tuples(_model_segments(model)), ("GET", "GET", "HEAD",
                                                                            "POST", "DELETE")),
        "admin_load": _admin("/admin/models/load", admin_model,
                             _admin_body_is_harmless(_model_body)),
        "admin_unload": _admin("/admin/models/unload", admin_model,
                               _admin_body_is_harmless(_model_body)),
        "admin_reset": _admin("/admin/models/reset", admin_model,
                              _admin_body_is_harmless(_model_body)),
        "admin_drain": _admin("/admin/drain", drain, _admin_body_is_harmless(_drain_body)),
        "admin_other": Endpoint(_routes(("POST", "/admin/cache/flush"), ("POST", "/admin/undrain")),
                                st.builds(FuzzRequest, st.sampled_from(["POST", "GET"]),
                                          st.sampled_from(["/admin/cache/flush", "/admin/undrain",
                                                           "/admin/nothing"]),
                                          _headers(), GARBAGE)),
        "unknown_route": _unknown_route(),
    }
    for path in GET_PATHS:
        out["get " + path] = _get(path)
    return out


def endpoints(model: str) -> dict[str, st.SearchStrategy]:
    """Every endpoint's request strategy, by name."""
    return {name: e.requests for name, e in _all(model).items()}


def covered_routes(model: str = "tiny") -> frozenset[tuple[str, str]]:
    """Every (method, path template) some generator sends a request to."""
    return frozenset().union(*(e.routes for e in _all(model).values()))


def requests(endpoint: str, model: str) -> st.SearchStrategy:
    return endpoints(model)[endpoint]


def iter_requests(count: int, model: str, seed: int = 0, batch: int = 50
                  ) -> Iterator[FuzzRequest]:
    """`count` requests spread over every endpoint, without a test runner (for soak runs);
    the same seed gives the same requests."""
    names = sorted(endpoints(model))
    strategy = st.one_of(*(requests(n, model) for n in names))
    done = 0
    drawn: list[FuzzRequest] = []
    while done < count:
        n = min(batch, count - done)
        drawn.clear()

        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @seeded(seed * 1_000_003 + done)
        @given(strategy)
        def collect(req: FuzzRequest) -> None:
            drawn.append(req)

        collect()
        yield from drawn[:n]
        done += n


# ---------------------------------------------------------------- the check

def problems(req: FuzzRequest, status: int, headers: dict[str, str], body: bytes) -> list[str]:
    """What is wrong with this response to `req` (an empty list: nothing). `headers` with
    lower-case names."""
    if status >= 500:
        return [f"status {status}: {body[:300]!r}"]
    if req.method == "HEAD":
        return []
    dialect = dialect_of(req.path.split("?")[0])
    ctype = headers.get("content-type", "")
    if status < 400:
        if ctype.startswith(("text/event-stream", "application/x-ndjson")) \
                and _in_band_error(body, dialect):
            return [f"an in-band error in a {status} stream: {body[-300:]!r}"]
        return []
    if not ctype.startswith("application/json"):
        return [f"error status {status} with content-type {ctype!r}: {body[:200]!r}"]
    try:
        err = json.loads(body)
    except ValueError:
        return [f"error body is not JSON: {body[:200]!r}"]
    if not envelope_ok(err, dialect):
        return [f"not a {dialect} error envelope: {str(err)[:300]}"]
    return []


def _in_band_error(body: bytes, dialect: str) -> bool:
    """A stream that broke off with an error event (after admission, only a server fault)."""
    if dialect == "anthropic" or b"event: response.created\n" in body:  # the Responses API
        return b"event: error\n" in body
    if dialect == "ollama":
        return any(line.startswith(b'{"error"') for line in body.splitlines())
    return b'data: {"error"' in body


def envelope_ok(err: Any, dialect: str) -> bool:
    if dialect == "anthropic":
        e = err.get("error") if isinstance(err, dict) else None
        return err.get("type") == "error" and isinstance(e, dict) \
            and isinstance(e.get("type"), str) and isinstance(e.get("message"), str)
    if dialect == "ollama":
        return isinstance(err, dict) and isinstance(err.get("error"), str)
    e = err.get("error") if isinstance(err, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) \
        and isinstance(e.get("type"), str) and "param" in e and "code" in e


__all__ = ["NOT_FUZZED", "Endpoint", "FuzzRequest", "covered_routes", "encode", "endpoints",
           "envelope_ok", "iter_requests", "problems", "requests"]
