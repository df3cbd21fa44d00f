"""Client libraries beyond the official SDKs, pointed at a real daemon (no network): LangChain's
ChatOpenAI and pydantic-ai's OpenAI model, for what issue 15 found broken through them: default
`@tool` and pydantic schemas (no `additionalProperties`), a forced call cut by the length limit,
structured output, streaming with usage, `n` > 1. (instructor is not here: it pins `jiter`
below what the openai SDK this suite uses needs, so the two cannot be installed together.)"""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from conftest import start_daemon, stop_and_check
from support.harness import Daemon

MODEL = "tiny-llama"
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def daemon(tiny_model):
    d = start_daemon(tiny_model)
    yield d
    stop_and_check(d)


def chat(d: Daemon, **kw) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=d.url + "/v1", api_key="unused",
                      max_retries=0, **{"temperature": 0, **kw})


@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"]) -> str:
    """The weather in a city, in celsius or fahrenheit."""
    return f"sunny in {city}"


class City(BaseModel):
    name: str = Field(max_length=12)
    big: bool
    rank: int = Field(ge=1, le=99)


def test_langchain_invoke_stream_and_usage(daemon):
    llm = chat(daemon, max_tokens=8)
    whole = llm.invoke(QUESTION)
    assert isinstance(whole, AIMessage) and isinstance(whole.content, str) and whole.content
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 8
    assert whole.usage_metadata["input_tokens"] > 5
    chunks = list(chat(daemon, max_tokens=8, stream_usage=True).stream(QUESTION))
    assert "".join(str(c.content) for c in chunks) == whole.content
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == 8
    two = chat(daemon, max_tokens=4, n=2, temperature=1.0, seed=1).generate(
        [[HumanMessage(QUESTION)]])
    assert len(two.generations[0]) == 2


def test_langchain_tools_default_schema_and_a_call_cut_short(daemon):
    """A default `@tool` schema has no additionalProperties: the call holds its two arguments
    and nothing else. A call cut by max_tokens still arrives as a tool call."""
    bound = chat(daemon, max_tokens=60).bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke(QUESTION)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    cut = chat(daemon, max_tokens=8).bind_tools([get_weather], tool_choice="get_weather")
    short = cut.invoke(QUESTION)
    (call,) = short.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"], dict)
    assert short.response_metadata["finish_reason"] == "length"
    assert not short.invalid_tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(daemon, method):
    llm = chat(daemon, max_tokens=80).with_structured_output(City, method=method)
    city = llm.invoke("Describe a city.")
    assert isinstance(city, City)


def test_pydantic_ai_structured_output(daemon):
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=daemon.url + "/v1",
                                                           api_key="unused"))
    agent = Agent(model, output_type=City, retries=0,
                  model_settings={"max_tokens": 80, "temperature": 0})
    result = agent.run_sync("Describe a city.")
    assert isinstance(result.output, City)
    assert result.usage.output_tokens > 0
