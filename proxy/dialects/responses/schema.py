"""OpenAI's Responses API request (`POST /v1/responses`) as a msgspec Struct, and its
translation into the neutral generation: `input` items become chat messages (function calls
and their outputs included; `input_image` parts images, as chat's `image_url` parts are),
`instructions` the system message, function tools go through the tools path, `text.format`
through the grammar path (runs in the proxy). Every optional field
takes an explicit null, meaning what leaving it out means."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxd.proxy.bounds import (
    MAX_IDENT_CHARS,
    Duration,
    Ident,
    ModelName,
    Seconds,
    SmallInt,
    TokenCount,
    clip,
    loads,
)
from mlxd.proxy.core import constraints
from mlxd.proxy.core.images import ImageRef, from_url
from mlxd.proxy.core.sampling import CheckedSampling, Defaults, SamplingRequest, check_sampling
from mlxd.proxy.errors import bad_request

LOGPROBS = "message.output_text.logprobs"
# `include` values mlxd honours (the reasoning text is never encrypted: it is in the item)
INCLUDABLE = {LOGPROBS, "reasoning.encrypted_content"}

# Fields the Responses API has that mlxd does not do: a 400 naming the field when set.
UNSUPPORTED_FIELDS = {
    "conversation": "`conversation` (server-side conversations) is not supported; use "
                    "`previous_response_id`",
    "prompt": "`prompt` (stored prompt templates) is not supported",
    "max_tool_calls": "`max_tool_calls` is not supported",
    "context_management": "`context_management` is not supported",
    "moderation": "`moderation` is not supported",
    "image": "`image` is not supported",
    "access_programs": "`access_programs` is not supported",
    "background_options": "`background_options` is not supported",
    "prompt_cache_options": "`prompt_cache_options` is not supported",
}


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: ModelName | None = None
    input: str | list[dict] | None = None
    instructions: str | None = None
    previous_response_id: Ident | None = None
    stream: bool | None = None
    max_output_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: Ident | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    include: list[Ident] | None = None
    top_logprobs: SmallInt | None = None
    truncation: Ident | None = None
    reasoning: dict | None = None
    store: bool | None = None
    background: bool | None = None
    # bookkeeping: accepted, no effect
    metadata: dict[str, str] | None = None
    user: Ident | None = None
    safety_identifier: Ident | None = None
    prompt_cache_key: Ident | None = None
    prompt_cache_retention: Ident | None = None
    service_tier: Ident | None = None
    stream_options: dict | None = None
    keep_alive: Seconds | Duration | None = None  # mlxd's, as in the other endpoints
    # not supported: a 400 when set
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None


def check_fields(req: ResponsesRequest) -> None:
    for name, why in UNSUPPORTED_FIELDS.items():
        if getattr(req, name) is not None:
            raise bad_request(why, param=name)
    if req.background:
        raise bad_request("`background` responses are not supported", param="background")
    if req.truncation not in (None, "disabled"):
        raise bad_request("`truncation` must be `disabled`: mlxd does not drop input to fit "
                          "the context (a prompt that does not fit is a 400)",
                          param="truncation")
    for key, value in (req.reasoning or {}).items():
        if value is not None:
            raise bad_request(f"`reasoning.{clip(key, 40)}` is not supported: a thinking model "
                              "thinks as its chat template has it (the thinking arrives as a "
                              "reasoning item)", param=f"reasoning.{clip(key, 40)}")
    unknown = [v for v in req.include or () if v not in INCLUDABLE]
    if unknown:
        raise bad_request(f"`include` value {clip(unknown[0], 80)!r} is not supported (only "
                          f"{', '.join(sorted(INCLUDABLE))})", param="include")


def sampling(req: ResponsesRequest, defaults: Defaults) -> CheckedSampling:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise bad_request("`top_logprobs` must be in 0..20", param="top_logprobs")
    wanted = LOGPROBS in (req.include or ()) or top is not None
    return check_sampling(SamplingRequest(
        temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_output_tokens,
        logprobs=(top or 0) if wanted else -1), defaults)


@dataclass(frozen=True)
class Tools:
    """The request's function tools: for the chat template, and the ones a call is forced
    among (None: the model decides)."""
    template: list[dict] | None
    forced: list[constraints.Tool] | None


def tools(req: ResponsesRequest) -> Tools:
    chat_shaped = []
    for i, t in enumerate(req.tools or ()):
        kind = t.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}]: tools of type {clip(str(kind), 60)!r} are not "
                              "supported (only `function`)", param=f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not 0 < len(t["name"]) <= MAX_IDENT_CHARS:
            raise bad_request(f"tools[{i}].name must be a string of 1 to {MAX_IDENT_CHARS} "
                              "characters", param=f"tools[{i}].name")
        chat_shaped.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("parameters")}})
    parsed = constraints.parse_tools(chat_shaped)
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"`tool_choice` of type {clip(str(choice.get('type')), 60)!r} is "
                              "not supported (auto, none, required or a function)",
                              param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    forced = constraints.forced_tools(parsed, choice)
    template = [t.as_template_tool() for t in parsed] if parsed and choice != "none" else None
    return Tools(template, forced)


def text_format(req: ResponsesRequest) -> tuple[dict, str | None]:
    """`text.format` as the response echoes it, and its grammar (None: free text)."""
    text = req.text or {}
    for key, value in text.items():
        if key != "format" and value is not None:
            raise bad_request(f"`text.{clip(key, 40)}` is not supported",
                              param=f"text.{clip(key, 40)}")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, constraints.schema_grammar(constraints.ANY_OBJECT, "text.format")
    if kind == "json_schema":
        if "schema" not in fmt:
            raise bad_request("`text.format.schema` is required", param="text.format.schema")
        return fmt, constraints.schema_grammar(fmt["schema"], "text.format.schema")
    raise bad_request("`text.format.type` must be text, json_object or json_schema",
                      param="text.format.type")


def input_messages(raw: str | list[dict] | None, earlier: list[dict]) -> list[dict]:
    """`input` as chat messages; `earlier` (a previous response's conversation) is what
    function call outputs may answer."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}] if raw else []
    out: list[dict] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            _add_call(out, item, where)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _ident(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier thinking: chat templates drop it from history as well
        else:
            raise bad_request(f"{where}: items of type {clip(str(kind), 60)!r} are not "
                              "supported (message, function_call, function_call_output, "
                              "reasoning)", param=f"{where}.type")
    known = {c["id"] for turn in (*earlier, *out) for c in turn.get("tool_calls", ())}
    for i, turn in enumerate(out):
        if turn["role"] == "tool" and turn["tool_call_id"] not in known:
            raise bad_request(f"a function_call_output's call_id {turn['tool_call_id']!r} "
                              "answers no earlier function_call", param=f"input[{i}].call_id")
    return out


ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}


def input_items(raw: str | list[dict] | None, new_id: Callable[[str], str]) -> list[dict]:
    """`input` (already checked by `input_messages`) as the Responses API lists it back
    (`GET /v1/responses/{id}/input_items`): every item typed and with an id (`new_id(prefix)`
    where the client gave none), a message's content as content parts."""
    if not raw:
        return []
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    out = []
    for item in raw:
        kind = item.get("type", "message" if "role" in item else None)
        got = {**item, "type": kind,
               "id": item.get("id") or new_id(ITEM_ID_PREFIX.get(str(kind), "item"))}
        if kind == "message":
            content = item.get("content")
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            got["content"] = [{"type": part, "text": content}] if isinstance(content, str) \
                else content or []
        if kind != "reasoning":
            got.setdefault("status", "completed")
        out.append(got)
    return out


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role must be user, assistant, system or developer",
                          param=f"{where}.role")
    return {"role": "system" if role == "developer" else role,
            "content": _content(item.get("content"), f"{where}.content", images=True)}


