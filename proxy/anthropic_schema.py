"""Anthropic Messages request bodies as msgspec Structs, and their translation into chat
messages and sampling parameters for the engine."""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.protocol.messages import SamplingParams
from mlxd.proxy.errors import bad_request
from mlxd.proxy.openai_schema import Defaults, _Sampling, sampling_params


class Block(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Any = None
    thinking: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class _Common(msgspec.Struct, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None


class MessagesRequest(_Common, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    service_tier: str | None = None


class CountTokensRequest(_Common, kw_only=True):
    thinking: dict | None = None


def _text_of(blocks: str | list[Block], where: str, role: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for i, b in enumerate(blocks):
        if b.type == "text":
            if b.text is None:
                raise bad_request(f"{where}.content[{i}]: a text block needs `text`")
            texts.append(b.text)
        elif b.type in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not fed back to the model
        elif b.type in ("tool_use", "tool_result"):
            raise bad_request(f"{where}.content[{i}]: `{b.type}` blocks are not supported yet "
                              "(mlxd has no tool calling yet)")
        else:
            raise bad_request(f"{where}.content[{i}]: `{b.type}` blocks are not supported; "
                              "only text")
    return "".join(texts)


def chat_messages(req: _Common) -> list[dict]:
    if req.tools:
        raise bad_request("`tools` are not supported yet (mlxd has no tool calling yet)")
    if not req.messages:
        raise bad_request("messages: at least one message is required")
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system", "system")})
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise bad_request(f"messages.{i}.role: {m.role!r} is not one of user, assistant "
                              "(the system prompt goes in `system`)")
        text = _text_of(m.content, f"messages.{i}", m.role)
        if out and out[-1]["role"] == m.role:  # consecutive turns of one role are one turn
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": m.role, "content": text})
    if all(not m["content"] for m in out):
        raise bad_request("messages: every message is empty")
    return out


def sampling(req: MessagesRequest, defaults: Defaults) -> SamplingParams:
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens: must be at least 1, got {req.max_tokens}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise bad_request("temperature: must be between 0 and 1")
    return sampling_params(_Sampling(temperature=req.temperature, top_p=req.top_p,
                                     top_k=req.top_k, stop=req.stop_sequences,
                                     max_tokens=req.max_tokens), defaults, req.max_tokens)


def stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic counts cache reads apart: input + cache_read = the whole prompt."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
