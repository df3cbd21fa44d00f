"""The proxy's dialect-neutral core (proxy/core/sampling.py and the dialect packages), without
processes: each dialect maps its own field names onto one SamplingRequest, max_tokens travels
once and is judged against the context in one place, and no dialect reaches into another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core.sampling import Defaults, SamplingRequest, check_sampling
from mlxd.proxy.dialects.anthropic import schema as anthropic
from mlxd.proxy.dialects.ollama import schema as ollama
from mlxd.proxy.dialects.openai import schema as openai
from mlxd.proxy.errors import APIError

DIALECTS = Path(__file__).resolve().parents[1] / "proxy" / "dialects"
DEFAULTS = Defaults(temperature=0.3, top_p=0.9, top_k=40, max_tokens=64)


def test_each_dialect_fills_the_same_neutral_request():
    seed, stop = 7, ["END"]
    by_openai = openai.sampling(decode_body(
        b'{"messages": [], "max_tokens": 5, "max_completion_tokens": 9, "top_k": 3,'
        b'"seed": 7, "stop": "END", "temperature": 0.5}', openai.ChatRequest), DEFAULTS)
    by_anthropic = anthropic.sampling(decode_body(
        b'{"model": "m", "messages": [], "max_tokens": 9, "top_k": 3,'
        b'"stop_sequences": ["END"], "temperature": 0.5}', anthropic.MessagesRequest), DEFAULTS)
    by_ollama = ollama.sampling(decode_body(
        b'{"model": "m", "options": {"num_predict": 9, "top_k": 3, "seed": 7,'
        b'"stop": ["END"], "temperature": 0.5}}', ollama.ChatRequest), DEFAULTS)
    expected = check_sampling(SamplingRequest(temperature=0.5, top_k=3, seed=seed, stop=stop,
                                              max_tokens=9), DEFAULTS)
    for got in (by_openai, by_ollama):  # max_completion_tokens wins over max_tokens
        assert got == expected
    # Anthropic has no seed (the proxy draws one); everything else is the same.
    assert by_anthropic.max_tokens_explicit
    same = {f: getattr(expected.params, f) for f in expected.params.__struct_fields__
            if f != "seed"}
    assert {f: getattr(by_anthropic.params, f) for f in same} == same


def test_defaults_fill_what_is_left_out_and_ollama_repeat_penalty_maps():
    got = ollama.sampling(decode_body(b'{"model": "m", "options": {"num_predict": -1, '
                                      b'"repeat_penalty": 1.3}}', ollama.ChatRequest), DEFAULTS)
    p = got.params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.9, 40, 64)
    assert p.repetition_penalty == 1.3 and not got.max_tokens_explicit
    with pytest.raises(APIError) as e:
        ollama.sampling(decode_body(b'{"model": "m", "options": {"num_predict": 0}}',
                                    ollama.ChatRequest), DEFAULTS)
    assert e.value.status == 400 and "num_predict" in e.value.message


def test_max_tokens_explicit_above_the_context_is_refused_a_default_is_not():
    explicit = check_sampling(SamplingRequest(max_tokens=200), DEFAULTS)
    assert explicit.params_for(200).max_tokens == 200
    assert explicit.params_for(0).max_tokens == 200  # context not known yet: no judgement
    with pytest.raises(APIError) as e:
        explicit.params_for(199)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    default = check_sampling(SamplingRequest(), Defaults(max_tokens=500))
    assert default.params_for(100).max_tokens == 500  # the engine clamps it to what is left


def test_bad_values_are_refused_with_the_field_named():
    for req, param in ((SamplingRequest(temperature=2.5), "temperature"),
                       (SamplingRequest(top_p=0.0), "top_p"),
                       (SamplingRequest(min_p=1.5), "min_p"),
                       (SamplingRequest(repetition_penalty=0.0), "repetition_penalty"),
                       (SamplingRequest(stop=[""]), "stop"),
                       (SamplingRequest(stop=["x"] * 17), "stop")):
        with pytest.raises(APIError) as e:
            check_sampling(req, DEFAULTS)
        assert e.value.status == 400 and e.value.param == param


def test_no_dialect_imports_another():
    names = sorted(p.name for p in DIALECTS.iterdir() if (p / "__init__.py").exists())
    assert {"anthropic", "ollama", "openai", "responses", "embeddings"} <= set(names)
    for name in names:
        for path in (DIALECTS / name).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    parts = node.module.split(".")
                    if parts[:3] == ["mlxd", "proxy", "dialects"] and len(parts) > 3:
                        assert parts[3] == name, f"{path} imports {node.module}"
