"""Anthropic Messages request bodies as msgspec Structs, and their translation into chat
messages and a dialect-neutral `SamplingRequest` (runs in the proxy)."""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.proxy.bounds import MAX_IDENT_CHARS, Ident, ModelName, StopString, TokenCount, TopK
from mlxd.proxy.core.constraints import Tool, forced_tools, parse_tools
from mlxd.proxy.core.images import ImageRef
from mlxd.proxy.core.sampling import CheckedSampling, Defaults, SamplingRequest, check_sampling
from mlxd.proxy.errors import bad_request


class ImageSource(msgspec.Struct, kw_only=True):
    type: Ident  # "base64" | "url"
    media_type: Ident | None = None
    data: str | None = None
    url: str | None = None


class Block(msgspec.Struct, kw_only=True):
    type: Ident
    source: ImageSource | None = None
    text: str | None = None
    id: Ident | None = None
    name: Ident | None = None
    input: Any = None
    tool_use_id: Ident | None = None
    content: Any = None
    thinking: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: Ident
    content: str | list[Block]


class CommonFields(msgspec.Struct, kw_only=True):
    """The fields a message and a token count share."""
    model: ModelName
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None


class MessagesRequest(CommonFields, kw_only=True):
    """Every optional field takes an explicit null, meaning what leaving it out means."""
    max_tokens: TokenCount
    stop_sequences: list[StopString] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    service_tier: Ident | None = None
    output_config: dict | None = None  # `format` (a JSON schema the answer follows), `effort`
    output_format: dict | None = None  # the structured-outputs beta's spelling of the format
    mcp_servers: Any = None
    container: Any = None


def output_format(req: MessagesRequest) -> dict | None:
    """The JSON schema the answer must follow (`output_config.format`, or the beta's
    `output_format`), or None."""
    config = req.output_config or {}
    fmt = config.get("format") or req.output_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise bad_request('output_config.format: must be {"type": "json_schema", "schema": '
                          '{...}}')
    return fmt["schema"]


def check_fields(req: MessagesRequest) -> None:
    """A 400 for each field mlxd does not do (rather than ignoring it)."""
    if req.mcp_servers is not None:
        raise bad_request("mcp_servers: MCP connectors are not supported")
    if req.container is not None:
        raise bad_request("container: code execution containers are not supported")


class CountTokensRequest(CommonFields, kw_only=True):
    thinking: dict | None = None


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise bad_request(f"{where}: tool_result content must be a string or text blocks")


def chat_messages(req: CommonFields) -> list[dict]:
    """Anthropic turns as chat-template messages: tool_use blocks become the assistant's
    tool_calls, tool_result blocks become `tool` messages answering them."""
    if not req.messages:
        raise bad_request("messages: at least one message is required")
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _plain(req.system, "system")})
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: {m.role!r} is not one of user, assistant "
                              "(the system prompt goes in `system`)")
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) \
            else m.content
        texts, calls, results = [], [], []
        parts: list[dict] = []  # with images: the content as parts (see chat_images)
        for j, b in enumerate(blocks):
            at = f"{where}.content.{j}"
            if b.type == "text":
                if b.text is None:
                    raise bad_request(f"{at}: a text block needs `text`")
                texts.append(b.text)
                parts.append({"type": "text", "text": b.text})
            elif b.type == "image" and m.role == "user":
                _image_ref(b, at)
                parts.append({"type": "image"})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not fed back to the model
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name or not isinstance(b.input, dict):
                    raise bad_request(f"{at}: tool_use needs `id`, `name` and an `input` "
                                      "object")
                called.add(b.id)
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": b.input}})
            elif b.type == "tool_result" and m.role == "user":
                if b.tool_use_id not in called:
                    raise bad_request(f"{at}: tool_result for {b.tool_use_id!r}, which no "
                                      "earlier tool_use block has")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": _result_text(b.content, at)})
            else:
                raise bad_request(f"{at}: `{b.type}` blocks are not supported in a "
                                  f"{m.role} message")
        text: str | list[dict] = "".join(texts)
        if any(p["type"] == "image" for p in parts):
            text = parts
        if results:
            out.extend(results)
            if text:
                out.append({"role": "user", "content": text})
        elif calls:
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif out and out[-1]["role"] == m.role and "tool_calls" not in out[-1]:
            out[-1]["content"] = _joined(out[-1]["content"], text)  # one role's turns: one
        else:
            out.append({"role": m.role, "content": text})
    if all(not m["content"] and not m.get("tool_calls") for m in out):
        raise bad_request("messages: every message is empty")
    return out


