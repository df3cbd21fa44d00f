"""OpenAI request bodies as msgspec Structs, and their translation into an engine request."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.protocol.messages import SamplingParams
from mlxd.proxy.bounds import (MAX_IDENT_CHARS, Duration, Ident, ModelName, Seconds, Seed,
                               SmallInt, StopString, TokenCount, TokenId, TopK, decode_body, loads)
from mlxd.proxy.errors import APIError, bad_request

MAX_STOP_STRINGS = 16


class ContentPart(msgspec.Struct):
    type: Ident
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Ident
    content: str | list[ContentPart] | None = None
    name: Ident | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: Ident | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: ModelName | None = None
    stream: bool = False
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
    n: SmallInt = 1
    user: Ident | None = None
    keep_alive: Seconds | Duration | None = None  # seconds or "5m"; 0 unloads after, -1 pins


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    tools: list[dict] | None = None
    tool_choice: Ident | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    logprobs: bool | None = None
    top_logprobs: SmallInt | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | TokenId]
    echo: bool = False
    best_of: SmallInt | None = None
    suffix: str | None = None
    logprobs: SmallInt | None = None


@dataclass
class Defaults:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512


def chat_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise bad_request("`messages` must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of system, user, "
                              "assistant, developer, tool", param=f"messages[{i}].role")
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}] has a {part.type!r} content part; only "
                                      "text parts are supported", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
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
    known = {c["id"] for m in out for c in m.get("tool_calls", [])}
    for i, m in enumerate(out):
        if m["role"] == "tool" and m["tool_call_id"] not in known:
            raise bad_request(f"messages[{i}].tool_call_id {m['tool_call_id']!r} answers no "
                              "tool call of an earlier assistant message",
                              param=f"messages[{i}].tool_call_id")
    if all(not m["content"] and not m.get("tool_calls") for m in out):
        raise bad_request("every message is empty: the prompt is empty", param="messages")
    return out


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


def check_max_tokens(max_tokens: int | None, context_length: int) -> None:
    """An explicit max_tokens beyond the model's context is the client's error (a default one is
    clamped by the engine). Needs the model's context, so it runs once the engine is known."""
    if max_tokens is not None and context_length and max_tokens > context_length:
        raise bad_request(f"`max_tokens` is {max_tokens}, more than this model's context of "
                          f"{context_length} tokens", param="max_tokens")


def sampling_params(req: _Sampling, defaults: Defaults, max_tokens: int | None) -> SamplingParams:
    """Every check that needs no engine: bad input is refused before a model is touched."""
    if req.n != 1:
        raise bad_request("only n=1 is supported", param="n")
    temperature = defaults.temperature if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("`temperature` must be between 0 and 2", param="temperature")
    top_p = defaults.top_p if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request("`top_p` must be in (0, 1]", param="top_p")
    top_k = defaults.top_k if req.top_k is None else req.top_k
    if top_k < 0:
        raise bad_request("`top_k` must be >= 0", param="top_k")
    min_p = req.min_p or 0.0
    if not 0.0 <= min_p <= 1.0:
        raise bad_request("`min_p` must be in [0, 1]", param="min_p")
    rep = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not 0.0 < rep <= 10.0:
        raise bad_request("`repetition_penalty` must be in (0, 10]", param="repetition_penalty")
    if max_tokens is None:
        max_tokens = defaults.max_tokens
    elif max_tokens < 1:
        raise bad_request(f"`max_tokens` must be at least 1, got {max_tokens}", param="max_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request(f"`stop` takes at most {MAX_STOP_STRINGS} non-empty strings",
                          param="stop")
    presence = req.presence_penalty or 0.0
    frequency = req.frequency_penalty or 0.0
    if not (-2.0 <= presence <= 2.0 and -2.0 <= frequency <= 2.0):
        raise bad_request("`presence_penalty` and `frequency_penalty` must be in [-2, 2]")
    seed = req.seed if req.seed is not None else random.getrandbits(63)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repetition_penalty=rep, seed=seed & ((1 << 63) - 1),
                          max_tokens=max_tokens, stop=stops, presence_penalty=presence,
                          frequency_penalty=frequency, logprobs=_logprobs_wanted(req))


def _logprobs_wanted(req: _Sampling) -> int:
    """-1, or how many alternatives to report per token (chat: logprobs + top_logprobs in
    0..20; completions: logprobs in 0..5)."""
    logprobs = getattr(req, "logprobs", None)
    top = getattr(req, "top_logprobs", None)
    if isinstance(req, ChatRequest):
        if top is not None and not 0 <= top <= 20:
            raise bad_request("`top_logprobs` must be in 0..20", param="top_logprobs")
        if top is not None and not logprobs:
            raise bad_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        return (top or 0) if logprobs else -1
    if logprobs is None:
        return -1
    if not 0 <= logprobs <= 5:
        raise bad_request("`logprobs` must be in 0..5", param="logprobs")
    return logprobs


def completion_prompt(req: CompletionRequest) -> tuple[str | None, list[int] | None]:
    if req.echo:
        raise bad_request("`echo` is not supported", param="echo")
    if req.best_of not in (None, 1):
        raise bad_request("`best_of` is not supported", param="best_of")
    if req.suffix:
        raise bad_request("`suffix` is not supported", param="suffix")
    p = req.prompt
    if isinstance(p, str):
        if not p:
            raise bad_request("`prompt` is empty", param="prompt")
        return p, None
    if not p:
        raise bad_request("`prompt` is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return None, list(p)  # type: ignore[arg-type]
    if len(p) != 1 or not isinstance(p[0], str):
        raise bad_request("only one prompt per request is supported", param="prompt")
    if not p[0]:
        raise bad_request("`prompt` is empty", param="prompt")
    return str(p[0]), None


__all__ = ["APIError", "ChatRequest", "CompletionRequest", "Defaults", "chat_messages",
           "check_max_tokens", "completion_prompt", "decode_body", "sampling_params"]
