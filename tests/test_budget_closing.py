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
import openai
import pytest

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
    ends on its own, the budget closes every document validly, and a budget under the
    shortest closing is refused naming the minimum."""
    from mlxd.engine.grammar.budget import BudgetTooSmall
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
        closed += p.closed_for_budget
        with pytest.raises(BudgetTooSmall, match=f"at least {shortest} tokens"):
            GrammarProcessor(tc, g, max_tokens=shortest - 1)
    assert closed >= 40  # many documents were closed by the budget, not by the walk


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
    budget, and a row the budget closed finishes with length."""
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
        shortest = GrammarProcessor(tc, g, max_tokens=10**6).budget.shortest
        budgets[f"r{i}"] = budget = min(shortest + extra, 128)
        p = GrammarProcessor(tc, g, max_tokens=budget)
        procs[f"r{i}"] = p
        sampler = make_request_sampler(SamplingParams(temperature=1.0, seed=i))
        adds.append(AddRequest(f"r{i}", tok.encode(f"Item {i}: the answer"), budget, sampler,
                               [p]))
    adds.append(AddRequest("free", tok.encode("free"), 30,
                           make_request_sampler(SamplingParams(temperature=1.0, seed=9)), []))
    outs = run_together(runner, outq, adds)[0]
    closed = 0
    for i, (seed, _) in enumerate(CASES):
        ids = outs[f"r{i}"]
        text = tok.decode([t for t in ids if t not in tok.eos_token_ids])
        jsonschema.validate(json.loads(text), random_schema(seed))
        assert len([t for t in ids if t not in tok.eos_token_ids]) <= budgets[f"r{i}"]
        closed += procs[f"r{i}"].closed_for_budget
    assert closed >= len(CASES) // 2
    assert len(outs["free"]) == 30


# ---- through the OpenAI and Anthropic routes ----

@pytest.fixture(scope="module")
def served(tiny_model):
    d = start_daemon(tiny_model, "--batch", "8")
    yield d
    stop_and_check(d)


def shortest_of(tc: Any, schema: dict) -> int:
    """The shortest forced call of `schema` (a json_schema answer's is shorter)."""
    from mlxd.engine.grammar.processor import GrammarProcessor
    from mlxd.proxy.core.constraints import Tool, call_grammar
    grammar = call_grammar([Tool("fill", "", schema)])
    guard = GrammarProcessor(tc, grammar, max_tokens=10**6).budget
    assert guard is not None and guard.shortest is not None
    return guard.shortest


def test_forced_calls_and_schema_answers_validate_at_small_budgets(served, tokenizers):
    """tool_choice required (OpenAI), tool_choice any (Anthropic), response_format
    json_schema, output_config.format and Responses' text.format, at 64-80 tokens, sampled at
    temperature 1 from a random-weight model: every call and answer validates; a document
    the budget closed says so (length / max_tokens)."""
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    ant = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Fill it in."}]
    cut = 0
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
        assert choice.finish_reason in ("tool_calls", "length")
        cut += choice.finish_reason == "length"
        r = oai.chat.completions.create(
            model="tiny-llama", messages=ask, max_tokens=budget, temperature=1.0, seed=k,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
        cut += r.choices[0].finish_reason == "length"
        m = ant.messages.create(model="tiny-llama", max_tokens=budget, messages=ask,
                                extra_body={"temperature": 1.0},
                                tools=[{"name": "fill", "input_schema": schema}],
                                tool_choice={"type": "any"})
        (block,) = m.content
        assert block.type == "tool_use"
        jsonschema.validate(block.input, schema)
        cut += m.stop_reason == "max_tokens"
        m = ant.messages.create(model="tiny-llama", max_tokens=budget, messages=ask,
                                extra_body={"temperature": 1.0, "output_config": {"format": {
                                    "type": "json_schema", "schema": schema}}})
        jsonschema.validate(json.loads(m.content[0].text), schema)
        cut += m.stop_reason == "max_tokens"
        resp = oai.responses.create(model="tiny-llama", input="Fill it in.",
                                    max_output_tokens=budget, temperature=1.0,
                                    text={"format": {"type": "json_schema", "name": "x",
                                                     "schema": schema}})
        jsonschema.validate(json.loads(resp.output_text), schema)
    assert cut >= 4  # a random-weight model runs on: the budget closed many of them


def test_a_budget_below_the_shortest_document_is_a_400(served):
    schema = {"type": "object", "additionalProperties": False,
              "required": ["first", "second", "third"],
              "properties": {"first": {"type": "string", "minLength": 20},
                             "second": {"type": "array", "minItems": 4,
                                        "items": {"type": "integer"}},
                             "third": {"enum": ["north-west"]}}}
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens to at least"):
        oai.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}})
    ant = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens to at least"):
        ant.messages.create(model="tiny-llama", max_tokens=8,
                            messages=[{"role": "user", "content": "x"}],
                            tools=[{"name": "fill", "input_schema": schema}],
                            tool_choice={"type": "any"})


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
