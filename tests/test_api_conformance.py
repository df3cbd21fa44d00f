"""The APIs exactly as the official clients use them (issue 15, items 1-9 and the fields that
came with them), through a real daemon on tiny random-weight models: a forced call cut by the
length limit, schemas without `additionalProperties`, Anthropic's `output_config.format` and
streamed usage, assistant prefill, explicit nulls, `logit_bias`, legacy `functions`, Ollama's
model metadata, `GET /v1/models/{id}`, `n` > 1, `echo` and fill-in-the-middle."""

from __future__ import annotations

import json
import os
import signal
from datetime import UTC, datetime, timedelta

import anthropic
import jsonschema
import ollama
import openai
import pytest
from anthropic.types import MessageParam, ToolParam
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolParam,
)
from openai.types.shared_params import ResponseFormatJSONSchema
from tokenizers import Tokenizer

from conftest import start_daemon, stop_and_check
from support.harness import Daemon
from support.random_model import write_random_model
from support.sdk import function_calls, streamed_call, text_of, tool_use_of

MODEL = "tiny-llama"
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a city."}]
ASK_ANTHROPIC: list[MessageParam] = [{"role": "user", "content": "Describe a city."}]
WEATHER: dict[str, object] = {
    "type": "object", "required": ["location", "unit"],
    "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def daemon(tiny_model):
    d = start_daemon(tiny_model, "--batch", "8")
    yield d
    stop_and_check(d)


def oai(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def claude(d: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0)


def token_id(model_dir, text: str) -> int:
    tid = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(text)
    assert tid is not None, text
    return tid


# ---------------------------------------------------------------- 1: a forced call cut short

def test_forced_call_cut_by_the_length_limit_is_still_a_call(daemon):
    """max_tokens ends a forced call mid-arguments: it comes back as a call (finish `length`,
    Anthropic `max_tokens` with a tool_use block), never as the grammar's JSON in the text."""
    c = oai(daemon)
    named: ChatCompletionNamedToolChoiceParam = {"type": "function",
                                                 "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, tools=TOOLS,
                                  tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = function_calls(choice.message)
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)  # what was written, closed
    chunks = [ch.choices[0] for ch in c.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, tools=TOOLS, stream=True,
        tool_choice=named) if ch.choices]
    (streamed,) = [tc for ch in chunks for tc in ch.delta.tool_calls or []]
    assert streamed_call(streamed)[1:] == ("get_weather", call.function.arguments)
    assert chunks[-1].finish_reason == "length"
    assert not any(ch.delta.content for ch in chunks)
    tools: list[ToolParam] = [{"name": "get_weather", "input_schema": WEATHER}]
    m = claude(daemon).messages.create(model=MODEL, max_tokens=6, messages=ASK_ANTHROPIC,
                                       tools=tools, tool_choice={"type": "any"})
    assert m.stop_reason == "max_tokens"
    (block,) = m.content
    assert tool_use_of(block).name == "get_weather" and isinstance(tool_use_of(block).input, dict)
    with claude(daemon).messages.stream(model=MODEL, max_tokens=6, messages=ASK_ANTHROPIC,
                                        tools=tools, tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert tool_use_of(final.content[0]).input == tool_use_of(block).input


# ---------------------------------------------------------------- 2: additionalProperties

def test_a_schema_without_additional_properties_admits_no_other_key(daemon, tiny_model):
    """`logit_bias` pushes the model to write a `,` wherever it may: with the schema's object
    open it adds keys until the budget closes the object; closed, the answer is the one
    property."""
    schema: dict[str, object] = {"type": "object", "required": ["big"],
                                 "properties": {"big": {"type": "boolean"}}}
    comma = {str(token_id(tiny_model, ",")): 100}
    fmt: ResponseFormatJSONSchema = {"type": "json_schema",
                                     "json_schema": {"name": "s", "schema": schema}}
    r = oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                            logit_bias=comma, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content or "")) == {"big"}
    # a schema that says additionalProperties: true keeps its object open: key after key,
    # until the budget closes the object (valid, so finish stop: README, max_tokens and a
    # JSON schema)
    fmt = {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {**schema, "additionalProperties": True}}}
    r = oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=120,
                                            logit_bias=comma, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content or "")) > {"big"}


# ---------------------------------------------------------------- 3: output_config.format

CITY: dict[str, object] = {
    "type": "object", "required": ["name", "big"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "big": {"type": "boolean"}}}


