"""Ollama request bodies as msgspec Structs, and their translation into chat messages, a
grammar for `format` and a dialect-neutral `SamplingRequest` (runs in the proxy)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from mlxd.proxy.bounds import (
    MAX_COUNT,
    MAX_IDENT_CHARS,
    Duration,
    Ident,
    ModelName,
    Seconds,
    Seed,
    StopString,
    TokenId,
    TopK,
)
from mlxd.proxy.core import constraints
from mlxd.proxy.core.images import ImageRef
from mlxd.proxy.core.sampling import CheckedSampling, Defaults, SamplingRequest, check_sampling
from mlxd.proxy.engines.router import Router
from mlxd.proxy.errors import APIError, bad_request

NumPredict = Annotated[int, msgspec.Meta(ge=-2, le=MAX_COUNT)]  # -1: until done, -2: fill context


class Options(msgspec.Struct, kw_only=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    num_predict: NumPredict | None = None
    stop: list[StopString] | None = None
    seed: Seed | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Ident
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict] | None = None
    thinking: str | None = None


class CommonFields(msgspec.Struct, kw_only=True):
    """The fields `/api/chat` and `/api/generate` share. Every optional field takes an
    explicit null, meaning what leaving it out means."""
    model: ModelName
    stream: bool | None = None  # null or left out: true
    format: Any = None
    options: Options | None = None
    keep_alive: Seconds | Duration | None = None
    think: Any = None


class ChatRequest(CommonFields, kw_only=True):
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None


class GenerateRequest(CommonFields, kw_only=True):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[TokenId] | None = None


class ModelRequest(msgspec.Struct, kw_only=True):
    model: ModelName | None = None
    name: ModelName | None = None  # older clients


class PullRequest(ModelRequest, kw_only=True):
    stream: bool | None = None  # null or left out: true
    insecure: bool | None = None  # Ollama's registry option: nothing to do here


def served_name(name: str, router: Router) -> str:
    """Ollama clients say `name:latest`; mlxd's names carry no tag."""
    if name.endswith(":latest"):
        try:
            router.lookup(name)
        except APIError:
            return name[:-len(":latest")]
    return name


def chat_messages(req: ChatRequest) -> list[dict]:
    """Ollama's messages as chat-template messages (empty: the request only loads a model)."""
    msgs = []
    for i, m in enumerate(req.messages or []):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of system, user, "
                              "assistant, tool")
        msg: dict = {"role": m.role, "content": with_images(m.content or "", m.images)}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        msgs.append(msg)
    return msgs


def with_images(text: str, images: list[str] | None) -> str | list[dict]:
    """A message's content with its images (Ollama puts them before the text)."""
    if not images:
        return text
    return [*({"type": "image"} for _ in images), {"type": "text", "text": text}]


def chat_images(req: ChatRequest) -> tuple[ImageRef, ...]:
    """The messages' base64 `images`, in the order `chat_messages` marks them."""
    return tuple(ImageRef(data, f"messages[{i}].images[{j}]")
                 for i, m in enumerate(req.messages or []) for j, data in enumerate(m.images or []))


def generate_images(req: GenerateRequest) -> tuple[ImageRef, ...]:
    return tuple(ImageRef(data, f"images[{j}]") for j, data in enumerate(req.images or []))


def _template_call(call: Any, i: int) -> dict:
    """An earlier assistant tool call ({"function": {"name", "arguments": {...}}})."""
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name", "") if isinstance(fn, dict) else None
    args = (fn.get("arguments") or {}) if isinstance(fn, dict) else None
    if not isinstance(name, str) or len(name) > MAX_IDENT_CHARS or not isinstance(args, dict):
        raise bad_request(f"messages[{i}].tool_calls: each needs `function` with a `name` (at "
                          f"most {MAX_IDENT_CHARS} characters) and an `arguments` object")
    return {"type": "function", "function": {"name": name, "arguments": args}}


def format_grammar(fmt: Any) -> str | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return constraints.schema_grammar(constraints.ANY_OBJECT, "format")
    if isinstance(fmt, dict):
        return constraints.schema_grammar(fmt, "format")
    raise bad_request('`format` must be "json" or a JSON schema object')


def sampling(req: CommonFields, defaults: Defaults) -> CheckedSampling:
    """Ollama's `options`, checked: `num_predict` -1 (until done) and -2 (fill the context)
    mean no max_tokens of the client's own; `repeat_penalty` is the repetition penalty."""
    o = req.options or Options()
    n = o.num_predict
    if n == 0:
        raise bad_request("options.num_predict must not be 0")
    return check_sampling(SamplingRequest(
        temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
        repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty, seed=o.seed, stop=list(o.stop or []),
        max_tokens=None if n is None or n < 0 else n), defaults)
