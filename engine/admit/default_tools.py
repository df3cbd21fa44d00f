"""Tools for a model whose chat template has no tool format (SmolLM2, Gemma, LLaVA, most base
chat models). Left alone, the template drops the tools and the model never learns of them; LM
Studio and others give such models a default tool prompt instead, and so does mlxd:

- the tools are described in the system message in the Hermes/Qwen 2.5 format
  (`DEFAULT_TOOL_PROMPT`), whose calls mlx-lm already parses (`mlx_lm.tool_parsers.json_tools`);
- earlier calls and tool results in the conversation are written as that format's text
  (`<tool_call>` in the assistant's turn, `<tool_response>` in a user turn), since the template
  has no way to render them either;
- the answer is constrained by `text_or_call_grammar`: free text, or text followed by one or
  more `<tool_call>` blocks whose JSON names one of the tools with arguments valid for its
  schema. Once the model writes `<tool_call>` it is held to a well-formed call; it is never
  pushed into one.

A template that knows tools and a tool parser mlx-lm knows is left as it is (`native`)."""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.tool_parsers import json_tools

TOOL_CALL_START: str = json_tools.tool_call_start
TOOL_CALL_END: str = json_tools.tool_call_end
parse_tool_call = json_tools.parse_tool_call

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def native(tok: Any) -> bool:
    """The template renders tools itself and mlx-lm parses its model's calls."""
    template = str(getattr(tok, "chat_template", None) or "")
    return bool(getattr(tok, "has_tool_calling", False)) and "tools" in template


def has_chat_template(tok: Any) -> bool:
    return bool(getattr(tok, "chat_template", None))


def applies(tok: Any, tools: list[dict] | None, messages: list[dict] | None,
            grammar: str | None) -> bool:
    """Whether a chat request with these tools gets the default tool prompt: only where the
    model chooses whether to call. A forced call (or a structured answer) has its own
    grammar, which writes the call's JSON whatever the prompt says, as before; the prompt
    would only take context (on a small model, all of it)."""
    return bool(tools) and messages is not None and grammar is None and not native(tok)


def tool_prompt(tools: list[dict]) -> str:
    return DEFAULT_TOOL_PROMPT.format(tools="\n".join(
        json.dumps(t, ensure_ascii=False) for t in tools))


def with_tool_prompt(messages: list[dict], tools: list[dict], fold: bool = False) -> list[dict]:
    """The conversation as a template without tools can render it: the tool prompt at the end of
    the system message (a new one first if there is none; with `fold`, for templates that
    refuse a system role, at the start of the first user turn), calls and results as text.
    A turn's content may be a list of parts (a vision model's images and text): text joins it
    as a text part, so the images keep their places."""
    out: list[dict] = []
    from_tool = False  # the last message in `out` is (or ends with) tool results
    for m in messages:
        role = m.get("role")
        if role == "tool":
            text = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == "user":
                out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), "\n", text)}
            else:
                out.append({"role": "user", "content": text})
            from_tool = True
            continue
        if role == "user" and from_tool and out:
            # templates that insist on alternating turns refuse two user turns in a row
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), "\n\n",
                                                     m.get("content"))}
            from_tool = False
            continue
        from_tool = False
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = _text(m.get("content"))
            text = f"{content}\n{calls}" if content else calls
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
            continue
        out.append(dict(m))
    prompt = tool_prompt(tools)
    if fold:
        first_user = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
        if first_user is not None:
            m = out[first_user]
            out[first_user] = {**m, "content": _joined(prompt, "\n\n", m.get("content"))}
            return out
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": _joined(out[0].get("content"), "\n\n", prompt)}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _joined(first: Any, sep: str, second: Any) -> Any:
    """Two contents as one: text joined by `sep` where both are text (or empty), else the
    parts of both in order, `sep` ending the first's last text part (or a part of its own)."""
    a = "" if first is None else first
    b = "" if second is None else second
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}{sep}{b}" if a else b
    parts, rest = _parts(a), _parts(b)
    if parts and rest:
        if parts[-1].get("type") == "text" and isinstance(parts[-1].get("text"), str):
            parts[-1] = {**parts[-1], "text": parts[-1]["text"] + sep}
        else:
            parts.append({"type": "text", "text": sep})
    return parts + rest


def _parts(content: Any) -> list[dict]:
    if isinstance(content, list):
        return [dict(p) for p in content if isinstance(p, dict)]
    text = content if isinstance(content, str) else _text(content)
    return [{"type": "text", "text": text}] if text else []


def text_or_call_grammar(tools: list[dict], tok: Any = None) -> str:
    """llguidance grammar of an answer that is free text, or text up to `<tool_call>` followed
    by calls, each a compact JSON object naming one of `tools` with arguments of its schema.
    Where the marker is text, the text before a call is a lazy lexeme that ends at the first
    `<tool_call>`, from which point the call must be well formed. Where the tokenizer has the
    marker as a token of its own (`tok`), llguidance sees a special token, which only a
    token reference matches."""
    from llguidance import LLMatcher
    options = [{"type": "object",
                "properties": {"name": {"const": fn["name"]},
                               "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for fn in (_function(t) for t in tools) if fn is not None]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    open_id, close_id = (marker_token(tok, m) for m in (TOOL_CALL_START, TOOL_CALL_END))
    close = f"<[{close_id}]>" if close_id is not None else json.dumps(TOOL_CALL_END)
    rules = [f"call: \"\\n\"? %json {json.dumps(schema)} \"\\n\"? close",
             f"close: {close}", "TEXT: /(.|\\n)+/"]
    if open_id is None:
        rules += ["start: TEXT? | lead call (SEP call)*",
                  f"lead[lazy]: /(.|\\n)*{TOOL_CALL_START}/",
                  f"SEP: /[ \\t\\n]*{TOOL_CALL_START}/"]
    else:
        rules += ["start: TEXT? | TEXT? open call (WS? open call)*",
                  f"open: <[{open_id}]>", "WS: /[ \\t\\n]+/"]
    return LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def marker_token(tok: Any, marker: str) -> int | None:
    """The id of `marker` where the tokenizer has it as an added token of its own."""
    added = getattr(tok, "added_tokens_encoder", None)  # a Hugging Face tokenizer
    if added is None:  # mlx-lm's wrapper of one
        added = getattr(getattr(tok, "_tokenizer", None), "added_tokens_encoder", None)
    found = added.get(marker) if isinstance(added, dict) else None
    return found if isinstance(found, int) else None


def _function(tool: dict) -> dict | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else json.dumps(content, ensure_ascii=False)