def test_anthropic_output_config_format_constrains_the_answer(daemon):
    m = claude(daemon).messages.create(
        model=MODEL, max_tokens=60, messages=ASK_ANTHROPIC,
        output_config={"format": {"type": "json_schema", "schema": CITY}})
    assert m.stop_reason == "end_turn"
    answer = json.loads(text_of(m.content[0]))
    jsonschema.validate(answer, {**CITY, "additionalProperties": False})
    with daemon.http() as h:  # the structured-outputs beta's spelling works alike
        beta = h.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 60, "messages": ASK_ANTHROPIC,
            "output_format": {"type": "json_schema", "schema": CITY}}).json()
        assert json.loads(beta["content"][0]["text"]) == answer
        bad = h.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 5, "messages": ASK_ANTHROPIC,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}})
        assert bad.status_code == 400 and "output_config" in bad.json()["error"]["message"]


# ---------------------------------------------------------------- 4: Anthropic streamed usage

def _sse_events(d: Daemon, body: dict) -> list[tuple[str, dict]]:
    with d.http() as c, c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events: list[tuple[str, dict]] = []
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_anthropic_streamed_usage_has_its_current_shape(daemon):
    msgs = [{"role": "user", "content": "Tell me a long story about harbours and ships. " * 3}]
    total = claude(daemon).messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    body = {"model": MODEL, "max_tokens": 5, "messages": msgs, "stream": True}
    _sse_events(daemon, body)  # the prompt is in the KV cache now
    events = _sse_events(daemon, body)
    start = next(e for n, e in events if n == "message_start")["message"]["usage"]
    assert start["cache_read_input_tokens"] > 0
    assert start["input_tokens"] + start["cache_read_input_tokens"] == total
    assert start["output_tokens"] == 0 and start["cache_creation_input_tokens"] == 0
    final = next(e for n, e in events if n == "message_delta")["usage"]
    assert final == {**start, "output_tokens": 5}
    with claude(daemon).messages.stream(model=MODEL, max_tokens=5, messages=msgs) as s:
        usage = s.get_final_message().usage
    assert usage.input_tokens == start["input_tokens"] and usage.output_tokens == 5
    assert usage.cache_read_input_tokens == start["cache_read_input_tokens"]


# ---------------------------------------------------------------- 5: assistant prefill

PREFILL = "The capital of France is"


def test_a_final_assistant_turn_is_continued_in_every_dialect(daemon):
    """The prefilled text is continued exactly as the raw prompt (the template's rendering of
    the turn, left open) would be: the same greedy tokens."""
    rendered = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                f"<|im_start|>assistant\n{PREFILL}")
    raw = oai(daemon).completions.create(model=MODEL, prompt=rendered, max_tokens=8)
    expected = raw.choices[0].text
    chat = oai(daemon).chat.completions.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": PREFILL}])
    assert chat.choices[0].message.content == expected
    assert chat.usage is not None and raw.usage is not None
    assert chat.usage.prompt_tokens == raw.usage.prompt_tokens
    m = claude(daemon).messages.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": PREFILL}])
    assert text_of(m.content[0]) == expected
    o = ollama.Client(host=daemon.url).chat(model=MODEL, options={"num_predict": 8}, messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": PREFILL}])
    assert o.message.content == expected


# ---------------------------------------------------------------- 6: explicit null

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": ASK, "n": None, "stream": None, "echo": None,
                              "stream_options": None, "logit_bias": None, "seed": None,
                              "stop": None, "tools": None, "tool_choice": None, "user": None,
                              "response_format": None, "logprobs": None,
                              "top_logprobs": None, "max_completion_tokens": None,
                              "temperature": None, "top_p": None, "presence_penalty": None,
                              "frequency_penalty": None, "parallel_tool_calls": None}),
    ("/v1/chat/completions", {"messages": ASK, "stream": True,
                              "stream_options": {"include_usage": None}}),
    ("/v1/completions", {"prompt": "Once upon", "n": None, "stream": None, "echo": None,
                         "best_of": None, "suffix": None, "logprobs": None, "stop": None}),
    ("/v1/messages", {"messages": ASK, "stream": None, "system": None, "temperature": None,
                      "top_p": None, "top_k": None, "stop_sequences": None, "tools": None,
                      "tool_choice": None, "metadata": None, "thinking": None,
                      "output_config": None}),
    ("/api/chat", {"messages": [{"role": "user", "content": None}, *ASK], "stream": None,
                   "format": None, "options": None, "keep_alive": None, "tools": None}),
    ("/api/generate", {"prompt": "Once upon", "stream": None, "raw": None, "system": None,
                       "suffix": None, "format": None, "options": None}),
])
def test_explicit_null_means_left_out(daemon, path, body):
    with daemon.http() as h:
        r = h.post(path, json={"model": MODEL, "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    if path.startswith("/api/"):  # Ollama streams unless told not to
        assert r.headers["content-type"].startswith("application/x-ndjson")
        assert json.loads(r.text.splitlines()[-1])["done"]


def test_explicit_null_through_the_openai_client(daemon):
    c = oai(daemon)
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, n=None,
                                  stream_options=None, logit_bias=None)
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    t = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, echo=None, n=None)
    assert len(t.choices) == 1 and not t.choices[0].text.startswith("Once upon")


