"""The LRU model pool's decisions (proxy/model_pool.py), without processes: eviction, busy and
pinned engines, memory, keep_alive. The pool through real daemons: test_model_pool.py."""

from __future__ import annotations

import pytest

from mlxd.proxy.model_pool import ModelPool, NotEnoughMemory, PoolBusy, parse_keep_alive


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
    p.add("a", 0, weight_bytes=4 << 30)
    p.add("b", 1, weight_bytes=4 << 30)
    assert p.plan_load("c", 2, need_bytes=6 << 30, available_bytes=3 << 30).evict == ["a"]
    with pytest.raises(NotEnoughMemory):
        p.plan_load("c", 2, need_bytes=64 << 30, available_bytes=3 << 30)


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
