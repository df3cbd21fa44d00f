"""`--batch auto` with `--isolate --model-pool 2`: the two engines share the memory instead of
each sizing its batch as if it were alone (daemon/memory_share.py, engine/batch_budget.py)."""

from __future__ import annotations

import threading
import time
from typing import cast

import pytest

from conftest import start_daemon, stop_and_check
from mlxd.cli.client import format_status
from mlxd.engine.batch.sizing import FORCED
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


def _engines(stats: dict) -> dict[str, dict]:
    return {e["model"]: e for e in stats["engines"]}


def _ready(stats: dict, model: str) -> bool:
    e = _engines(stats).get(model)
    return bool(e and e["state"] == "ready" and e["cache"].get("kv_budget_bytes"))


def test_two_engines_of_a_pool_share_the_memory(tiny_model, wide_model):
    """Memory for 4.5 full-context rows of tiny-llama in half of it. Alone in the pool of 2,
    tiny-llama takes all of it (21 rows); the wide model requested, tiny-llama is told its
    half before the wide one starts, and the wide model, whose KV costs twice as much, gets
    about half as many rows in the same bytes; the wide one unloaded, tiny-llama grows back."""
    memory = int((weights(tiny_model) + CACHE + 4.5 * CONTEXT * KV_A) / 0.45)
    d = start_daemon(tiny_model, "--model-pool", "2", "--prompt-cache", "0.001",
                     isolate=True, env={"MLXD_ENGINE_MEMORY": str(memory / 2**30)})

    def chat(model: str) -> None:
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={  # the default max_tokens, clamped to
                "model": model,  # the context: the row reserves all of it
                "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200, r.text

    try:
        chat("tiny-llama")
        d.wait_until(lambda s: _ready(s, "tiny-llama"), what="tiny-llama ready")
        alone = _engines(d.stats())["tiny-llama"]
        assert alone["cache"]["memory_share"] == 1.0, alone
        assert "share 100% (--model-pool 2, 0 other engine(s))" in alone["batch_why"]
        assert alone["batch_cap"] == 21 and "(50% share)" not in format_status(d.stats())

        # the wide model, loading on demand: watch tiny-llama's share until it is ready
        loader = threading.Thread(target=chat, args=(str(wide_model),))
        loader.start()
        # (tiny-llama's share, the wide engine's state) at each look
        seen: list[tuple[float, str | None]] = []
        while loader.is_alive() or not seen or seen[-1][1] != "ready":
            eng = _engines(d.stats())
            wide = eng.get("tiny-wide", {}).get("state")
            seen.append((eng["tiny-llama"]["cache"]["memory_share"], wide))
            if not loader.is_alive() and wide != "ready":
                d.wait_until(lambda s: _ready(s, "tiny-wide"), what="tiny-wide ready")
            time.sleep(0.05)
        loader.join()
        assert seen[-1] == (0.5, "ready") and (1.0, "ready") not in seen, seen
        stats = d.stats()
        eng = _engines(stats)
        a, b = eng["tiny-llama"], eng["tiny-wide"]
        for e in (a, b):
            assert e["cache"]["memory_share"] == 0.5, e
            assert "share 50% (--model-pool 2, 1 other engine(s))" in e["batch_why"], e
            assert FORCED in e["batch_why"]
        # together: weights, both prefix caches and both KV budgets within the memory's 90 %
        held = sum(e["cache"]["kv_budget_bytes"] for e in (a, b)) + 2 * CACHE \
            + weights(tiny_model) + weights(wide_model)
        assert held <= 0.9 * memory, (held, memory)
        # each its half: 4 rows of the whole context for tiny-llama (21 alone), 2 for the wide
        assert a["batch_cap"] == 4 and a["cache"]["kv_budget_bytes"] // KV_A // CONTEXT == 4
        assert b["batch_cap"] == 2 and b["cache"]["kv_budget_bytes"] // KV_B // CONTEXT == 2
        # half the memory less: 45 % of it (the other 10 % of a part is its reserve)
        shrunk = alone["cache"]["kv_budget_bytes"] - a["cache"]["kv_budget_bytes"]
        assert abs(shrunk - 0.45 * memory) < 4, (shrunk, memory)
        shown = format_status(stats)  # what `mlxd status` prints
        assert shown.count("(50% share)") == 2 and "batch cap, why:" in shown, shown
        with d.http() as c:
            metrics = c.get("/metrics").text
        assert 'mlxd_engine_memory_share{model="tiny-wide"} 0.5' in metrics
        assert 'mlxd_engine_memory_share{model="tiny-llama"} 0.5' in metrics
        assert (f'mlxd_engine_kv_budget_bytes{{model="tiny-llama"}} '
                f'{float(a["cache"]["kv_budget_bytes"])}') in metrics

        # the wide model unloaded: once its engine has exited, tiny-llama grows back
        with d.unix_http() as c:  # /admin/* is served on the Unix socket
            r = c.post("/admin/models/unload", json={"model": str(wide_model)})
            assert r.status_code == 200, r.text
        d.wait_until(lambda s: _engines(s)["tiny-llama"]["cache"]["memory_share"] == 1.0,
                     what="tiny-llama's whole share back")
        back = _engines(d.stats())["tiny-llama"]
        assert back["cache"]["kv_budget_bytes"] == alone["cache"]["kv_budget_bytes"]
        assert back["batch_cap"] == 21 and "0 other engine(s)" in back["batch_why"]
        with d.http() as c:
            metrics = c.get("/metrics").text
        assert 'mlxd_engine_memory_share{model="tiny-llama"} 1.0' in metrics
        # the unloaded engine is listed as stopped, holding no share, budget or rows any more
        assert 'mlxd_engine_memory_share{model="tiny-wide"}' not in metrics, metrics
        assert 'mlxd_engine_kv_budget_bytes{model="tiny-wide"}' not in metrics
        assert 'mlxd_engine_active_requests{model="tiny-wide"}' not in metrics
        assert 'state="stopped"} 1.0' in metrics
        chat("tiny-llama")  # and it serves on
        log = d.log()
        assert "memory share 100% -> 50% (1 other engine(s))" in log
        assert "memory share 50% -> 100% (0 other engine(s))" in log
        assert "memory shares (--model-pool 2): tiny-llama 50%, tiny-wide 50%" in log
    finally:
        stop_and_check(d)
