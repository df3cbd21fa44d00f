"""Output constraints built in the proxy: llguidance grammars for structured output
(`response_format`, Ollama's `format`) and for forced tool calls (`tool_choice` required or a
named function). Grammars are validated here, so an invalid schema is a 400 that never reaches
an engine; the engine only compiles and applies them."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from mlxd.proxy.bounds import MAX_IDENT_CHARS, clip
from mlxd.proxy.errors import bad_request

ANY_OBJECT: dict = {"type": "object"}


def schema_grammar(schema: Any, param: str) -> str:
    from llguidance import LLMatcher
    if not isinstance(schema, dict):
        raise bad_request(f"`{param}` must be a JSON schema object", param=param)
    try:
        # Compact JSON: free whitespace lets a weak model pad forever instead of answering.
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults={
            "whitespace_flexible": False})
    except Exception as e:  # whatever the compiler makes of client input is a 400
        raise bad_request(f"`{param}` is not a usable JSON schema: {clip(str(e), 500)}",
                          param=param) from e
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"`{param}` is not a usable JSON schema: {clip(error, 500)}",
                          param=param)
    return grammar


def response_format_grammar(rf: dict | None) -> str | None:
    """OpenAI's `response_format`."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("`response_format.json_schema.schema` is required",
                              param="response_format")
        return schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise bad_request("`response_format.type` must be text, json_object or json_schema",
                      param="response_format")


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict

    def as_template_tool(self) -> dict:
        """The OpenAI shape chat templates expect."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(raw: list[Any] | None, param: str = "tools") -> list[Tool]:
    tools = []
    for i, t in enumerate(raw or []):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not _is_name(fn.get("name")):
            raise bad_request(f"{param}[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{\"name\": ..., \"parameters\": {...}}} with a name of at most "
                              f"{MAX_IDENT_CHARS} characters", param=param)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise bad_request(f"{param}[{i}].function.description must be a string", param=param)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        schema_grammar(params, f"{param}[{i}].function.parameters")  # validated up front
        tools.append(Tool(fn["name"], description, params))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"`{param}` holds two functions of one name", param=param)
    return tools


def forced_tools(tools: list[Tool], choice: Any) -> list[Tool] | None:
    """The tools a call is forced among (None: the model decides, or must not call)."""
    if choice is None or choice == "auto" or choice == "none":
        return None
    if choice == "required":
        if not tools:
            raise bad_request("`tool_choice` is required but there are no `tools`",
                              param="tool_choice")
        return tools
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) \
            else choice.get("name") if choice.get("type") == "tool" else None
    if not _is_name(name):
        raise bad_request("`tool_choice` must be auto, none, required or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                          param="tool_choice")
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise bad_request(f"`tool_choice` names {name!r}, which is not among `tools`",
                          param="tool_choice")
    return chosen


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_IDENT_CHARS


def call_grammar(tools: list[Tool]) -> str:
    """The output is exactly one call: {"name": <one of tools>, "arguments": <its schema>}."""
    options = [{"type": "object", "properties": {"name": {"const": t.name},
                                                 "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    return schema_grammar(options[0] if len(options) == 1 else {"anyOf": options}, "tools")


def forced_call(text: str, finish: str | None) -> tuple[str, dict] | None:
    """A forced call's (name, arguments); None if max_tokens cut it short (the grammar
    guarantees its shape once generation finished on its own)."""
    if finish == "length":
        return None
    try:
        obj = json.loads(text)
        return obj["name"], obj["arguments"]
    except (ValueError, KeyError, TypeError):
        return None


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]
