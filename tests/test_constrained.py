"""Structured output and forced tool calls by constrained decoding (llguidance), through a
real daemon with the official openai, anthropic and ollama clients. The model has random
weights: whatever it would say, the output must still match the schema."""

from __future__ import annotations

import json
import queue
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
    # the call and its result go back in as history (tool_choice none: offered freely, the
    # tools would go to this template-without-tools model in the default tool prompt, longer
    # than its 256-token context; tests/test_default_tools.py covers that path)
    back = oai(daemon).chat.completions.create(model=MODEL, max_tokens=4, tools=TOOLS,
                                               tool_choice="none", messages=[
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
    answered = c.messages.create(model=MODEL, max_tokens=4, tools=tools,
                                 tool_choice={"type": "none"}, messages=[
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


# ---------------------------------------------------------------- the MLX thread, in process
# The step hook (`constraints_overlap`) masks every grammar row of a step at once, after
# starting the forward pass. Its outputs must be those of the per-row processor it replaced,
# kept here as the reference.

class SyncGrammarProcessor:
    """The previous implementation: reads its token and masks its row on the MLX thread."""

    def __init__(self, tokenizers, grammar: str, replay=None) -> None:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        self._allocate, self._fill = allocate_token_bitmask, fill_next_token_bitmask
        self.matcher = llguidance.LLMatcher(tokenizers.get(), grammar)
        for t in replay or []:
            self.matcher.consume_token(t)
        self._calls = 0

    def __call__(self, context, logits):
        import mlx.core as mx
        import numpy as np
        if self._calls:
            self.matcher.consume_token(context[-1].item())
        self._calls += 1
        vocab = logits.shape[-1]
        bitmask = self._allocate(1, vocab)
        if self.matcher.is_error():
            return logits
        self._fill(self.matcher, bitmask, 0)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab]
        return mx.where(mx.array(allowed.astype(np.bool_)), logits, float("-inf"))


SMALL: dict[str, object] = {
    "type": "object", "additionalProperties": False, "required": ["n", "ok"],
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 6}}}


@pytest.fixture(scope="module")
def engine_parts(tiny_model, tmp_path_factory):
    from mlxd.engine.grammar.processor import TokenizerCache
    from mlxd.engine.load.loader import load_model
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("grammar"))
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    return m, tok, TokenizerCache(tok._tokenizer, vocab, sorted(tok.eos_token_ids))


def grammars() -> dict[str, str]:
    from llguidance import LLMatcher
    return {"json": LLMatcher.grammar_from_json_schema(
                SMALL, defaults={"whitespace_flexible": False}),
            "regex": LLMatcher.grammar_from_regex(r"(cat|dog|bird)s? [0-9]{1,3}( and [a-z]+)*\.")}


def decode_rows(parts, rows, batch: int = 8, fill_first: bool = True) -> dict[str, list[int]]:
    """Run `rows` [(id, prompt, max_tokens, sampler, processors)] through one Runner
    (`fill_first`: the `grammar_order` setting's default, else dispatch-first)."""
    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.protocol.settings import TuningSettings
    from support.runner_drive import run_together
    m, tok, _ = parts
    outq: queue.Queue = queue.Queue()
    tuning = TuningSettings(grammar_order="fill-first" if fill_first else "dispatch-first")
    r = Runner(m, sorted(tok.eos_token_ids), batch_size=batch, prefill_step=64, outbox=outq,
               tuning=tuning)
    return run_together(r, outq, [AddRequest(rid, prompt, max_tokens, sampler, procs)
                                  for rid, prompt, max_tokens, sampler, procs in rows])[0]


def both_ways(parts, kinds: list[str | None], seeds: list[int], monkeypatch,
              max_tokens: int = 40, replay: dict[int, list[int]] | None = None,
              sampler_of=None, fill_first: bool = True):
    """The same rows decoded with the new processor and the reference; returns both outputs
    and how many steps the new one masked through the batched plan."""
    from mlxd.engine.admit.sampling import make_request_sampler
    from mlxd.engine.grammar import steps as constraints_overlap
    from mlxd.engine.grammar.processor import GrammarProcessor
    from mlxd.protocol.messages import SamplingParams
    _, tok, tc = parts
    g = grammars()
    planned = [0]
    original = constraints_overlap.StepPlan._compute

    def counting(self, logits):
        planned[0] += 1
        whole[0] += bool(self._whole)
        return original(self, logits)
    monkeypatch.setattr(constraints_overlap.StepPlan, "_compute", counting)
    whole = WHOLE_STEPS
    whole[0] = 0
    outs = []
    for cls in (GrammarProcessor, SyncGrammarProcessor):
        rows = []
        for i, (kind, seed) in enumerate(zip(kinds, seeds, strict=True)):
            back = (replay or {}).get(i, [])
            p = SamplingParams(temperature=0.0 if seed < 0 else 0.9, seed=max(seed, 0))
            sampler = (sampler_of(i) if sampler_of else None) or make_request_sampler(
                p, start_position=len(back))
            procs = [] if kind is None else [cls(tc, g[kind], replay=back)]
            rows.append((f"r{i}", tok.encode(f"Item {i}: the answer") + back,
                         max_tokens, sampler, procs))
        outs.append(decode_rows(parts, rows, fill_first=fill_first))
    return outs[0], outs[1], planned[0]


WHOLE_STEPS = [0]  # steps masked for the whole batch in one op (WholeBatchMask), last both_ways


