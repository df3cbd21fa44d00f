"""Budget-aware JSON constraints (issue 34, item 1): a forced tool call or a json_schema answer
that a budget would cut is closed validly instead (`engine/grammar/budget.py`,
`engine/grammar/closing.py`). Random schemas (tests/support/json_schemas.py) against the
closing alone (a tokenizer, no model), against the guard with a run-on token policy, through
the engine's runner on a random-weight model, and through the OpenAI and Anthropic routes.
The full sweep (200 schemas x budgets, random and default model) is
benchmarks/budget_closing.py."""

from __future__ import annotations

import json
import queue
import random
from typing import Any

import anthropic
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import start_daemon, stop_and_check
from support.json_schemas import random_schema


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    from transformers import AutoTokenizer

    from mlxd.engine.grammar.processor import TokenizerCache
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    n_vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    return hf, TokenizerCache(hf, n_vocab, [hf.convert_tokens_to_ids("<|im_end|>")])


def grammar_of(schema: dict) -> str:
    from mlxd.proxy.core.constraints import schema_grammar
    return schema_grammar(schema, "schema")


def shortest_answer(tc: Any, schema: dict) -> int:
    """The shortest json_schema answer of `schema`."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    shortest = GrammarProcessor(tc, grammar_of(schema), max_tokens=10**6).shortest
    assert shortest is not None
    return shortest


def allowed(bits: np.ndarray, n_vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab])


def test_lexical_state_follows_strings_keys_numbers_and_containers():
    from mlxd.engine.grammar.closing import JsonLex
    lex = JsonLex()
    lex.feed(b'{"a\\"b')
    assert lex.in_string and lex.in_key and not lex.in_value
    lex.feed(b'":[1')
    assert not lex.in_string and lex.scalar == "number" and lex.in_value and lex.stack == "{["
    lex.feed(b'],"')
    assert lex.in_key and lex.stack == "{"
    lex.feed(b'x":"\xc3')  # a value, and a UTF-8 character cut after its first byte
    assert lex.in_value and lex.utf8_left == 1
    assert lex.candidates()[0] >= 0x80
    lex.feed(b'\xa9"')
    assert not lex.in_string and lex.candidates()[:3] == b"}],"
    lex.feed(b',"t":tr')
    assert lex.scalar == "literal" and not lex.in_value


def test_closings_of_200_schemas_from_random_prefixes_validate(tokenizers):
    """For each schema, a random walk through what its grammar allows (a run-on model's
    output, cut anywhere), then the closing: the whole parses and validates."""
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from mlxd.engine.grammar.budget import BudgetGuard, closing_vocab
    hf, tc = tokenizers
    ll, n_vocab = tc.get(), tc.n_vocab
    vocab = closing_vocab(ll, n_vocab)
    rng = random.Random(0)
    bits = allocate_token_bitmask(1, n_vocab)
    for seed in range(200):
        schema = random_schema(seed)
        m = llguidance.LLMatcher(ll, grammar_of(schema))
        history: list[int] = []
        guard = BudgetGuard(vocab, m, 10**6, history)
        for _ in range(rng.randint(0, 40)):
            fill_next_token_bitmask(m, bits, 0)
            ids = [t for t in allowed(bits, n_vocab) if t not in ll.eos_tokens]
            if not ids:
                break
            t = int(rng.choice(ids))
            assert m.consume_token(t)
            history.append(t)
        tail = guard._closing_tokens()
        assert tail is not None, (seed, ll.decode_bytes(history))
        text = ll.decode_bytes(history + tail).decode()
        jsonschema.validate(json.loads(text), schema)


def run_on(tc: Any, grammar: str, budget: int, rng: random.Random) -> tuple[list[int], Any]:
    """The guard's masks step by step, with a model that never ends on its own (any allowed
    token but the end, at random)."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    p = GrammarProcessor(tc, grammar, max_tokens=budget)
    out: list[int] = []
    eos = set(tc.get().eos_tokens)
    for pos in range(budget):
        ids = allowed(p.row_bits(tc.n_vocab), tc.n_vocab)
        rest = [t for t in ids if t not in eos]
        if not rest:
            break
        t = int(rng.choice(rest))
        p.feed.consume(pos, t)
        out.append(t)
    return out, p


