"""The LRU model pool's decisions (proxy/model_pool.py), without processes: eviction, busy and
pinned engines, memory, keep_alive. The pool through real daemons: test_model_pool.py."""

from __future__ import annotations

import pytest

from mlxd.daemon.children import Child
from mlxd.daemon.memory_share import share_of
from mlxd.protocol.messages import ChildState
from mlxd.protocol.settings import PoolShare
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


# ---------------------------------------------------------------- memory shares (supervisor)
# daemon/memory_share.share_of: the part of the memory each engine child is launched with.

def _engine(eid: str, state: ChildState = "ready") -> Child:
    c = Child("engine", eid, f"/models/{eid}", [])
    c.state = state
    return c


def _spawn(child: Child, children: dict[str, Child], pool: int) -> PoolShare:
    """What the supervisor does as it launches `child`."""
    children[child.child_id] = child
    child.share = share_of(child, children.values(), pool, lambda spec: 100 * len(spec))
    return child.share


def test_shares_granted_kept_across_restarts_and_returned_on_unload():
    children: dict[str, Child] = {}
    a = _engine("a")
    assert _spawn(a, children, 2) == PoolShare(fraction=0.5, pool=2)
    b = _engine("b", "starting")
    sb = _spawn(b, children, 2)
    assert (sb.fraction, sb.others, sb.others_weight_bytes) == (0.5, 1, 900)  # a's weights
    a.state = "backoff"  # a crashed: restarted with its half; b still loading: no weights
    assert _spawn(a, children, 2) == PoolShare(fraction=0.5, pool=2, others=1)
    a.removed = True  # unloaded (still exiting): its half goes to the next engine at once
    c = _engine("c")
    assert _spawn(c, children, 2).fraction == 0.5
    assert sum(x.share.fraction for x in children.values() if not x.removed and x.share) == 1


def test_one_engine_alone_and_a_pool_of_one_get_all_the_memory():
    children: dict[str, Child] = {}
    a = _engine("a")
    assert _spawn(a, children, 1) == PoolShare()
    a.removed = True  # --model-pool 1: the evicted engine's whole goes to the next
    assert _spawn(_engine("b"), children, 1) == PoolShare()
    assert share_of(_engine("x"), [Child("proxy", "proxy", "", [])], 1) == PoolShare()


def test_three_engines_each_a_third_whatever_leaves_between():
    children: dict[str, Child] = {}
    a, b = _engine("a"), _engine("b")
    _spawn(a, children, 3)
    _spawn(b, children, 3)
    b.removed = True
    c, d = _engine("c"), _engine("d")
    assert abs(_spawn(c, children, 3).fraction - 1 / 3) < 1e-9
    assert abs(_spawn(d, children, 3).fraction - 1 / 3) < 1e-9
    held = [x.share.fraction for x in children.values() if not x.removed and x.share]
    assert len(held) == 3 and abs(sum(held) - 1) < 1e-9
