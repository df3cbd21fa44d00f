"""The Responses API (`/v1/responses`) through a real daemon, as the openai SDK's
`client.responses` and openai-agents use it: text (whole and streamed, in the SDK's event
order), `instructions`, structured text, a function tool round trip, `previous_response_id`
(kept in the proxy, bounded), retrieval, and 400s for what is not supported."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    EasyInputMessageParam,
    FunctionToolParam,
    ResponseFunctionToolCall,
    ResponseFunctionToolCallParam,
    ResponseOutputMessage,
)
from openai.types.responses.response_input_param import FunctionCallOutput
from pydantic import BaseModel

from conftest import start_daemon, stop_and_check
from support.harness import Daemon

MODEL = "tiny-llama"
WEATHER: FunctionToolParam = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string",
                                                  "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}
SMALL_SCHEMA = {"type": "object", "properties": {"sunny": {"type": "boolean"}},
                "required": ["sunny"], "additionalProperties": False}


@pytest.fixture(scope="module")
def daemon(tiny_model):
    d = start_daemon(tiny_model)
    yield d
    stop_and_check(d)


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def calls(response) -> list[ResponseFunctionToolCall]:
    return [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]


def test_text_with_instructions_is_the_chat_answer(daemon):
    """`instructions` is the system message: the answer and its prompt are those of a chat
    completion with that system message (greedy). Cut by the limit: `incomplete`."""
    api = client(daemon)
    r = api.responses.create(model=MODEL, instructions="Answer briefly.", input="Hello!",
                             max_output_tokens=6, temperature=0)
    chat = api.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    (message,) = r.output
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant"
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and message.status == "incomplete"
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.id.startswith("resp_") and r.model == MODEL and r.instructions == "Answer briefly."


def test_stream_events_in_the_sdk_order(daemon):
    api = client(daemon)
    with api.responses.stream(model=MODEL, input="Is it sunny?", max_output_tokens=40,
                              text={"format": {"type": "json_schema", "name": "sunny",
                                               "schema": SMALL_SCHEMA, "strict": True}}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert isinstance(json.loads(final.output_text)["sunny"], bool)
    # Free text cut by the length limit ends with `response.incomplete`.
    raw = list(api.responses.create(model=MODEL, input="Hello!", max_output_tokens=3,
                                    stream=True))
    assert raw[-1].type == "response.incomplete"
    assert raw[-1].response.incomplete_details is not None
    assert raw[-1].response.usage is not None and raw[-1].response.usage.output_tokens == 3


def test_a_function_tool_round_trip(daemon):
    api = client(daemon)
    first = api.responses.create(model=MODEL, input="What is the weather in Paris?",
                                 tools=[WEATHER], tool_choice="required", max_output_tokens=80)
    (call,) = calls(first)
    assert first.status == "completed", first
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    answer: FunctionCallOutput = {"type": "function_call_output", "call_id": call.call_id,
                                  "output": "sunny"}
    question: EasyInputMessageParam = {"role": "user", "content": "What is the weather in Paris?"}
    call_item: ResponseFunctionToolCallParam = {
        "type": "function_call", "call_id": call.call_id, "name": call.name,
        "arguments": call.arguments}
    # The conversation continues from the stored response... (tool_choice none: offered
    # freely, the tools would go to the tiny model in the default tool prompt, which is longer
    # than its 256-token context)
    chained = api.responses.create(model=MODEL, previous_response_id=first.id, input=[answer],
                                   tools=[WEATHER], tool_choice="none", max_output_tokens=4)
    # ...exactly as when the client sends it all again.
    resent = api.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none",
                                  max_output_tokens=4, input=[question, call_item, answer])
    assert chained.output_text == resent.output_text
    assert chained.usage is not None and resent.usage is not None and first.usage is not None
    assert chained.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens
    assert chained.previous_response_id == first.id
    # A forced call streams as one function_call item.
    with api.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                              tool_choice={"type": "function", "name": "get_weather"},
                              max_output_tokens=80) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (call,) = calls(streamed)
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")


def test_stored_responses_retrieve_delete_and_store_false(daemon):
    api = client(daemon)
    kept = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert api.responses.retrieve(kept.id).output_text == kept.output_text
    api.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(kept.id)
    unstored = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    for gone in (kept.id, unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            api.responses.create(model=MODEL, input="Hi", previous_response_id=gone)
        assert e.value.code == "previous_response_not_found"


def test_input_items_are_listed_as_the_sdk_pages_them(daemon):
    """`client.responses.input_items.list`: the response's own input items, typed, with ids,
    newest first by default, paged by `after`; a string input is one user message."""
    api = client(daemon)
    first = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    (only,) = api.responses.input_items.list(first.id).data
    assert only.type == "message" and only.role == "user" and only.id
    assert [(c.type, c.text) for c in only.content] == [("input_text", "Hi")]
    second = api.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}])
    asc = api.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in asc.data] == ["Be brief.", "One", "Two", "Three"]
    assert asc.data[2].content[0].type == "output_text"
    page = api.responses.input_items.list(second.id, limit=3)  # desc, then the next page
    assert [i.content[0].text for i in page.data] == ["Three", "Two", "One"] and page.has_more
    assert [i.content[0].text for i in page.get_next_page().data] == ["Be brief."]
    assert [i.content[0].text for i in api.responses.input_items.list(second.id)] == \
        ["Three", "Two", "One", "Be brief."]  # the SDK's auto-paging sees every item once
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError):
        api.responses.input_items.list(second.id, limit=0)


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     "input[0].call_id"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": ""}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
])
def test_unsupported_and_bad_input_is_a_400_before_any_engine(daemon, body, param):
    before = daemon.stats()["engines"][0]["prompt_tokens_total"]
    with daemon.http() as h:
        r = h.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert daemon.stats()["engines"][0]["prompt_tokens_total"] == before


def test_openai_agents_runs_an_agent_turn(daemon):
    """openai-agents' default model type (the Responses API) against the daemon: a forced
    tool call, the tool's output sent back, then a structured final answer."""
    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    class Forecast(BaseModel):
        sunny: bool

    agent = Agent(name="weather", instructions="Use the tool, then answer.", model=MODEL,
                  tools=[get_weather], output_type=Forecast,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=120,
                                               temperature=0))
    api = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    result = Runner.run_sync(agent, "Is it sunny in Paris?", max_turns=3,
                             run_config=RunConfig(model_provider=OpenAIProvider(
                                 openai_client=api)))
    assert isinstance(result.final_output, Forecast)
    first, last = result.raw_responses[0], result.raw_responses[-1]
    assert [item.type for item in first.output] == ["function_call"]
    assert last.output and last.output[0].type == "message"
