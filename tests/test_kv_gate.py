"""The KV budget's gate (engine/kv_gate.py), on its own: arrival order, room given back,
aborts, a new budget. Pure bookkeeping: no model, no generator."""

from __future__ import annotations

from mlxd.engine.batch.budget import Budget
from mlxd.engine.batch.kv_gate import KvGate
from mlxd.engine.batch.messages import AddRequest


def _add(rid: str, prompt_tokens: int, max_tokens: int) -> AddRequest:
    return AddRequest(rid, list(range(prompt_tokens)), max_tokens, sampler=None,  # type: ignore[arg-type]
                      processors=[])


def _budget(tokens: int, cap: int | None = None) -> Budget:
    return Budget(kv_bytes=tokens, per_token=1, explicit_cap=cap, why="test")


def _ids(adds: list[AddRequest]) -> list[str]:
    return [a.request_id for a in adds]


def test_requests_join_in_arrival_order_while_they_fit():
    gate = KvGate(128, _budget(100), context=0)
    got = gate.admit([_add("a", 20, 20), _add("b", 20, 20), _add("c", 20, 20)])
    assert _ids(got) == ["a", "b"]  # 40 + 40 fit in 100; a third 40 does not
    assert _ids(list(gate.held)) == ["c"]
    assert gate.reserved == {"a": 40, "b": 40} and gate.reserved_total == 80


def test_a_small_request_never_passes_a_held_one():
    gate = KvGate(128, _budget(100), context=0)
    gate.admit([_add("a", 50, 30), _add("big", 40, 30)])  # big (70) waits: 80 + 70 > 100
    assert _ids(gate.admit([_add("small", 5, 5)])) == []  # 10 would fit, but big came first
    assert _ids(list(gate.held)) == ["big", "small"]
    gate.release(["a"])
    assert gate.room_changed
    assert _ids(gate.admit([])) == ["big", "small"]
    assert not gate.room_changed and not gate.held


def test_one_row_runs_whatever_its_size_when_nothing_else_does():
    gate = KvGate(128, _budget(10), context=0)
    assert _ids(gate.admit([_add("huge", 500, 500)])) == ["huge"]


def test_the_context_bounds_what_a_request_reserves():
    gate = KvGate(128, _budget(10_000), context=100)
    gate.admit([_add("a", 90, 4096)])
    assert gate.reserved == {"a": 100}


def test_aborted_requests_leave_the_queue_and_clear_returns_the_held():
    gate = KvGate(128, _budget(50), context=0)
    gate.admit([_add("a", 40, 0), _add("b", 40, 0), _add("c", 40, 0), _add("d", 40, 0)])
    gate.drop_held({"c"})
    assert _ids(list(gate.held)) == ["b", "d"]
    assert gate.clear(held=False) == [] and _ids(list(gate.held)) == ["b", "d"]
    assert gate.reserved == {} and gate.reserved_total == 0
    gate.admit([])
    assert gate.clear(held=True) == ["d"] and not gate.held  # b was admitted by the look


def test_a_new_budget_holds_new_rows_until_running_ones_end():
    gate = KvGate(128, _budget(1000), context=0)
    gate.admit([_add(f"r{i}", 50, 50) for i in range(4)])
    gate.set_budget(_budget(250))
    assert gate.room_changed
    assert _ids(gate.admit([_add("late", 50, 50)])) == []  # 400 already reserved, over 250
    gate.release(["r0", "r1", "r2"])
    assert _ids(gate.admit([])) == ["late"]


def test_the_cap_says_which_bound_holds():
    assert KvGate(8, None, context=0).cap() == (8, "--batch 8")
    cap, why = KvGate(128, _budget(1000, cap=3), context=100).cap()  # idle: rows of 100
    assert cap == 3 and why.startswith("--batch 3")
    gate = KvGate(128, _budget(300), context=0)
    gate.admit([_add("a", 50, 50)])
    cap, why = gate.cap()
    assert cap == 3 and why.startswith("memory: 200 of 300 KV tokens free")
