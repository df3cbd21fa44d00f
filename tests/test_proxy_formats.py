"""How the proxy renders what an engine parsed (tool calls in the model's own format,
reasoning text) in each dialect, with the official clients. A real proxy process is fed by
`tests/support/fake_engine.py`, which speaks the real protocol and replays a scripted answer."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import ollama
import openai
import pytest
from anthropic.types import MessageParam, ToolParam
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from support.fake_engine import proxy_with_fake_engine
from support.sdk import (
    function_calls,
    reasoning_of,
    streamed_call,
    text_of,
    thinking_of,
    tool_use_of,
)

ROOT = Path(__file__).resolve().parent.parent
ARGS = json.dumps({"location": "Paris", "unit": "celsius"})
SCRIPT = [{"reasoning": "The user wants weather. "}, {"reasoning": "Call the tool."},
          {"text": "Let me check."},
          {"tool_calls": [{"name": "get_weather", "arguments": ARGS}]}, {}]
WEATHER: dict[str, object] = {"type": "object", "properties": {"location": {"type": "string"},
                                                             "unit": {"type": "string"}}}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
ASK_ANTHROPIC: list[MessageParam] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def proxy():
    with proxy_with_fake_engine("--reply", json.dumps(SCRIPT)) as url:
        yield url


def test_openai_tool_calls_and_reasoning(proxy):
    c = openai.OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    assert reasoning_of(msg) == "The user wants weather. Call the tool."
    (call,) = function_calls(msg)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == \
        json.loads(ARGS)
    chunks = list(c.chat.completions.create(model="fake", messages=ASK, tools=TOOLS,
                                            stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    call_id, _, arguments = streamed_call(calls[0])
    assert call_id.startswith("call_") and arguments == ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    reasoning = "".join(reasoning_of(ch.choices[0].delta) or "" for ch in chunks if ch.choices)
    assert reasoning == reasoning_of(msg)


def test_anthropic_tool_use_and_thinking(proxy):
    c = anthropic.Anthropic(base_url=proxy, api_key="unused", max_retries=0)
    tools: list[ToolParam] = [{"name": "get_weather", "input_schema": WEATHER}]
    m = c.messages.create(model="fake", max_tokens=50, messages=ASK_ANTHROPIC, tools=tools)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.stop_reason == "tool_use" and tool_use_of(m.content[2]).input == json.loads(ARGS)
    with c.messages.stream(model="fake", max_tokens=50, messages=ASK_ANTHROPIC,
                           tools=tools) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert thinking_of(final.content[0]) == "The user wants weather. Call the tool."
    assert text_of(final.content[1]) == "Let me check."
    use = tool_use_of(final.content[2])
    assert use.name == "get_weather" and use.input == json.loads(ARGS)
    assert final.stop_reason == "tool_use"


def test_ollama_tool_calls_and_thinking(proxy):
    c = ollama.Client(host=proxy)
    r = c.chat(model="fake", messages=ASK, tools=TOOLS)
    assert r.message.thinking == "The user wants weather. Call the tool."
    assert r.message.content == "Let me check."
    (call,) = r.message.tool_calls or []
    assert call.function.name == "get_weather" and dict(call.function.arguments) == \
        json.loads(ARGS)
    parts = list(c.chat(model="fake", messages=ASK, tools=TOOLS, stream=True))
    streamed = [tc for p in parts for tc in (p.message.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
    assert parts[-1].done


def test_an_engine_dropping_a_request_never_shows_the_client_an_abort():
    """An engine that ends a request the proxy still reads with `abort` (an abort-all meant for
    a dead proxy's rows): the proxy re-sends it with what was delivered; the client gets the
    whole answer and a real finish reason."""
    with proxy_with_fake_engine("--drop-after", "3") as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="fake", messages=ASK, max_tokens=10)
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].message.content == " tok" * 10
        chunks = list(c.chat.completions.create(model="fake", messages=ASK, max_tokens=10,
                                                stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == " tok" * 10 and chunks[-1].choices[0].finish_reason == "length"
