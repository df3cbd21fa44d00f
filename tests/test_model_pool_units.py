"""The LRU model pool's decisions (proxy/engines/pool.py), without processes: eviction, busy and
pinned engines, memory, keep_alive. The pool through real daemons: test_model_pool.py."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from mlxd.daemon.children import Child
from mlxd.daemon.memory_share import Engine, engines_of, holds_share, rebalance, shares
from mlxd.engine.batch import budget as batch_budget
from mlxd.protocol.messages import ChildState
from mlxd.protocol.settings import PoolShare
from mlxd.proxy.engines.pool import (
    RESERVE_FRACTION,
    MemoryNeed,
    ModelPool,
    NotEnoughMemory,
    PoolBusy,
    kv_bytes_per_element,
    memory_shortfall,
    parse_keep_alive,
    row_kv_bytes,
)

GiB = 2**30


def test_pool_evicts_least_recently_used_idle_engine():
    p = ModelPool(size=2, idle_unload=0)
    p.add("a", 0)
    p.add("b", 1)
    p.begin("a", 5)
    p.end("a", 6, None)  # a used after b: b is the LRU
    assert p.plan_load("c", 7).evict == ["b"]
    assert p.plan_load("a", 7).evict == []  # already resident


def test_pool_never_evicts_busy_or_pinned_engines():
    p = ModelPool(size=2, idle_unload=0)
    p.add("a", 0)
    p.add("b", 1)
    p.begin("a", 2)
    p.end("b", 3, -1)  # keep_alive -1 pins b
    with pytest.raises(PoolBusy):
        p.plan_load("c", 4)
    p.end("a", 5, None)
    assert p.plan_load("c", 6).evict == ["a"]


def test_pool_evicts_more_for_memory_and_says_when_it_cannot():
    p = ModelPool(size=3, idle_unload=0)
    p.add("a", 0, weight_bytes=4 * GiB)
    p.add("b", 1, weight_bytes=4 * GiB)
    assert p.plan_load("c", 2, MemoryNeed(6 * GiB, 0, 40 * GiB)).evict == []  # room for all
    # free memory falls short: the LRU goes (its weights come back)
    assert p.plan_load("c", 2, MemoryNeed(5 * GiB, 0, 4 * GiB)).evict == ["a"]
    with pytest.raises(NotEnoughMemory, match="64.0 GiB .* would be available"):
        p.plan_load("c", 2, MemoryNeed(64 * GiB, 0, 3 * GiB))


def test_the_new_engines_part_of_the_memory_must_hold_its_weights_and_a_row():
    """Free memory would take the model, but beside both others its third of the machine
    could not hold its weights: the supervisor's shares would leave it no KV and eat into its
    reserve. One idle engine goes, and the new one gets half."""
    p = ModelPool(size=3, idle_unload=0)
    p.add("a", 0, weight_bytes=4 * GiB)
    p.add("b", 1, weight_bytes=4 * GiB)
    need = MemoryNeed(10 * GiB, GiB // 2, 20 * GiB)  # machine: 28 GiB; a third: 8.4 usable
    assert memory_shortfall(need, [4 * GiB, 4 * GiB], []) == (
        "the model needs about 10.5 GiB (its weights and one row of KV); its part of the "
        "memory would be 8.4 GiB (33% of 28.0 GiB, beside 2 other model(s), less a 10% "
        "reserve)")
    assert memory_shortfall(need, [4 * GiB, 4 * GiB], [4 * GiB]) is None  # a half: 12.6
    assert p.plan_load("c", 2, need).evict == ["a"]
    p.begin("a", 3)  # a busy: b (now the only idle one) goes instead
    assert p.plan_load("c", 4, need).evict == ["b"]
    p.begin("b", 5)  # both busy: wait for one
    with pytest.raises(PoolBusy, match="not enough memory"):
        p.plan_load("c", 6, need)
    alone = ModelPool(size=2, idle_unload=0)  # even alone: 90 % of the machine at most
    with pytest.raises(NotEnoughMemory, match=r"100% of 10.0 GiB, less a 10% reserve"):
        alone.plan_load("c", 0, MemoryNeed(9 * GiB + GiB // 2, 0, 10 * GiB))


def test_the_checks_kv_is_one_row_in_the_kv_dtype_whatever_the_batch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 2048, "max_position_embeddings": 131072}))
    per_token = 16 * 8 * 64 * 2  # layers x KV heads x head size x (K and V)
    assert row_kv_bytes(str(tmp_path)) == per_token * 4096 * 2  # 16-bit KV, 4096 tokens
    assert row_kv_bytes(str(tmp_path), kv_bytes_per_element("float32", None, 64)) == \
        per_token * 4096 * 4
    four = kv_bytes_per_element("auto", 4, 64)
    assert four == 0.5625  # packed 4 bits, a float16 scale and bias per 64
    assert row_kv_bytes(str(tmp_path), four) == int(per_token * 4096 * 0.5625)
    assert kv_bytes_per_element("bfloat16", 8, 32) == 1.125
    assert row_kv_bytes("org/not-a-dir") == 0
    assert RESERVE_FRACTION == batch_budget.RESERVE_FRACTION  # the engine's own reserve


def test_pool_keep_alive_and_idle_unload():
    p = ModelPool(size=3, idle_unload=10)
    p.add("a", 0)
    p.add("b", 0)
    p.add("c", 0)
    p.end("b", 0, 30)  # kept 30 s
    p.end("c", 0, -1)  # pinned
    assert p.expired(5) == []
    assert p.expired(10) == ["a"]
    assert sorted(p.expired(31)) == ["a", "b"]


@pytest.mark.parametrize("value,seconds", [(0, 0), (5, 5), ("5m", 300), ("1h", 3600),
                                           ("-1", -1), (-1, -1), ("250ms", 0.25), (None, None)])
def test_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", True, "5 parsecs"])
def test_parse_keep_alive_rejects_junk(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


# ---------------------------------------------------------------- memory shares (supervisor)
# daemon/memory_share: the part of the memory each engine runs with, recomputed as the
# supervisor's Supervisor._rebalance does whenever the engines holding one change.

class _Proc:
    """A child's process as `Child.alive` sees it."""
    def __init__(self) -> None:
        self.returncode: int | None = None
        self.pid = 1


