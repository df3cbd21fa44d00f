"""OpenAI request bodies as msgspec Structs, and their translation into a dialect-neutral
request: chat messages or a prompt, and a `SamplingRequest` (runs in the proxy)."""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.proxy.bounds import (
    MAX_COUNT,
    MAX_IDENT_CHARS,
    Duration,
    Ident,
    ModelName,
    Seconds,
    Seed,
    SmallInt,
    StopString,
    TokenCount,
    TokenId,
    TopK,
    clip,
    loads,
)
from mlxd.proxy.core.images import ImageRef, from_url
from mlxd.proxy.core.sampling import CheckedSampling, Defaults, SamplingRequest, check_sampling
from mlxd.proxy.errors import bad_request


class ImageURL(msgspec.Struct):
    url: str
    detail: Ident | None = None


class ContentPart(msgspec.Struct):
    type: Ident
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(msgspec.Struct):
    role: Ident
    content: str | list[ContentPart] | None = None
    name: Ident | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: Ident | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


MAX_CHOICES = 16  # `n`
MAX_LOGIT_BIAS = 1024  # entries of `logit_bias`


class CommonFields(msgspec.Struct, kw_only=True):
    """The fields chat completions and completions share. Every optional field takes an
    explicit null, meaning what leaving it out means."""
    model: ModelName | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    n: SmallInt | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: Ident | None = None
    keep_alive: Seconds | Duration | None = None  # seconds or "5m"; 0 unloads after, -1 pins


# Fields OpenAI has that mlxd does not do: a 400 naming the field, never silently ignored.
UNSUPPORTED_CHAT_FIELDS = {
    "functions": "the legacy `functions` and `function_call` are not supported; use `tools` "
                 "and `tool_choice`",
    "function_call": "the legacy `functions` and `function_call` are not supported; use "
                     "`tools` and `tool_choice`",
    "audio": "`audio` output is not supported",
    "prediction": "`prediction` (predicted outputs) is not supported",
    "web_search_options": "`web_search_options` (web search) is not supported",
}


class ChatRequest(CommonFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    tools: list[dict] | None = None
    tool_choice: Ident | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    logprobs: bool | None = None
    top_logprobs: SmallInt | None = None
    modalities: list[Ident] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(CommonFields, kw_only=True):
    prompt: str | list[str | TokenId]
    echo: bool | None = None
    best_of: SmallInt | None = None
    suffix: str | None = None
    logprobs: SmallInt | None = None


def check_chat_fields(req: ChatRequest) -> None:
    """A 400 for each field mlxd does not do (rather than ignoring it)."""
    for name, why in UNSUPPORTED_CHAT_FIELDS.items():
        if getattr(req, name) is not None:
            raise bad_request(why, param=name)
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise bad_request("`modalities`: only `text` is supported", param="modalities")


def choices(req: ChatRequest | CompletionRequest) -> int:
    """`n`: how many answers to generate for the one prompt (null: 1)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"`n` must be between 1 and {MAX_CHOICES}", param="n")
    return n


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids (JSON object keys, so strings) -> a bias in
    [-100, 100] added to that token's logit (-100 in effect bans it, 100 forces it)."""
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 11 else -1
        if not 0 <= token <= MAX_COUNT:
            raise bad_request(f"`logit_bias` keys must be token ids, got {clip(key, 40)!r}",
                              param="logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise bad_request("`logit_bias` values must be between -100 and 100",
                              param="logit_bias")
        out[token] = float(bias)
    if len(out) > MAX_LOGIT_BIAS:
        raise bad_request(f"`logit_bias` takes at most {MAX_LOGIT_BIAS} tokens",
                          param="logit_bias")
    return out


def chat_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise bad_request("`messages` must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of system, user, "
                              "assistant, developer, tool", param=f"messages[{i}].role")
        content: str | list[dict]
        if isinstance(m.content, list):
            parts: list[dict] = []
            for part in m.content:
                if part.type == "image_url" and part.image_url is not None:
                    parts.append({"type": "image"})  # its image: chat_images(req)
                elif part.type == "text" and part.text is not None:
                    parts.append({"type": "text", "text": part.text})
                else:
                    raise bad_request(f"messages[{i}] has a {part.type!r} content part; only "
                                      "text and image_url parts are supported",
                                      param=f"messages[{i}].content")
            content = parts if any(p["type"] == "image" for p in parts) \
                else "".join(p["text"] for p in parts)
        else:
            content = m.content or ""
        role = "system" if m.role == "developer" else m.role
        msg: dict = {"role": role, "content": content}
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}]: a tool message needs `tool_call_id`",
                                  param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls",
                                  param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        out.append(msg)
    known = {c["id"] for turn in out for c in turn.get("tool_calls", [])}
    for i, turn in enumerate(out):
        if turn["role"] == "tool" and turn["tool_call_id"] not in known:
            raise bad_request(f"messages[{i}].tool_call_id {turn['tool_call_id']!r} answers no "
                              "tool call of an earlier assistant message",
                              param=f"messages[{i}].tool_call_id")
    if all(not turn["content"] and not turn.get("tool_calls") for turn in out):
        raise bad_request("every message is empty: the prompt is empty", param="messages")
    return out