def _text(content: Any, where: str) -> str:
    """A call output's content: a string, or text parts."""
    got = _content(content, where, images=False)
    assert isinstance(got, str)
    return got


def _content(content: Any, where: str, images: bool) -> str | list[dict]:
    """A message's content: a string, or text parts and (`images`) `input_image` parts.
    Without images, the text; with them, chat content parts where each image is
    `{"type": "image", "image_url": URL, "param": WHERE}`: the conversation keeps its image
    (a later `previous_response_id` turn sends it again), and `split_images` takes the URL
    out of the parts into the generation's images."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image":
            parts.append(_image_part(part, f"{where}[{j}]"))
            continue
        value = part.get("refusal" if kind == "refusal" else "text") \
            if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal") \
                or not isinstance(value, str):
            raise bad_request(f"{where}[{j}]: {clip(str(kind), 60)!r} content is not "
                              f"supported; only text{' and input_image' if images else ''}",
                              param=f"{where}[{j}]")
        parts.append({"type": "text", "text": value})
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_part(part: dict, where: str) -> dict:
    """An `input_image` part as the openai SDK sends it: `image_url` a data URL (or an http(s)
    URL, fetched only with --allow-image-urls), `detail` any (the model's processor decides
    the resolution), `file_id` null (mlxd has no Files API)."""
    if part.get("file_id") is not None:
        raise bad_request(f"{where}.file_id: uploaded files are not supported (mlxd has no "
                          "Files API); send the image as `image_url` (a data URL)",
                          param=f"{where}.file_id")
    url = part.get("image_url")
    if isinstance(url, dict):  # chat's shape, {"url": ...}, as some clients send it
        url = url.get("url")
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url must be a data URL (data:image/png;base64,...)",
                          param=f"{where}.image_url")
    from_url(url, f"{where}.image_url")  # its form is checked now; it is decoded later
    return {"type": "image", "image_url": url, "param": f"{where}.image_url"}


def split_images(messages: list[dict]) -> tuple[list[dict], tuple[ImageRef, ...]]:
    """Chat messages as a template renders them (each image part a bare `{"type": "image"}`)
    and their images in order, for `GenerationRequest.images`."""
    out: list[dict] = []
    refs: list[ImageRef] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    refs.append(from_url(p["image_url"], p["param"]))
                    p = {"type": "image"}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, tuple(refs)


def _add_call(out: list[dict], item: dict, where: str) -> None:
    """A function call joins the assistant turn just before it (or starts one)."""
    args = item.get("arguments") or "{}"
    parsed = loads(args, f"{where}.arguments") if isinstance(args, str) else args
    if not isinstance(parsed, dict):
        raise bad_request(f"{where}.arguments must be a JSON object", param=f"{where}.arguments")
    call = {"id": _ident(item, "call_id", where), "type": "function",
            "function": {"name": _ident(item, "name", where), "arguments": parsed}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _ident(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_IDENT_CHARS:
        raise bad_request(f"{where}.{key} must be a string of 1 to {MAX_IDENT_CHARS} "
                          "characters", param=f"{where}.{key}")
    return value