def _engine(eid: str, state: ChildState = "starting", alive: bool = False) -> Child:
    c = Child("engine", eid, f"/models/{eid}", [])
    c.state = state
    if alive:
        c.proc = cast(Any, _Proc())
    return c


def _rebalance(children: dict[str, Child], pool: int) -> list[str]:
    """What the supervisor does: every share recomputed; the running engines to tell."""
    told = {c.child_id: c.share.fraction for c in children.values()
            if c.alive and c.share is not None}
    given, changed = rebalance(pool, engines_of(children.values(), lambda s: 100 * len(s)),
                               told)
    for c in children.values():
        if c.child_id in given:
            c.share = given[c.child_id]
    return changed


def _fractions(children: dict[str, Child]) -> dict[str, float]:
    return {c.child_id: round(c.share.fraction, 6) for c in children.values()
            if holds_share(c) and c.share is not None}


def test_a_lone_engine_gets_everything_and_shrinks_before_another_is_spawned():
    children = {"a": _engine("a")}
    assert _rebalance(children, 2) == []  # spawned: a is not running yet, nothing to tell
    assert children["a"].share == PoolShare(fraction=1.0, pool=2)  # alone in a pool of 2
    a = children["a"]
    a.state, a.proc = "ready", cast(Any, _Proc())
    children["b"] = _engine("b")  # about to be spawned: a is told first
    assert _rebalance(children, 2) == ["a"]
    assert _fractions(children) == {"a": 0.5, "b": 0.5}
    b_share = children["b"].share
    assert b_share is not None and (b_share.others, b_share.others_weight_bytes) == (1, 900)
    b = children["b"]
    b.state, b.proc = "ready", cast(Any, _Proc())
    assert _rebalance(children, 2) == []  # b ready: nothing changes
    b.removed, b.state = True, "stopping"  # unloaded: a grows only once b's process is gone
    assert _rebalance(children, 2) == [] and _fractions(children) == {"a": 0.5, "b": 0.5}
    del children["b"]  # b exited (the supervisor drops it)
    assert _rebalance(children, 2) == ["a"] and _fractions(children) == {"a": 1.0}


def test_a_restart_keeps_the_share_and_a_failed_engine_holds_none():
    children = {eid: _engine(eid, "ready", alive=True) for eid in "ab"}
    _rebalance(children, 2)
    a = children["a"]
    a.state, a.proc = "backoff", None  # crashed, restarting: still holds its half
    assert _rebalance(children, 2) == [] and _fractions(children) == {"a": 0.5, "b": 0.5}
    a.state = "starting"  # respawned: the same half
    assert _rebalance(children, 2) == [] and children["a"].share.fraction == 0.5  # type: ignore
    a.state = "failed"  # a crash loop: b may use all of it until a is tried again
    assert _rebalance(children, 2) == ["b"] and _fractions(children) == {"b": 1.0}
    a.state = "starting"  # the cool-down is over: b shrinks before a is spawned
    assert _rebalance(children, 2) == ["b"] and _fractions(children) == {"a": 0.5, "b": 0.5}


def test_one_engine_with_no_pool_gets_the_plain_whole_and_loads_racing_unloads_split_it():
    assert shares(1, [Engine("a", True)]) == {"a": PoolShare()}
    assert shares(2, []) == {}
    # --model-pool 1: the evicted engine still exits while the next starts: halves, then all
    children = {"a": _engine("a", "stopping", alive=True), "b": _engine("b")}
    children["a"].removed = True
    _rebalance(children, 1)
    assert _fractions(children) == {"a": 0.5, "b": 0.5}
    children["b"].state, children["b"].proc = "ready", cast(Any, _Proc())
    del children["a"]
    assert _rebalance(children, 1) == ["b"] and children["b"].share == PoolShare()
    # three holders in a pool of 2 (a reload racing an unload): thirds, never more than all
    three = shares(2, [Engine(e, True) for e in "abc"])
    assert abs(sum(s.fraction for s in three.values()) - 1) < 1e-9
    assert not holds_share(Child("proxy", "proxy", "", []))
    assert not holds_share(_engine("x", "stopped"))