def test_run_on_rows_end_valid_within_every_budget(tokenizers):
    """200 schemas, each at a budget from its shortest closing + 8 to 128: the row never
    ends on its own, the budget closes every document validly (complete: the grammar
    accepts it), and a budget under the shortest closing is not refused: that row gets no
    guard (it is cut by max_tokens as any row)."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    hf, tc = tokenizers
    rng = random.Random(1)
    closed = 0
    for seed in range(200):
        schema = random_schema(seed)
        g = grammar_of(schema)
        guard = GrammarProcessor(tc, g, max_tokens=10**6).budget
        assert guard is not None and guard.shortest is not None
        shortest = guard.shortest
        budget = rng.randint(shortest + 8, max(128, shortest + 8))
        out, p = run_on(tc, g, budget, rng)
        assert len(out) <= budget
        jsonschema.validate(json.loads(hf.decode(out)), schema)
        assert p.matcher.is_accepting()
        closed += p.closed_for_budget
        under = GrammarProcessor(tc, g, max_tokens=shortest - 1)
        assert under.budget is None and under.shortest == shortest
        assert under.feed.history is None  # nothing kept for a guard it does not have
    assert closed >= 40  # many documents were closed by the budget, not by the walk


def test_a_closing_that_fills_the_budget_is_complete_at_the_last_token(tokenizers):
    """A budget of exactly the shortest closing: the closing is forced from the first token
    and ends in the last one, with no room for the end token (mlx-lm then says length).
    `completed_by` tells the runner the document is complete, whether or not the matcher
    consumed that last token yet; a token earlier it is not."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    hf, tc = tokenizers
    for seed in (3, 47, 77):
        schema = random_schema(seed)
        g = grammar_of(schema)
        shortest = GrammarProcessor(tc, g, max_tokens=10**6).shortest
        assert shortest is not None
        p = GrammarProcessor(tc, g, max_tokens=shortest)
        out: list[int] = []
        for pos in range(shortest):
            ids = allowed(p.row_bits(tc.n_vocab), tc.n_vocab)
            assert len(ids) == 1  # forced all the way
            out.append(int(ids[0]))
            if pos < shortest - 1:
                assert not p.completed_by(pos, out[-1])
                p.feed.consume(pos, out[-1])
        jsonschema.validate(json.loads(hf.decode(out)), schema)
        assert p.completed_by(shortest - 1, out[-1])  # not consumed yet: offered to a copy
        assert p.feed.consumed == shortest - 1
        p.feed.consume(shortest - 1, out[-1])
        assert p.completed_by(shortest - 1, out[-1])  # consumed already (mlx-lm's next step)


