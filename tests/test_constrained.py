"""Structured output and forced tool calls by constrained decoding (llguidance), through a
real daemon with the official openai, anthropic and ollama clients. The model has random
weights: whatever it would say, the output must still match the schema."""

from __future__ import annotations

import json
import threading

import anthropic
import jsonschema
import ollama
import openai
import pytest
from anthropic.types import MessageParam, ToolParam
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.shared_params import ResponseFormatJSONSchema

from support.harness import Daemon
from support.sdk import function_calls, streamed_call, tool_use_of

MODEL = "tiny-llama"
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a city."}]
ASK_ANTHROPIC: list[MessageParam] = [{"role": "user", "content": "Describe a city."}]
CITY: dict[str, object] = {
    "type": "object", "additionalProperties": False, "required": ["name", "big", "rank"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "big": {"type": "boolean"},
                   "rank": {"type": "integer", "minimum": 1, "maximum": 99},
                   "kind": {"enum": ["port", "capital", "town"]}}}
WEATHER: dict[str, object] = {
    "type": "object", "additionalProperties": False, "required": ["location", "unit"],
    "properties": {"location": {"type": "string", "maxLength": 10},
                   "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME: dict[str, object] = {"type": "object", "additionalProperties": False, "required": ["zone"],
                           "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def oai(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_output_validates(daemon):
    fmt: ResponseFormatJSONSchema = {"type": "json_schema",
                                     "json_schema": {"name": "city", "schema": CITY}}
    r = oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                            response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), CITY)
    chunks = oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                                 response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content  # greedy: the same document either way
    obj = oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_tool_choice_required_and_named(daemon):
    r = oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=80,
                                            tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = function_calls(choice.message)
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = oai(daemon).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = function_calls(named.choices[0].message)
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)
    stream = oai(daemon).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=80, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(calls) == 1
    _, name, arguments = streamed_call(calls[0])
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert deltas[-1].finish_reason == "tool_calls"
    # the call and its result go back in as history
    back = oai(daemon).chat.completions.create(model=MODEL, max_tokens=4, tools=TOOLS, messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assert back.choices[0].finish_reason == "length"


def test_constrained_and_free_requests_share_steps(daemon):
    """A constrained row joins a batch of free rows; both finish correctly."""
    results: dict[str, ChatCompletion] = {}

    def free() -> None:
        results["free"] = oai(daemon).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=60)

    def constrained() -> None:
        results["json"] = oai(daemon).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "c",
                                                                    "schema": CITY}})
    before = daemon.stats()["engines"][0]["steps"]
    threads = [threading.Thread(target=f) for f in (free, constrained)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    free_usage, json_usage = results["free"].usage, results["json"].usage
    assert free_usage is not None and json_usage is not None
    assert free_usage.completion_tokens == 60
    jsonschema.validate(json.loads(results["json"].choices[0].message.content or ""), CITY)
    steps = daemon.stats()["engines"][0]["steps"] - before
    total = free_usage.completion_tokens + json_usage.completion_tokens
    assert steps < total  # some steps decoded both rows


@pytest.mark.parametrize("body, fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}]}, "parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": "ten"}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "content": "1"}]}, "tool_call_id"),
])
def test_bad_tools_and_formats_are_400(daemon, body, fragment):
    with daemon.http() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                 "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"] or fragment == r.json()["error"]["param"]


def test_anthropic_tool_use(daemon):
    c = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    tools: list[ToolParam] = [{"name": "get_weather", "description": "Weather",
                               "input_schema": WEATHER}]
    m = c.messages.create(model=MODEL, max_tokens=80, messages=ASK_ANTHROPIC, tools=tools,
                          tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    (only,) = m.content
    block = tool_use_of(only)
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER)
    with c.messages.stream(model=MODEL, max_tokens=80, messages=ASK_ANTHROPIC, tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "content_block_start" in kinds and final.stop_reason == "tool_use"
    assert tool_use_of(final.content[0]).input == block.input  # greedy: the same call
    answered = c.messages.create(model=MODEL, max_tokens=4, tools=tools, messages=[
        *ASK_ANTHROPIC, {"role": "assistant", "content": [{"type": "tool_use", "id": block.id,
                                                 "name": "get_weather", "input": block.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                      "content": "sunny"}]}])
    assert answered.stop_reason == "max_tokens"


def test_ollama_format(daemon):
    c = ollama.Client(host=daemon.url)
    r = c.chat(model=MODEL, messages=ASK, format=CITY, options={"num_predict": 120})
    jsonschema.validate(json.loads(r.message.content or ""), CITY)
    g = c.generate(model=MODEL, prompt="A city:", format="json", options={"num_predict": 120})
    assert isinstance(json.loads(g.response or ""), dict) and g.done_reason == "stop"
