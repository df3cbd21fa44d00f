"""LoRA adapters (issue 16): rows of different adapters of one base in one batch, each equal to
mlx-lm's own `load(base, adapter_path=...)` + greedy generation; caches keyed by adapter;
adapter names routed, listed and validated by the daemon."""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from mlxd.daemon.settings import ConfigError
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.runner import Runner
from mlxd.engine.kinds.text.lora import (
    AdapterError,
    apply_adapters,
    mark_prompt,
    unmarked_processors,
)
from mlxd.engine.load.loader import load_model
from mlxd.protocol.block_format import chain_keys
from mlxd.protocol.models import adapter_bytes
from support.lora_adapters import write_random_adapter
from support.random_model import write_random_model
from support.runner_drive import run_together

N = 10  # tokens generated per request
PROMPTS = ["Hello, how are you today?", "The quick brown fox jumps",
           "def main():\n    print('hello world')\n    return 0\n" * 2]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        # every linear of every layer, rank 8; and a rank-4 one on three kinds of layer only
        "coder": write_random_adapter(tiny_model, root / "coder", seed=1),
        "writer": write_random_adapter(tiny_model, root / "writer", seed=2, rank=4, scale=6.0,
                                       keys=["self_attn.q_proj", "self_attn.v_proj",
                                             "mlp.down_proj"]),
    }


@pytest.fixture(scope="module")
def references(tiny_model, adapters):
    """name ("" the base) -> prompt index -> mlx-lm's own greedy tokens."""
    out = {}
    for name in ["", *adapters]:
        model, tok = load(str(tiny_model), adapter_path=str(adapters[name]) if name else None)[:2]
        out[name] = [[int(t) for (t, _), _ in zip(
            generate_step(mx.array(tok.encode(p)), model, sampler=greedy_sampler), range(N),
            strict=False)] for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def served(tiny_model, adapters, tmp_path_factory):
    model, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("c"))
    lset = apply_adapters(model, {n: str(p) for n, p in adapters.items()})
    assert lset is not None
    return model, tok, lset


def _add(lset, tok, rid: str, name: str, prompt: str, processors=()) -> AddRequest:
    index = lset.index(name) if name else 0
    return AddRequest(rid, mark_prompt(tok.encode(prompt), index, lset.vocab), N,
                      greedy_sampler, unmarked_processors(list(processors), lset.vocab))


def test_rows_of_two_adapters_and_the_base_in_one_batch_equal_mlx_lm(served, references):
    """Nine requests, interleaved (base, coder, writer, base, ...), prefilled in chunks of 16
    tokens and decoded together: each row's tokens are mlx-lm's for its own adapter."""
    model, tok, lset = served
    outq: queue.Queue = queue.Queue()
    runner = Runner(model, [], batch_size=16, prefill_step=16, outbox=outq, cache_bytes=0)
    adds = [_add(lset, tok, f"{i}-{name}", name, p)
            for i, p in enumerate(PROMPTS) for name in ("", "coder", "writer")]
    tokens, _ = run_together(runner, outq, adds)
    assert runner.counters.peak_batch == len(adds)  # all of them in one batch
    for i in range(len(PROMPTS)):
        for name in ("", "coder", "writer"):
            assert tokens[f"{i}-{name}"] == references[name][i], (i, name)
    # the adapters do change the output (else this test would prove nothing)
    assert references["coder"][0] != references[""][0] != references["writer"][0]


def test_penalties_see_real_token_ids_in_an_adapter_row(served, tiny_model, adapters):
    """A repetition penalty indexes the logits by the row's context, whose first token is
    marked with the adapter: it sees the real ids, as in mlx-lm's own generation."""
    model, tok, lset = served
    ref_model, _ = load(str(tiny_model), adapter_path=str(adapters["writer"]))[:2]
    penalty = make_logits_processors(repetition_penalty=1.5, repetition_context_size=64)
    want = [int(t) for (t, _), _ in zip(generate_step(
        mx.array(tok.encode(PROMPTS[1])), ref_model, sampler=greedy_sampler,
        logits_processors=penalty), range(N), strict=False)]
    outq: queue.Queue = queue.Queue()
    runner = Runner(model, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=0)
    tokens, _ = run_together(runner, outq, [_add(lset, tok, "p", "writer", PROMPTS[1], penalty)])
    assert tokens["p"] == want
    assert len(set(want)) > 5  # the penalty bites: the writer alone repeats one token


def test_a_cached_prefix_is_never_used_under_another_adapter(served, references):
    model, tok, lset = served
    outq: queue.Queue = queue.Queue()
    runner = Runner(model, [], batch_size=8, prefill_step=64, outbox=outq, cache_bytes=1 << 30)
    p = PROMPTS[2]
    seen = []
    for n, name in enumerate(["coder", "writer", "", "coder", "writer", ""]):
        tokens, started = run_together(runner, outq, [_add(lset, tok, f"r{n}", name, p)])
        assert tokens[f"r{n}"] == references[name][2], name
        seen.append((name, started[f"r{n}"].cached_tokens, started[f"r{n}"].source))
    first, again = seen[:3], seen[3:]
    assert all(cached == 0 for _, cached, _ in first), seen  # no hit across adapters
    assert all(cached > 0 and source == "ram" for _, cached, source in again), seen
    # the SSD tier's chained block keys part from the first block on, like the RAM tier's
    prompt = tok.encode(p)
    roots = {chain_keys(b"ns", mark_prompt(prompt, lset.index(a) or 0, lset.vocab), 8)[0]
             for a in ("", "coder", "writer")}
    assert len(roots) == 3