def _joined(a: str | list[dict], b: str | list[dict]) -> str | list[dict]:
    """Two turns' contents as one, with a blank line between."""
    if isinstance(a, str) and isinstance(b, str):
        return a + "\n\n" + b
    def parts(c: str | list[dict]) -> list[dict]:
        return [{"type": "text", "text": c}] if isinstance(c, str) else c
    return [*parts(a), {"type": "text", "text": "\n\n"}, *parts(b)]


def _image_ref(b: Block, at: str) -> ImageRef:
    src = b.source
    if src is not None and src.type == "base64" and src.data is not None:
        return ImageRef(src.data, at)
    if src is not None and src.type == "url" and src.url is not None:
        if not src.url.startswith(("http://", "https://")):
            raise bad_request(f"{at}: an image url must be http(s)")
        return ImageRef(src.url, at, url=True)
    raise bad_request(f"{at}: an image block needs a `source` of type base64 (with `data`) "
                      "or url (with `url`)")


def chat_images(req: CommonFields) -> tuple[ImageRef, ...]:
    """The user messages' image blocks, in the order `chat_messages` marks them."""
    return tuple(_image_ref(b, f"messages.{i}.content.{j}")
                 for i, m in enumerate(req.messages) if m.role == "user"
                 and not isinstance(m.content, str)
                 for j, b in enumerate(m.content) if b.type == "image")


def _plain(blocks: str | list[Block], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if any(b.type != "text" or b.text is None for b in blocks):
        raise bad_request(f"{where}: only text blocks are allowed")
    return "".join(b.text or "" for b in blocks)


def tools_and_choice(req: CommonFields) -> tuple[list[Tool], list[Tool] | None, bool]:
    """(tools, the tools a call is forced among or None, whether tools are offered at all)."""
    tools = []
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            raise bad_request(f"tools.{i}: only custom tools ({{\"name\", \"input_schema\"}}) "
                              "are supported")
        name, description = t.get("name"), t.get("description", "")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_IDENT_CHARS:
            raise bad_request(f"tools.{i}.name: a string of 1 to {MAX_IDENT_CHARS} characters "
                              "is required")
        if not isinstance(description, str):
            raise bad_request(f"tools.{i}.description: must be a string")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools.{i}.input_schema: a JSON schema object is required")
        tools.append({"type": "function", "function": {
            "name": name, "description": description, "parameters": schema}})
    parsed = parse_tools(tools, "tools")
    choice = req.tool_choice or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "none":
        return parsed, None, False
    if kind == "auto":
        return parsed, None, bool(parsed)
    if kind == "any":
        return parsed, forced_tools(parsed, "required"), True
    if kind == "tool":
        return parsed, forced_tools(parsed, {"type": "tool", "name": choice.get("name")}), True
    raise bad_request("tool_choice: type must be auto, any, tool or none")


def sampling(req: MessagesRequest, defaults: Defaults) -> CheckedSampling:
    """Anthropic's sampling fields, checked: `max_tokens` is required (so always the client's
    own), `temperature` is in [0, 1], stop strings are `stop_sequences`."""
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens: must be at least 1, got {req.max_tokens}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise bad_request("temperature: must be between 0 and 1")
    return check_sampling(SamplingRequest(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        stop=list(req.stop_sequences or []), max_tokens=req.max_tokens), defaults)


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
