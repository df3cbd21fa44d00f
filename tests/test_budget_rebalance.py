"""A running engine's KV budget changed under it (the supervisor rebalanced the pool's memory:
daemon/memory_share.py): `Runner.set_budget`, run on the MLX thread through `Call` as the
engine does. Running rows go on; nothing new joins beyond the smaller budget; a larger one
lets the held rows in at once; the RAM prefix cache takes its new capacity."""

from __future__ import annotations

import queue

import pytest
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine.batch.budget import CEILING, KvShape, budget, rebudget
from mlxd.engine.batch.messages import AddRequest, Call, StepTokens
from mlxd.engine.batch.runner import Runner
from mlxd.engine.load.loader import load_model
from mlxd.protocol.settings import PoolShare
from support.runner_drive import turn

ONE_BYTE = KvShape(layers=1, kv_heads=1, k_head_dim=1, v_head_dim=0, bytes_per_element=1)


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("c"))
    return m, tok


def _share(fraction: float) -> PoolShare:
    return PoolShare(fraction=fraction, pool=2, others=0 if fraction == 1 else 1)


def _step(r: Runner, outq: queue.Queue, rows: list[set[str]], done: list[str]) -> None:
    """One turn of the runner's loop; each step's rows and the requests that finished."""
    turn(r)
    while not outq.empty():
        item = outq.get()
        if isinstance(item, StepTokens):
            rows.append({rid for rid, _, _ in item.rows})
            done.extend(rid for rid, _, fin in item.rows if fin)


def test_a_smaller_budget_lets_running_rows_finish_and_holds_new_ones_then_grows(model):
    m, tok = model
    prompt = tok.encode("Once upon a time, in a lighthouse by the sea")
    need = len(prompt) + 10  # KV tokens each request reserves (one byte a token here)
    # all of it: room for 4.5 rows; a quarter: room for one (1.1 rows)
    whole = budget(int(4.5 * need / 0.9) + 2, 0, ONE_BYTE, None, "test", share=_share(1.0))
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq, budget=whole)
    for i in range(4):
        r.inbox.put(AddRequest(f"r{i}", prompt, 10, greedy_sampler, []))
    r.take_commands()
    assert len(r.gate.reserved) == 4 and r.counters.batch_cap == 4
    rows: list[set[str]] = []
    done: list[str] = []
    _step(r, outq, rows, done)
    quarter = rebudget(whole, _share(0.25))
    assert quarter.kv_tokens // need == 1
    r.inbox.put(Call(lambda runner: runner.set_budget(quarter)))
    for i in range(4, 8):
        r.inbox.put(AddRequest(f"r{i}", prompt, 10, greedy_sampler, []))
    _step(r, outq, rows, done)
    assert r.counters.batch_cap == 4 and r.counters.waiting == 4  # running rows go on
    assert "share 25%" in r.counters.batch_why
    while "r4" not in set().union(*rows):
        _step(r, outq, rows, done)
    # r4 started only once the four rows had ended, and alone: nothing joined beyond the budget
    assert set(done) == {"r0", "r1", "r2", "r3"} and rows[-1] == {"r4"}
    assert all(len(s) == 4 for s in rows[:-1])
    r.inbox.put(Call(lambda runner: runner.set_budget(rebudget(quarter, _share(1.0)))))
    while len(done) < 8:
        _step(r, outq, rows, done)
    # all of it again: the three held requests joined r4 at once
    assert max(len(s) for s in rows[rows.index({"r4"}):]) == 4
    assert (r.gate.reserved, r.counters.waiting) == ({}, 0)
    r._gen.close()


def test_a_smaller_share_trims_the_prefix_cache_at_once(model):
    m, tok = model
    prompt = tok.encode("The prefix cache keeps what was prefilled for the next request")
    cache = 1 << 20
    whole = budget(4 << 20, 0, ONE_BYTE, None, "test", cache, _share(1.0))
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=CEILING, prefill_step=64, outbox=outq, budget=whole,
               cache_bytes=whole.cache_bytes)
    for i in range(3):  # three prompts cached (each its own from the first token: one that
        # differed only at its end would be superseded by the next, keep_policy.py)
        r.inbox.put(AddRequest(f"c{i}", [i + 1, *prompt], 2, greedy_sampler, []))
    rows: list[set[str]] = []
    done: list[str] = []
    while len(done) < 3:
        _step(r, outq, rows, done)
    held, entries = r.cache.nbytes, len(r.cache)
    assert entries >= 2 and held > 0
    # a part that leaves room for the newest entry, not all (no weights: the reserve's rest)
    newest = r.cache.entries()[-1].nbytes
    fraction = (newest + 64) / 0.9 / (4 << 20)
    small = rebudget(whole, _share(fraction))
    assert 0 < small.cache_bytes < held and "(of 1.0 MiB)" in small.why
    r.set_budget(small)
    assert r.cache.max_bytes == small.cache_bytes and 0 < r.cache.nbytes <= small.cache_bytes
    assert len(r.cache) < entries and r.cache.stats.evictions >= entries - len(r.cache)
    r.set_budget(rebudget(small, _share(1.0)))
    assert r.cache.max_bytes == cache
    r._gen.close()