# ---------------------------------------------------------------- 7: logit_bias, functions

def test_logit_bias_moves_the_sampled_tokens(daemon, tiny_model):
    c = oai(daemon)
    x, y = token_id(tiny_model, "x"), token_id(tiny_model, "y")
    forced = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                       logit_bias={str(x): 100})
    assert forced.choices[0].message.content == "xxxxx"
    vocab = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).get_vocab_size()
    banned = {str(t): -100 for t in range(vocab) if t not in (x, y)}
    only = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                temperature=1.0, seed=3, logit_bias=banned)
    assert set(only.choices[0].text) <= {"x", "y"} and len(only.choices[0].text) == 8
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                  logit_bias={"99999999": 1})
    assert "logit_bias" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                  logit_bias={"1": 101})
    assert "logit_bias" in str(bad.value)


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
])
def test_unsupported_chat_fields_are_a_400_naming_them(daemon, field, value):
    with pytest.raises(openai.BadRequestError) as bad:
        oai(daemon).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                            extra_body={field: value})
    assert field in str(bad.value)
    assert isinstance(bad.value.body, dict) and bad.value.body["param"] == field


# ---------------------------------------------------------------- 9: GET /v1/models/{id}

def test_models_retrieve_by_any_name(daemon, tiny_model):
    c = oai(daemon)
    m = c.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by == "mlxd"
    # the context a client may use, under the names clients read (the tiny model's is 256)
    assert m.model_extra is not None
    assert m.model_extra["context_length"] == m.model_extra["max_model_len"] == 256
    listed = {x.id: x.model_extra for x in c.models.list().data}
    assert listed[MODEL] is not None and listed[MODEL]["context_length"] == 256
    assert c.models.retrieve(str(tiny_model)).id == MODEL  # a path, slashes and all
    with pytest.raises(openai.NotFoundError) as missing:
        c.models.retrieve("no/such-model")
    assert isinstance(missing.value.body, dict) and missing.value.body["code"] == \
        "model_not_found"


# ---------------------------------------------------------------- n > 1, echo

def test_n_answers_share_one_prefill(daemon):
    c = oai(daemon)
    question = [{"role": "user", "content": "Name seven rivers of Europe, and say why " * 4}]
    before = daemon.stats()["engines"][0]["cache"]["prefilled_tokens"]
    r = c.chat.completions.create(model=MODEL, messages=question, max_tokens=6, n=3,
                                  temperature=1.0, seed=5)
    prefilled = daemon.stats()["engines"][0]["cache"]["prefilled_tokens"] - before
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 18
    prompt = r.usage.prompt_tokens
    assert prefilled <= prompt + 2  # one prefill; the others feed only its last token
    assert len({ch.message.content for ch in r.choices}) > 1  # seeds of their own
    again = c.chat.completions.create(model=MODEL, messages=question, max_tokens=6, n=3,
                                      temperature=1.0, seed=5)
    assert [ch.message.content for ch in again.choices] == \
        [ch.message.content for ch in r.choices]
    texts = ["", "", ""]
    for chunk in c.chat.completions.create(model=MODEL, messages=question, max_tokens=6, n=3,
                                           temperature=1.0, seed=5, stream=True,
                                           stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
        if chunk.usage:
            assert chunk.usage.completion_tokens == 18
    assert texts == [ch.message.content for ch in r.choices]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, n=0)


def test_echo_puts_the_prompt_before_the_answer(daemon, tiny_model):
    c = oai(daemon)
    plain = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    echoed = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, echo=True, stream=True))
    assert streamed == echoed.choices[0].text
    ids = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode("Once upon a time").ids
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, echo=True)
    assert by_ids.choices[0].text == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert "echo" in str(bad.value)


