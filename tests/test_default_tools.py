"""Tools for a model whose chat template has no tool format (issue 34, item 10): the default
tool prompt reaches the model, earlier calls and results render on templates that know neither,
the answer is free text or a well-formed call (llguidance grammar), calls come back parsed in
each dialect, and `/api/show` says `tools`."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from conftest import start_daemon, stop_and_check
from mlxd.engine.admit import default_tools
from support.random_model import write_random_model

UNIT = {"type": "object", "required": ["unit"],
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}}}}]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"unit": "celsius"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "noon"}]},
    {"role": "user", "content": "And tomorrow?"}]
# A Gemma-like template: no system role, turns must alternate, no tools.
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---------------------------------------------------------------- the conversation as text

def test_the_tool_prompt_joins_the_system_message_and_history_becomes_text():
    out = default_tools.with_tool_prompt(HISTORY, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in out[0]["content"]
    assert "tool_calls" not in out[2]
    calls = out[2]["content"].split("\n</tool_call>")
    assert json.loads(calls[0].split("<tool_call>\n")[1]) == {
        "name": "get_weather", "arguments": {"unit": "celsius"}}
    assert json.loads(calls[1].split("<tool_call>\n")[1]) == {"name": "get_time", "arguments": {}}
    # both results and the next question in one user turn: strict templates alternate turns
    assert out[3]["content"] == ("<tool_response>\n21 C\n</tool_response>\n"
                                 "<tool_response>\nnoon\n</tool_response>\n\nAnd tomorrow?")
    assert HISTORY[2]["tool_calls"], "the client's messages are not modified"


def test_without_a_system_message_one_is_added_or_the_prompt_folds_into_the_first_turn():
    ask = [{"role": "user", "content": "Weather?"}]
    added = default_tools.with_tool_prompt(ask, TOOLS)
    assert [m["role"] for m in added] == ["system", "user"]
    folded = default_tools.with_tool_prompt(HISTORY[1:], TOOLS, fold=True)
    assert folded[0]["role"] == "user" and folded[0]["content"].startswith("# Tools")
    assert folded[0]["content"].endswith("\n\nWeather?")


def test_turns_with_image_parts_join_as_text_does_and_keep_their_images_in_place():
    """A vision model's turns carry lists of parts: tool results join the user turn and the
    next question after them as text parts (strict templates alternate turns), the images stay
    where the client put them, and the folded tool prompt leads the first turn's parts."""
    image = {"type": "image"}
    looked: list[dict[str, Any]] = [
        {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}],
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image]}]
    out = default_tools.with_tool_prompt(looked, TOOLS, fold=True)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    first = out[0]["content"]
    assert first[0]["type"] == "text" and first[0]["text"].startswith("# Tools")
    assert first[0]["text"].endswith("\n\n")
    assert first[1:] == [image, {"type": "text", "text": "What is this?"}]
    assert out[1]["content"].startswith("Let me check.\n<tool_call>")
    assert out[2]["content"] == [
        {"type": "text", "text": "<tool_response>\nnoon\n</tool_response>\n\n"},
        {"type": "text", "text": "And this one?"}, image]
    system = default_tools.with_tool_prompt(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *looked], TOOLS)
    assert [m["role"] for m in system] == ["system", "user", "assistant", "user"]
    assert system[0]["content"][0]["text"] == "Be brief.\n\n"
    assert system[0]["content"][1]["text"].startswith("# Tools")
    assert looked[3]["content"][1] is image, "the client's messages are not modified"


# ---------------------------------------------------------------- the grammar

