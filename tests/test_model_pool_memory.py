"""`--batch auto` with `--isolate --model-pool 2`: the two engines share the memory instead of
each sizing its batch as if it were alone (daemon/memory_share.py, engine/batch_budget.py)."""

from __future__ import annotations

from typing import cast

import pytest

from conftest import start_daemon, stop_and_check
from mlxd.daemon.client import format_status
from mlxd.engine.batch_sizing import MEMORY_ENV
from support.random_model import write_random_model

KV_A = 2 * 2 * (16 + 16) * 4  # tiny-llama: layers x kv heads x (k + v head dims) x float32
KV_B = 2 * 4 * (16 + 16) * 4  # the wide one: twice the KV heads, twice the KV per token
CACHE = int(0.001 * 2**30)  # --prompt-cache 0.001 (GB): its capacity counts in the memory
CONTEXT = 256  # both models': a row of the typical size reserves the whole context


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny-wide", kv_heads=4,
                              context=CONTEXT, seed=3)


def weights(model) -> int:
    """The weights' bytes as loaded (the files' sizes less their headers)."""
    import mlx.core as mx
    total = 0
    for f in model.glob("*.safetensors"):
        arrays = cast(dict[str, mx.array], mx.load(str(f)))
        total += sum(v.nbytes for v in arrays.values())
    return total


def test_two_engines_of_a_pool_share_the_memory(tiny_model, wide_model):
    """Memory for 4.5 full-context rows of tiny-llama in half of it: alone, an engine would
    have taken all of it (21 rows); in a pool of 2 each takes its half, and the wide model,
    whose KV costs twice as much, gets about half as many rows in the same bytes."""
    memory = int((weights(tiny_model) + CACHE + 4.5 * CONTEXT * KV_A) / 0.45)
    d = start_daemon(tiny_model, "--model-pool", "2", "--prompt-cache", "0.001",
                     isolate=True, env={MEMORY_ENV: str(memory)})
    try:
        with d.http() as c:
            for model in ("tiny-llama", str(wide_model)):  # the second loads on demand
                r = c.post("/v1/chat/completions", json={  # the default max_tokens,
                    "model": model,  # clamped to the context: the row reserves all of it
                    "messages": [{"role": "user", "content": "hello"}]})
                assert r.status_code == 200, r.text
        d.wait_until(lambda s: len(s["engines"]) == 2 and all(
            e["state"] == "ready" and e["cache"].get("kv_budget_bytes") for e in s["engines"]),
            what="both engines ready with their budgets")
        stats = d.stats()
        eng = {e["model"]: e for e in stats["engines"]}
        a, b = eng["tiny-llama"], eng["tiny-wide"]
        for e in (a, b):
            assert e["cache"]["memory_share"] == 0.5, e
            assert "share 50% (--model-pool 2" in e["batch_why"], e["batch_why"]
            assert MEMORY_ENV in e["batch_why"]
        assert "0 other engine(s)" in a["batch_why"] and "1 other engine(s)" in b["batch_why"]
        # together: weights, both prefix caches and both KV budgets within the memory's 90 %
        held = sum(e["cache"]["kv_budget_bytes"] for e in (a, b)) + 2 * CACHE \
            + weights(tiny_model) + weights(wide_model)
        assert held <= 0.9 * memory, (held, memory)
        # each its half: 4 rows of the whole context for tiny-llama (21 alone), 2 for the wide
        assert a["batch_cap"] == 4 and a["cache"]["kv_budget_bytes"] // KV_A // CONTEXT == 4
        assert b["batch_cap"] == 2 and b["cache"]["kv_budget_bytes"] // KV_B // CONTEXT == 2
        shown = format_status(stats)  # what `mlxd status` prints
        assert shown.count("(50% share)") == 2 and "batch cap, why:" in shown, shown
        with d.http() as c:
            metrics = c.get("/metrics").text
        assert 'mlxd_engine_memory_share{model="tiny-wide"} 0.5' in metrics
        assert (f'mlxd_engine_kv_budget_bytes{{model="tiny-llama"}} '
                f'{float(a["cache"]["kv_budget_bytes"])}') in metrics
    finally:
        stop_and_check(d)
