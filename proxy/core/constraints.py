"""Output constraints built in the proxy: llguidance grammars for structured output
(`response_format`, Ollama's `format`) and for forced tool calls (`tool_choice` required or a
named function). Grammars are validated here, so an invalid schema is a 400 that never reaches
an engine; the engine only compiles and applies them."""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlxd.proxy.bounds import MAX_IDENT_CHARS, clip
from mlxd.proxy.core import partial_json
from mlxd.proxy.errors import bad_request

ANY_OBJECT: dict = {"type": "object"}


def closed(schema: Any, close_self: bool = True) -> Any:
    """`schema` with every object schema that lists `properties` but says nothing of
    `additionalProperties` closed (false), in nested schemas too; one that says true stays
    open, and an object without `properties` stays free-form. Left open, a grammar lets a
    model add keys (the same key again and again) until the length limit; grammar engines
    elsewhere (vLLM, SGLang, llama.cpp) generate as if it were false too. The members of an
    `allOf` of several are left open themselves (closed, each would forbid the others' keys).
    The client's schema is not modified."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    members = schema.get("allOf")
    if isinstance(members, list) and len(members) > 1:
        out["allOf"] = [closed(s, close_self=False) for s in members]
    if close_self and isinstance(out.get("properties"), dict) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# Keywords whose value is a schema or a list of schemas, and those whose value maps names
# to schemas.
_SUBSCHEMAS = {"items", "prefixItems", "additionalItems", "contains", "anyOf", "oneOf",
               "allOf", "not", "if", "then", "else", "additionalProperties",
               "unevaluatedProperties", "unevaluatedItems", "propertyNames"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")


# Grammars of the schemas seen last, by the schema's JSON text (its key order kept: it orders
# the document's keys): an app's response format or an agent's tools come with every request,
# and compiling and validating one takes ~0.5-1 ms of the proxy's event loop, a burst's
# requests one after the other.
GRAMMARS_KEPT = 128
GRAMMARS_KEPT_CHARS = 4 << 20  # the schemas' and grammars' text kept, in all (the proxy's memory)
GRAMMAR_KEY_CHARS = 64 << 10  # a larger schema is compiled each time
_grammars: OrderedDict[str, str] = OrderedDict()
_grammars_chars = [0]
_grammars_lock = threading.Lock()


def schema_grammar(schema: Any, param: str) -> str:
    if not isinstance(schema, dict):
        raise bad_request(f"`{param}` must be a JSON schema object", param=param)
    try:
        key = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not JSON text: compiled, not kept
        key = None
    if key is not None and len(key) > GRAMMAR_KEY_CHARS:
        key = None
    if key is not None:
        with _grammars_lock:
            grammar = _grammars.get(key)
            if grammar is not None:
                _grammars.move_to_end(key)
                return grammar
    grammar = _compile(schema, param)  # a 400 is not kept: raised again for the next one
    if key is not None:
        with _grammars_lock:
            if key not in _grammars:
                _grammars[key] = grammar
                _grammars_chars[0] += len(key) + len(grammar)
            while _grammars and (len(_grammars) > GRAMMARS_KEPT
                                 or _grammars_chars[0] > GRAMMARS_KEPT_CHARS):
                old_key, old_grammar = _grammars.popitem(last=False)
                _grammars_chars[0] -= len(old_key) + len(old_grammar)
    return grammar


def _compile(schema: dict, param: str) -> str:
    from llguidance import LLMatcher
    try:
        # Compact JSON: free whitespace lets a weak model pad forever instead of answering.
        grammar = LLMatcher.grammar_from_json_schema(closed(schema), defaults={
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


def forced_call(text: str, tools: list[Tool]) -> tuple[str, dict]:
    """A forced call's (name, arguments). The grammar guarantees the shape once generation
    finished on its own; a call the length limit cut short is completed leniently: the
    arguments written so far (a string cut inside is closed where it stopped), and the tool
    whose name the text begins (the first tool if not even that was written)."""
    obj = partial_json.complete(text)
    if not isinstance(obj, dict):
        obj = {}
    name = obj.get("name")
    if not isinstance(name, str):
        name = ""
    tool = next((t for t in tools if t.name == name), None) \
        or next((t for t in tools if t.name.startswith(name)), tools[0])
    args = obj.get("arguments")
    return tool.name, args if isinstance(args, dict) else {}


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]