@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A tiny model whose template has no tool format and whose tokenizer has `<tool_call>`
    and `</tool_call>` as text tokens (as Qwen's has), so a logit bias can make it call."""
    return write_random_model(tmp_path_factory.mktemp("models") / "plain", context=2048,
                              extra_tokens=("<tool_call>", "</tool_call>"))


def _matcher(model_dir, tools):
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return hf, LLMatcher(llguidance.hf.from_tokenizer(hf),
                         default_tools.text_or_call_grammar(tools, hf), log_level=0)


@pytest.mark.parametrize("text, ok", [
    ("", True),
    ("Paris is sunny <b>today</b>.\n\nBye", True),
    ('I will check.<tool_call>\n{"name":"get_weather","arguments":{"unit":"celsius"}}\n'
     '</tool_call>', True),
    ('<tool_call>{"name":"get_time","arguments":{}}</tool_call>\n'
     '<tool_call>{"name":"get_time","arguments":{"zone":"UTC"}}</tool_call>', True),
    ('<tool_call>{"name":"get_weather","arguments":{"unit":"kelvin"}}</tool_call>', False),
    ('<tool_call>{"name":"get_weather","arguments":{}}</tool_call>', False),
    ('<tool_call>{"name":"rm_rf","arguments":{}}</tool_call>', False),
    ('<tool_call>{"name":"get_time","arguments":{}}</tool_call> and more text', False),
])
@pytest.mark.parametrize("marker", ["text", "token"])
def test_the_answer_is_text_or_well_formed_calls(tool_model, tiny_model, marker, text, ok):
    """With the markers as text (most tokenizers) and as tokens of their own (Qwen's)."""
    hf, m = _matcher(tool_model if marker == "token" else tiny_model, TOOLS)
    consumed = m.consume_tokens(hf.encode(text, add_special_tokens=False))
    assert (consumed and m.is_accepting()) is ok, m.get_error()


# ---------------------------------------------------------------- through the daemon

@pytest.fixture(scope="module")
def plain(tool_model):
    d = start_daemon(tool_model)
    yield d
    stop_and_check(d)


def _oai(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def test_the_tools_reach_a_model_without_a_tool_format(plain, tool_model):
    c = _oai(plain)
    ask = [{"role": "user", "content": "Weather?"}]
    bare = c.chat.completions.create(model="plain", messages=ask, max_tokens=1)
    told = c.chat.completions.create(model="plain", messages=ask, max_tokens=1, tools=TOOLS)
    none = c.chat.completions.create(model="plain", messages=ask, max_tokens=1, tools=TOOLS,
                                     tool_choice="none")
    assert bare.usage and told.usage and none.usage
    prompt_len = len(Tokenizer.from_file(str(tool_model / "tokenizer.json"))
                     .encode(default_tools.tool_prompt(TOOLS)).ids)
    assert told.usage.prompt_tokens >= bare.usage.prompt_tokens + prompt_len
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens
    shown = httpx_json(plain, "/api/show", {"model": "plain"})
    assert "tools" in shown["capabilities"]


def test_calls_come_back_parsed_and_valid(plain, tool_model):
    """The logit bias makes the model open a call at once and again after each call closes;
    from each `<tool_call>` the grammar writes a call to the tool with arguments its schema
    admits (an enum: a random model would write a free string until the length limit). The
    proxy returns the complete calls as calls, no text, and the call the limit cut is dropped,
    with a truthful `length`; streamed, the same calls."""
    tok = Tokenizer.from_file(str(tool_model / "tokenizer.json"))
    bias = {str(tok.token_to_id("<tool_call>")): 100, str(tok.token_to_id("</tool_call>")): 100}
    ask: dict[str, Any] = dict(model="plain", messages=[{"role": "user", "content": "Weather?"}],
               tools=TOOLS[:1], max_tokens=150, logit_bias=bias, temperature=0)
    choice = _oai(plain).chat.completions.create(**ask).choices[0]
    calls = choice.message.tool_calls or []
    assert calls and choice.finish_reason == "length" and not choice.message.content, choice
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), UNIT)
    streamed: dict[int, str] = {}
    for chunk in _oai(plain).chat.completions.create(**ask, stream=True):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed[c.index] = streamed.get(c.index, "") + (c.function.arguments or "")
    assert [streamed[i] for i in sorted(streamed)] == [c.function.arguments for c in calls]


def test_a_tool_conversation_renders_on_a_template_that_knows_no_tools(tmp_path):
    """Earlier calls and results as text, on a template that refuses a system role and
    insists on alternating turns: the tool prompt folds into the first turn."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.engine.admit.prepare import render_chat
    from mlxd.protocol.messages import Generate, SamplingParams
    strict = write_random_model(tmp_path / "strict", chat_template=STRICT_TEMPLATE)
    tok = load_tokenizer(strict)
    msg = Generate(request_id="r", sampling=SamplingParams(), messages=HISTORY[1:],
                   tools=TOOLS)
    text = render_chat(tok, msg, tokenize=False)
    assert text.startswith("<|im_start|>user\n# Tools") and "<tool_response>" in text
    assert "</tool_response>\n\nAnd tomorrow?<|im_end|>" in text


def test_a_tool_conversation_through_the_anthropic_api(plain):
    claude = anthropic.Anthropic(base_url=plain.url, api_key="unused", max_retries=0)
    msg = claude.messages.create(
        model="plain", max_tokens=2,
        tools=[{"name": "get_weather", "input_schema": UNIT}],
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                     "name": "get_weather",
                                                     "input": {"unit": "celsius"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": "21 C"}]}])
    assert msg.usage.input_tokens > 0


def httpx_json(d, path: str, body: dict) -> dict:
    import httpx
    r = httpx.post(d.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()