def text_ok(tok, kind: str, ids: list[int]) -> None:
    import re
    text = tok.decode([t for t in ids if t not in tok.eos_token_ids])
    if kind == "json":
        jsonschema.validate(json.loads(text), SMALL)
    else:
        assert re.fullmatch(r"(cat|dog|bird)s? [0-9]{1,3}( and [a-z]+)*\.", text), text


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_overlapped_masks_equal_the_per_row_processor_alone(engine_parts, monkeypatch, kind):
    new, ref, planned = both_ways(engine_parts, [kind], [-1], monkeypatch, max_tokens=60)
    assert new == ref and planned > 0
    if ref["r0"][-1] in engine_parts[1].eos_token_ids:  # finished: the whole text obeys
        text_ok(engine_parts[1], kind, ref["r0"])


@pytest.mark.parametrize("fill_first", [True, False], ids=["fill-first", "dispatch-first"])
def test_overlapped_masks_equal_the_per_row_processor_in_a_mixed_batch(engine_parts, monkeypatch,
                                                                        fill_first):
    """Greedy and seeded grammar rows beside free rows, in one batch; in either order of a
    step (masks filled while the forward pass is dispatched, or after)."""
    kinds: list[str | None] = ["json", None, "regex", "json", None, "regex"]
    seeds = [-1, -1, 7, 11, 5, -1]
    new, ref, planned = both_ways(engine_parts, kinds, seeds, monkeypatch, fill_first=fill_first)
    assert new == ref
    assert planned >= 10  # the steps went through the batched path, not row by row
    assert WHOLE_STEPS[0] >= 10  # ... one mask op for the batch, mlx-lm's per-row loop skipped
    assert len(new["r1"]) == 40 and len(new["r4"]) == 40  # free rows ran their course
    _, tok, _ = engine_parts
    for i, kind in enumerate(kinds):
        ids = new[f"r{i}"]
        if kind is not None and ids[-1] in tok.eos_token_ids:
            text_ok(tok, kind, ids)


def test_a_grammar_failing_midway_leaves_the_row_unconstrained_as_before(
        engine_parts, monkeypatch, caplog):
    """A token the grammar refuses (here forced by the sampler) puts the matcher in error:
    the row goes on unconstrained, with one warning, exactly as the reference does."""
    import mlx.core as mx
    from mlx_lm.sample_utils import greedy_sampler
    _, tok, _ = engine_parts
    bad = tok.encode("}")[-1]

    def sampler_of(i: int):  # called once per run: each run counts from 0
        if i != 0:
            return None
        calls = [0]

        def forcing(logprobs):
            calls[0] += 1
            return mx.array([bad]) if calls[0] == 4 else greedy_sampler(logprobs)
        return forcing
    with caplog.at_level("WARNING", logger="mlxd.engine"):
        new, ref, planned = both_ways(engine_parts, ["json", "json", None], [-1, -1, -1],
                                      monkeypatch, max_tokens=20, sampler_of=sampler_of)
    assert new == ref and planned > 0
    assert new["r0"][3] == bad and len(new["r0"]) == 20
    warnings = [r for r in caplog.records if "output grammar failed" in r.getMessage()]
    assert len(warnings) == 1  # the reference logs nothing; the new one warns once


def test_resumed_rows_replay_their_tokens_first(engine_parts, monkeypatch):
    """A resumed request's processor replays what was delivered; the continuation is that of
    the reference, and the whole answer still obeys the grammar."""
    full, _, _ = both_ways(engine_parts, ["json", "regex"], [-1, -1], monkeypatch, max_tokens=60)
    replay = {0: full["r0"][:5], 1: full["r1"][:3]}
    new, ref, planned = both_ways(engine_parts, ["json", "regex"], [-1, -1], monkeypatch,
                                  max_tokens=20, replay=replay)
    assert new == ref and planned > 0
    _, tok, _ = engine_parts
    for i, kind in enumerate(["json", "regex"]):
        ids = replay[i] + new[f"r{i}"]
        if ids[-1] in tok.eos_token_ids:
            text_ok(tok, kind, ids)


def test_token_feed_consumes_each_position_once_and_in_order():
    """The feed between the plan, the per-row path and the matcher, on a fake sequence."""
    from mlxd.engine.grammar.processor import OutOfOrder, TokenFeed

    class Fake:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def consume_token(self, t: int) -> bool:
            self.seen.append(t)
            return True
    fake = Fake()
    feed = TokenFeed(fake)
    sequence = [5, 9, 2, 7]
    for pos, t in enumerate(sequence):
        feed.consume(pos, t)
        feed.consume(pos, t + 100)  # offered again (a second path): not consumed twice
        assert feed.due(pos) is False
    assert fake.seen == sequence and feed.consumed == 4
    with pytest.raises(OutOfOrder):
        feed.consume(6, 1)  # position 4 and 5 never came: refused, nothing consumed
    assert fake.seen == sequence
    assert feed.due(4)


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("vocab", [5, 32, 33, 49155])
def test_bitmasks_unpack_to_the_tokens_they_allow(vocab, on_device):
    import numpy as np

    from mlxd.engine.grammar.processor import unpack_bits
    rng = np.random.default_rng(vocab)
    words = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32), dtype=np.int64)
    bits = words.astype(np.int32)
    want = np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(3, -1)[:, :vocab]
    got = np.array(unpack_bits(bits, vocab, on_device))
    assert got.dtype == np.bool_ and (got == want.astype(bool)).all()