def test_without_a_budget_run_on_rows_are_cut_invalid(tokenizers):
    """What the guard prevents: the same run-on rows, unguarded, end as invalid JSON."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    hf, tc = tokenizers
    rng = random.Random(2)
    invalid = 0
    for seed in range(20):
        p = GrammarProcessor(tc, grammar_of(random_schema(seed)))
        out = []
        for pos in range(32):
            bits = p.row_bits(tc.n_vocab)
            rest = [t for t in allowed(bits, tc.n_vocab) if t not in tc.get().eos_tokens]
            if not rest:
                break
            t = int(rng.choice(rest))
            p.feed.consume(pos, t)
            out.append(t)
        try:
            json.loads(hf.decode(out))
        except ValueError:
            invalid += 1
    assert invalid >= 8


# ---- the engine's runner, a random-weight model ----

CASES = [(seed, extra) for seed in (3, 17, 42, 77, 105, 150) for extra in (8, 40)]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory, tokenizers):
    from mlxd.engine.load.loader import load_model
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("budget"))
    return m, tok, tokenizers[1]


def test_runner_closes_rows_within_their_budget(engine):
    """A batch of constrained rows (seeded sampling at temperature 1: a random-weight model
    runs on) beside a free row: every document parses and validates, is no longer than its
    budget, and finishes with stop, also a row the budget closed (its document is complete);
    the free row is cut with length. Two rows whose budget is exactly the shortest closing
    (the closing fills it, no room for the end token: mlx-lm says length) finish with stop
    too; one a token under it gets no guard and is cut with length."""
    from mlxd.engine.admit.sampling import make_request_sampler
    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.grammar.processor import GrammarProcessor
    from mlxd.protocol.messages import SamplingParams
    from support.runner_drive import run_together
    m, tok, tc = engine
    outq: queue.Queue = queue.Queue()
    runner = Runner(m, sorted(tok.eos_token_ids), batch_size=16, prefill_step=64, outbox=outq)
    adds, procs, budgets = [], {}, {}
    for i, (seed, extra) in enumerate(CASES):
        g = grammar_of(random_schema(seed))
        budgets[f"r{i}"] = budget = min(shortest_answer(tc, random_schema(seed)) + extra, 128)
        p = GrammarProcessor(tc, g, max_tokens=budget)
        procs[f"r{i}"] = p
        sampler = make_request_sampler(SamplingParams(temperature=1.0, seed=i))
        adds.append(AddRequest(f"r{i}", tok.encode(f"Item {i}: the answer"), budget, sampler,
                               [p]))
    adds.append(AddRequest("free", tok.encode("free"), 30,
                           make_request_sampler(SamplingParams(temperature=1.0, seed=9)), []))
    exact = {"exact0": 3, "exact1": 77, "under": 17}
    for rid, seed in exact.items():
        g = grammar_of(random_schema(seed))
        budgets[rid] = shortest_answer(tc, random_schema(seed)) - (rid == "under")
        adds.append(AddRequest(rid, tok.encode(f"{rid}: the answer"), budgets[rid],
                               make_request_sampler(SamplingParams(temperature=1.0, seed=5)),
                               [GrammarProcessor(tc, g, max_tokens=budgets[rid])]))
    finishes: dict[str, str] = {}
    outs = run_together(runner, outq, adds, finishes)[0]
    closed = 0
    for i, (seed, _) in enumerate(CASES):
        ids = outs[f"r{i}"]
        text = tok.decode([t for t in ids if t not in tok.eos_token_ids])
        jsonschema.validate(json.loads(text), random_schema(seed))
        assert len([t for t in ids if t not in tok.eos_token_ids]) <= budgets[f"r{i}"]
        assert finishes[f"r{i}"] == "stop", (i, text)
        closed += procs[f"r{i}"].closed_for_budget
    assert closed >= len(CASES) // 2
    assert len(outs["free"]) == 30 and finishes["free"] == "length"
    for rid in ("exact0", "exact1"):
        ids = outs[rid]
        assert len(ids) == budgets[rid] and not set(ids) & set(tok.eos_token_ids)
        jsonschema.validate(json.loads(tok.decode(ids)), random_schema(exact[rid]))
        assert finishes[rid] == "stop"
    assert len(outs["under"]) == budgets["under"] and finishes["under"] == "length"


# ---- through the OpenAI and Anthropic routes ----

@pytest.fixture(scope="module")
def served(tiny_model):
    d = start_daemon(tiny_model, "--batch", "8")
    yield d
    stop_and_check(d)


def shortest_of(tc: Any, schema: dict, name: str = "fill") -> int:
    """The shortest forced call of `schema` (a json_schema answer's is shorter)."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    from mlxd.proxy.core.constraints import Tool, call_grammar
    grammar = call_grammar([Tool(name, "", schema)])
    guard = GrammarProcessor(tc, grammar, max_tokens=10**6).budget
    assert guard is not None and guard.shortest is not None
    return guard.shortest


def test_forced_calls_and_schema_answers_validate_at_small_budgets(served, tokenizers):
    """tool_choice required (OpenAI), tool_choice any (Anthropic), response_format
    json_schema, output_config.format, Responses' text.format and Ollama's format, at 64-80
    tokens, sampled at temperature 1 from a random-weight model (its strings run on): every
    call and answer validates, and each finishes as a complete one does (tool_calls / stop,
    tool_use / end_turn, completed, stop), also where the budget closed it (that the budget
    closes such rows, not the model, is counted on the runner above: at least half)."""
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    ant = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    olm = ollama.Client(host=served.url)
    ask = [{"role": "user", "content": "Fill it in."}]
    used = []  # output tokens / budget of each answer
    for k, seed in enumerate((5, 23, 61)):
        schema = random_schema(seed)
        # 64-80 tokens, or the shortest document's + 8 (the tiny tokenizer's tokens are short)
        budget = max(64 + 8 * k, shortest_of(tokenizers[1], schema) + 8)
        tools = [{"type": "function", "function": {"name": "fill", "parameters": schema}}]
        r = oai.chat.completions.create(model="tiny-llama", messages=ask, max_tokens=budget,
                                        temperature=1.0, seed=k, tools=tools,
                                        tool_choice="required")
        choice = r.choices[0]
        (call,) = choice.message.tool_calls or []
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert choice.finish_reason == "tool_calls"
        used.append(r.usage.completion_tokens / budget)
        r = oai.chat.completions.create(
            model="tiny-llama", messages=ask, max_tokens=budget, temperature=1.0, seed=k,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
        assert r.choices[0].finish_reason == "stop"
        used.append(r.usage.completion_tokens / budget)
        m = ant.messages.create(model="tiny-llama", max_tokens=budget, messages=ask,
                                extra_body={"temperature": 1.0},
                                tools=[{"name": "fill", "input_schema": schema}],
                                tool_choice={"type": "any"})
        (block,) = m.content
        assert block.type == "tool_use"
        jsonschema.validate(block.input, schema)
        assert m.stop_reason == "tool_use"
        used.append(m.usage.output_tokens / budget)
        m = ant.messages.create(model="tiny-llama", max_tokens=budget, messages=ask,
                                extra_body={"temperature": 1.0, "output_config": {"format": {
                                    "type": "json_schema", "schema": schema}}})
        jsonschema.validate(json.loads(m.content[0].text), schema)
        assert m.stop_reason == "end_turn"
        resp = oai.responses.create(model="tiny-llama", input="Fill it in.",
                                    max_output_tokens=budget, temperature=1.0,
                                    text={"format": {"type": "json_schema", "name": "x",
                                                     "schema": schema}})
        jsonschema.validate(json.loads(resp.output_text), schema)
        assert resp.status == "completed" and resp.incomplete_details is None
        o = olm.chat(model="tiny-llama", messages=ask, format=schema,
                     options={"num_predict": budget, "temperature": 1.0, "seed": k})
        jsonschema.validate(json.loads(o.message.content or ""), schema)
        assert o.done_reason == "stop"
    assert all(0 < u <= 1 for u in used)


class Place(BaseModel):
    name: str
    big: bool
    rank: int = Field(ge=1, le=99)
    tags: list[str]


def test_the_openai_sdk_parses_answers_the_budget_closed(served, tokenizers):
    """The official client's `parse()` raises LengthFinishReasonError on finish length: a
    json_schema answer and a forced call (`pydantic_function_tool`) that the budget closed
    come back parsed, as the model class, with finish stop / tool_calls, at every budget from
    the shortest answer up (the shortest itself: the closing fills the budget)."""
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Describe a place."}]
    schema = openai.lib._pydantic.to_strict_json_schema(Place)
    lo = shortest_answer(tokenizers[1], schema)
    for k, budget in enumerate((lo, lo + 1, lo + 5, 40, 64)):
        r = oai.chat.completions.parse(model="tiny-llama", messages=ask, max_tokens=budget,
                                       temperature=1.0, seed=k, response_format=Place)
        choice = r.choices[0]
        assert isinstance(choice.message.parsed, Place), choice.message.content
        assert choice.finish_reason == "stop"
        assert r.usage is not None and r.usage.completion_tokens <= budget
    lo = shortest_of(tokenizers[1], schema, "Place")
    for k, budget in enumerate((lo, lo + 3, 64)):
        r = oai.chat.completions.parse(
            model="tiny-llama", messages=ask, max_tokens=budget, temperature=1.0, seed=k,
            tools=[openai.pydantic_function_tool(Place)],
            tool_choice={"type": "function", "function": {"name": "Place"}})
        choice = r.choices[0]
        (call,) = choice.message.tool_calls or []
        assert isinstance(call.function.parsed_arguments, Place)
        assert choice.finish_reason == "tool_calls"
    with pytest.raises(openai.LengthFinishReasonError):  # under the shortest: cut, as before
        oai.chat.completions.parse(model="tiny-llama", messages=ask, max_tokens=lo // 2,
                                   temperature=1.0, seed=0, response_format=Place)


def test_a_budget_below_the_shortest_document_is_served_and_cut(served, tokenizers):
    """Under the shortest closing there is no valid document to steer to: the request is
    served (no 400) and cut by max_tokens as any answer, finish length / max_tokens (a
    forced call still arrives as a call, its arguments closed where they stopped)."""
    schema = {"type": "object", "additionalProperties": False,
              "required": ["first", "second", "third"],
              "properties": {"first": {"type": "string", "minLength": 20},
                             "second": {"type": "array", "minItems": 4,
                                        "items": {"type": "integer"}},
                             "third": {"enum": ["north-west"]}}}
    assert shortest_answer(tokenizers[1], schema) > 8
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    r = oai.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert (r.choices[0].message.content or "").startswith('{"first"')
    r = oai.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=8,
        tools=[{"type": "function", "function": {"name": "fill", "parameters": schema}}],
        tool_choice="required")
    assert r.choices[0].finish_reason == "length"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "fill" and isinstance(json.loads(call.function.arguments), dict)
    ant = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    m = ant.messages.create(model="tiny-llama", max_tokens=8,
                            messages=[{"role": "user", "content": "x"}],
                            tools=[{"name": "fill", "input_schema": schema}],
                            tool_choice={"type": "any"})
    assert m.stop_reason == "max_tokens"
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "fill"


def test_a_heavy_optional_key_opened_far_out_still_fits(tokenizers):
    """Schema 47's optional "when" holds an object of required keys: one free token opening
    it adds some 60 tiny-tokenizer tokens to the closing at once. The calm mode starts as far
    out as the fully required schema's document (38 of 150 run-on rows were cut when it
    started at a fixed 64)."""
    hf, tc = tokenizers
    schema = random_schema(47)
    g = grammar_of(schema)
    for seed in range(40):
        out, _ = run_on(tc, g, 128, random.Random(seed))
        jsonschema.validate(json.loads(hf.decode(out)), schema)


def test_a_schemas_start_is_searched_once_for_a_burst(tokenizers, monkeypatch):
    """A burst of requests with one schema (an app's response format at 32 streams) searches
    the document's shortest closing once, not once a request: the search holds the GIL on an
    admission lane for up to ~0.1 s (a long array's), which made a 32-request constrained
    burst decode at 0.1x of a free one on this CPU (benchmarks/RESULTS.md, "Constrained
    decoding vs free"); and builds the grammar's matcher once (~1 ms), each row taking a copy.
    The guards made from the memo decide as a fresh search does."""
    from mlxd.engine.grammar import budget, processor
    from mlxd.engine.grammar.processor import GrammarProcessor
    _, tc = tokenizers
    searches: list[int] = []
    real = budget.closing

    def counted(*args: Any) -> Any:
        searches.append(1)
        return real(*args)
    monkeypatch.setattr(budget, "closing", counted)
    memo = budget.StartMemo()  # not other tests' entries
    monkeypatch.setattr(budget, "start_memo", memo)
    monkeypatch.setattr(processor, "start_memo", memo)
    import llguidance
    built: list[int] = []
    real_matcher = llguidance.LLMatcher

    class CountedMatcher:  # llguidance.LLMatcher, its constructions counted
        def __call__(self, *args: Any) -> Any:
            built.append(1)
            return real_matcher(*args)

        def __getattr__(self, name: str) -> Any:
            return getattr(real_matcher, name)
    monkeypatch.setattr(llguidance, "LLMatcher", CountedMatcher())
    schema = random_schema(47)  # an optional heavy key: the widest jump is searched as well
    g = grammar_of(schema)
    first = GrammarProcessor(tc, g, max_tokens=128)
    after_first, matchers = len(searches), len(built)
    assert after_first >= 2  # the closing and the widest jump
    rows = [GrammarProcessor(tc, g, max_tokens=128) for _ in range(31)]
    assert len(searches) == after_first
    assert len(built) == matchers  # each row's matcher is a copy of the grammar's start
    # the copies are the rows' own: one row's tokens do not move another's matcher
    ff = rows[0].matcher.compute_ff_tokens()
    forced = ff[0] if ff else int(allowed(rows[0].row_bits(tc.n_vocab), tc.n_vocab)[0])
    rows[0].matcher.consume_token(forced)
    assert rows[1].matcher.compute_ff_tokens() == first.matcher.compute_ff_tokens() == ff
    assert np.array_equal(rows[1].row_bits(tc.n_vocab), first.row_bits(tc.n_vocab))
    assert first.budget is not None
    for p in rows:
        assert p.shortest == first.shortest
        assert p.budget is not None and p.budget.calm == first.budget.calm
    # a resumed row (tokens replayed) starts elsewhere: searched for itself
    GrammarProcessor(tc, g, replay=first.matcher.compute_ff_tokens()[:1] or [], max_tokens=128)
    # rows run on to the end of their budget as unmemoized ones do
    for seed in range(6):
        out, _ = run_on(tc, g, 128, random.Random(seed))
        jsonschema.validate(json.loads(tokenizers[0].decode(out)), schema)