def test_an_adapter_for_another_model_is_refused_with_the_reason(tiny_model, tmp_path):
    other = write_random_model(tmp_path / "wide", hidden=96)
    bad = write_random_adapter(other, tmp_path / "wide-adapter")
    model, _, _ = load_model(str(tiny_model), tmp_path / "c")
    with pytest.raises(AdapterError, match="do not fit the base layer .*another model"):
        apply_adapters(model, {"wide": str(bad)})


def _resolve(*argv: str):
    return _resolve_env(*argv, env={})


def _resolve_env(*argv: str, env: dict[str, str]):
    import argparse

    from mlxd.daemon.config import add_serve_arguments, resolve
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return resolve(p.parse_args(list(argv)), {"MLXD_CONFIG": "/dev/null", **env})


def test_adapter_settings_are_checked_at_startup(tiny_model, adapters, tmp_path):
    cfg = _resolve(str(tiny_model), "--adapter", f"coder={tiny_model}:{adapters['coder']}")
    assert cfg.config.engine.adapter == {"coder": f"{tiny_model}:{adapters['coder']}"}
    # the environment's and the config file's forms
    env = _resolve_env(str(tiny_model), env={
        "MLXD_ADAPTER": f"coder={tiny_model}:{adapters['coder']},"
                        f"writer={tiny_model}:{adapters['writer']}"})
    assert set(env.config.engine.adapter) == {"coder", "writer"}
    toml = tmp_path / "mlxd.toml"
    toml.write_text(f'[adapter]\ncoder = "{tiny_model}:{adapters["coder"]}"\n')
    assert _resolve(str(tiny_model), "--config", str(toml)).config.engine.adapter == \
        cfg.config.engine.adapter
    # the pool counts an engine's adapters with its weights
    assert adapter_bytes(cfg.config.engine.adapter, str(tiny_model)) == \
        (adapters["coder"] / "adapters.safetensors").stat().st_size > 0
    assert adapter_bytes(cfg.config.engine.adapter, "another-model") == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    for value, message in [
            (f"x={tiny_model}:{tmp_path / 'nope'}", "is not a directory"),
            (f"x={tiny_model}:{empty}", "has no adapter_config.json"),
            (f"x={adapters['coder']}", "expected BASE_MODEL:ADAPTER_DIR"),
            (f"x=other-model:{adapters['coder']}", "without --isolate adapters apply to")]:
        with pytest.raises(ConfigError, match=f"adapter \\(flag --adapter\\): x: .*{message}"):
            _resolve(str(tiny_model), "--adapter", value)
    # the command itself says so, and exits before starting anything
    done = subprocess.run([sys.executable, "-m", "mlxd.cli.main", "serve", str(tiny_model),
                           "--adapter", f"x={tiny_model}:{empty}", "--run-dir",
                           str(tmp_path / "run"), "--port", "0"],
                          capture_output=True, text=True, timeout=60,
                          env={"MLXD_CONFIG": "/dev/null", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and not (tmp_path / "run").exists()
    assert (f"mlxd: bad configuration: adapter (flag --adapter): x: {empty} has no "
            "adapter_config.json") in done.stderr


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolate"])
def test_the_daemon_serves_adapters_from_the_base_engine(tiny_model, adapters, references,
                                                         isolate):
    from conftest import start_daemon
    flags = [a for n, p in adapters.items() for a in ("--adapter", f"{n}={tiny_model}:{p}")]
    d = start_daemon(tiny_model, "--batch", "8", *flags, isolate=isolate)
    try:
        tok = load(str(tiny_model))[1]
        with d.http() as c:
            models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert models["coder"]["parent"] == models["writer"]["parent"] == "tiny-llama"
            assert models["coder"]["root"] == str(adapters["coder"])
            assert models["coder"]["state"] == models["tiny-llama"]["state"]
            r = c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            assert r.status_code == 404 and "coder" in r.json()["error"]["message"]

        async def complete(name: str, prompt: str) -> dict:
            async with httpx.AsyncClient(base_url=d.url, timeout=60) as c:
                r = await c.post("/v1/completions", json={
                    "model": name or "tiny-llama", "prompt": prompt, "max_tokens": N,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()

        async def interleaved() -> list[dict]:
            return await asyncio.gather(*(complete(n, PROMPTS[0])
                                          for n in ("coder", "", "writer")))

        for name, answer in zip(("coder", "", "writer"), asyncio.run(interleaved()),
                                strict=True):
            assert answer["choices"][0]["text"] == tok.decode(references[name][0]), name
            assert answer["model"] == (name or "tiny-llama")
        # the same prompt again, now cached under each of the three, and under no other
        again = asyncio.run(interleaved())
        assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in again)
        with d.http() as c:
            models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert models["writer"]["state"] == models["tiny-llama"]["state"] == "ready"
            assert models["writer"]["aliases"] == ["writer"]
            assert "writer" not in models["tiny-llama"]["aliases"]
    finally:
        code = d.stop()
        d.cleanup()
    assert code == 0