def test_suffix_needs_fill_in_the_middle_tokens(daemon):
    with pytest.raises(openai.BadRequestError) as bad:
        oai(daemon).completions.create(model=MODEL, prompt="def f(", suffix="    return x",
                                       max_tokens=4)
    assert "suffix" in str(bad.value)
    with pytest.raises(ollama.ResponseError) as no:
        ollama.Client(host=daemon.url).generate(model=MODEL, prompt="def f(", suffix="x")
    assert no.value.status_code == 400 and "suffix" in str(no.value)


# ---------------------------------------------------------------- a model that can do more

CODER_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for tool in tools %}"
    "{{ ' ' + tool.function.name }}{% endfor %}"
    "{{ '. Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>' }}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set tool_call = call.function %}"
    "{{ '<tool_call>{\"name\": \"' + tool_call.name + '\"}</tool_call>' }}{% endfor %}"
    "{% else %}{{ message.content.split('</think>')[-1] }}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A model whose template takes tools and knows <think>, and whose tokenizer has FIM
    tokens, served under --isolate (the pool keeps its keep_alive; an engine can be killed),
    its first two engine epochs slowed down."""
    model = write_random_model(tmp_path_factory.mktemp("models") / "coder", context=256,
                               chat_template=CODER_TEMPLATE, extra_special=FIM)
    d = start_daemon(model, "--restart-backoff", "0.1", isolate=True,
                     env={"MLXD_FAULTS": "engine.step=delay@1#<2"})  # 50 ms steps: time to aim
    yield d, model
    stop_and_check(d)


def test_fill_in_the_middle(coder):
    d, model = coder
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    pre, suf, mid = (token_id(model, t) for t in FIM)
    ids = [pre, *tok.encode("def area(r):\n").ids, suf, *tok.encode("    return a\n").ids, mid]
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
    framed = c.completions.create(model="coder", prompt=ids, max_tokens=6)
    fim = c.completions.create(model="coder", prompt="def area(r):\n", suffix="    return a\n",
                               max_tokens=6)
    assert fim.choices[0].text == framed.choices[0].text
    assert fim.usage is not None and fim.usage.prompt_tokens == len(ids)
    o = ollama.Client(host=d.url).generate(model="coder", prompt="def area(r):\n",
                                           suffix="    return a\n", options={"num_predict": 6})
    assert o.response == framed.choices[0].text


def test_ollama_metadata_and_capabilities(coder):
    d, _ = coder
    c = ollama.Client(host=d.url)
    c.generate(model="coder", prompt="hi", options={"num_predict": 1}, keep_alive="5m")
    shown = c.show("coder")
    assert set(shown.capabilities or []) == {"completion", "tools", "thinking", "insert"}
    assert shown.template and "tool_call" in shown.template
    assert shown.details is not None and shown.details.family == "llama"
    (running,) = c.ps().models
    assert running.expires_at is not None and running.size
    left = running.expires_at - datetime.now(UTC)
    assert timedelta(minutes=4) < left <= timedelta(minutes=5, seconds=1)
    c.generate(model="coder", prompt="hi", options={"num_predict": 1}, keep_alive=-1)
    (pinned,) = c.ps().models
    assert pinned.expires_at is not None and pinned.expires_at.year == 9999


def test_ollama_metadata_of_a_plain_model(daemon):
    c = ollama.Client(host=daemon.url)
    assert c.show(MODEL).capabilities == ["completion", "tools"]  # the default tool prompt
    (running,) = c.ps().models
    assert running.expires_at is not None and running.expires_at.year == 9999  # no pool


# ---------------------------------------------------------------- n > 1 and transparent resume

def _stream_choices(d: Daemon, body: dict, kill_after: int | None = None) -> list[str]:
    """Stream a chat of n answers; SIGKILL the engine after `kill_after` content chunks."""
    texts: dict[int, str] = {}
    chunks = 0
    with d.http() as c, c.stream("POST", "/v1/chat/completions",
                                 json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content")
                                                                   or "")
                chunks += bool(ch["delta"].get("content"))
                if chunks == kill_after:
                    os.kill(d.stats()["engines"][0]["pid"], signal.SIGKILL)
    return [texts[i] for i in sorted(texts)]


def test_n_answers_each_resume_after_an_engine_death(coder):
    d, _ = coder
    body = {"model": "coder", "messages": ASK, "max_tokens": 24, "n": 2, "temperature": 0.8,
            "seed": 11}
    reference = _stream_choices(d, body)
    assert len(reference) == 2 and reference[0] != reference[1]
    before = d.stats()["proxy"]["resume"]["resumes"]
    assert _stream_choices(d, body, kill_after=10) == reference
    assert d.stats()["proxy"]["resume"]["resumes"] - before == 2


# 8, the default model's Ollama metadata: tests/test_default_model.py (one daemon for all).