def chat_images(req: ChatRequest) -> tuple[ImageRef, ...]:
    """The `image_url` parts' images, in the order `chat_messages` marks them."""
    return tuple(from_url(part.image_url.url, f"messages[{i}].content[{j}].image_url")
                 for i, m in enumerate(req.messages) if isinstance(m.content, list)
                 for j, part in enumerate(m.content)
                 if part.type == "image_url" and part.image_url is not None)


def _template_call(call: Any, i: int) -> dict:
    """An assistant tool call, with its arguments as an object (what chat templates expect)."""
    where = f"messages[{i}].tool_calls"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not _is_ident(fn.get("name")) \
            or not _is_ident(call.get("id"), empty=True):
        raise bad_request(f"{where}: each needs `id` and `function.name` (strings of at most "
                          f"{MAX_IDENT_CHARS} characters)", param=where)
    args = fn.get("arguments") or "{}"
    parsed = loads(args, f"{where}: `arguments`") if isinstance(args, str) else args
    if not isinstance(parsed, dict):
        raise bad_request(f"{where}: `arguments` must be a JSON object", param=where)
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": parsed}}


def _is_ident(value: Any, empty: bool = False) -> bool:
    return isinstance(value, str) and (empty or bool(value)) and len(value) <= MAX_IDENT_CHARS


def sampling(req: ChatRequest | CompletionRequest, defaults: Defaults) -> CheckedSampling:
    """OpenAI's sampling fields, checked: chat's `max_completion_tokens` wins over the older
    `max_tokens`."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    return check_sampling(SamplingRequest(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        logprobs=logprobs_wanted(req), max_tokens=max_tokens,
        logit_bias=logit_bias(req.logit_bias)), defaults)


def logprobs_wanted(req: ChatRequest | CompletionRequest) -> int:
    """-1, or how many alternatives to report per token (chat: logprobs + top_logprobs in
    0..20; completions: logprobs in 0..5)."""
    if isinstance(req, ChatRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= 20:
            raise bad_request("`top_logprobs` must be in 0..20", param="top_logprobs")
        if top is not None and not req.logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        return (top or 0) if req.logprobs else -1
    if req.logprobs is None:
        return -1
    if not 0 <= req.logprobs <= 5:
        raise bad_request("`logprobs` must be in 0..5", param="logprobs")
    return req.logprobs


def completion_prompt(req: CompletionRequest) -> tuple[str | None, list[int] | None]:
    if req.best_of not in (None, 1):
        raise bad_request("`best_of` is not supported", param="best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("`echo` with `logprobs` (the prompt's log-probabilities) is not "
                          "supported", param="echo")
    p = req.prompt
    if isinstance(p, str):
        if not p:
            raise bad_request("`prompt` is empty", param="prompt")
        return p, None
    if not p:
        raise bad_request("`prompt` is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return None, [x for x in p if isinstance(x, int)]
    if len(p) != 1 or not isinstance(p[0], str):
        raise bad_request("only one prompt per request is supported", param="prompt")
    if not p[0]:
        raise bad_request("`prompt` is empty", param="prompt")
    return str(p[0]), None
