"""Which requests wait to share another's prefill (engine/batch/admission/sharing.py), pure."""

from __future__ import annotations

from mlxd.engine.batch.admission.sharing import MIN_SHARED_PREFIX, leader_for, meeting_points
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.rows import Row

HEAD = list(range(100, 100 + 2 * MIN_SHARED_PREFIX))  # a system prompt, 64 tokens


def _row(uid: int, prompt: list[int] | None, snap_at: tuple[int, ...] = (),
         snaps: tuple[int, ...] = ()) -> Row:
    return Row(uid, f"r{uid}", len(prompt or []), 0.0, 0.0, prefilling=prompt,
               snap_at=frozenset(snap_at), snaps={p: [] for p in snaps})


def _add(rid: str, prompt: list[int]) -> AddRequest:
    return AddRequest(rid, prompt, 8, lambda x: x, [])


def test_a_prompt_waits_for_a_prefilling_row_that_shares_enough_beyond_the_cache() -> None:
    done = _row(0, None)  # decoding: its prompt is in the cache already
    other = _row(1, [7] * 80)
    leader = _row(2, HEAD + [1, 2, 3])
    prompt = HEAD + [4, 5]
    assert leader_for(prompt, 0, [done, other, leader], exact=False) == (leader, 0)
    # what the tiers hold counts first: 40 cached leaves 24 shared beyond, under the minimum
    assert leader_for(prompt, 40, [done, other, leader], exact=False) is None
    assert leader_for(HEAD[:MIN_SHARED_PREFIX], 0, [leader], exact=False) is None  # too short
    assert leader_for([9] + HEAD, 0, [leader], exact=False) is None  # parts at once


def test_with_state_layers_a_leader_must_stop_at_a_point_inside_what_they_share() -> None:
    prompt = HEAD + [4, 5]
    no_point = _row(1, HEAD + [1], snap_at=(10,))  # a point before the minimum
    taken = _row(2, HEAD + [1], snap_at=(60,), snaps=(60,))  # its snapshot there is taken
    beyond = _row(3, HEAD + [1], snap_at=(65,))  # past what they share (64)
    good = _row(4, HEAD + [1], snap_at=(40, 48, 64))
    assert leader_for(prompt, 0, [no_point, taken, beyond], exact=True) is None
    assert leader_for(prompt, 0, [no_point, taken, beyond, good], exact=True) == (good, 64)
    assert leader_for(prompt, 16, [good], exact=True) == (good, 64)  # 48 needed at least


def test_requests_admitted_together_meet_where_they_part_ways() -> None:
    a = _add("a", HEAD + [1, 2])
    b = _add("b", HEAD + [3])
    c = _add("c", [5] * 70)  # shares nothing: leads itself
    d = _add("d", [5] * 40 + [6] * 10)
    assert meeting_points([a, b, c, d], lambda p: 0) == {"a": {64}, "c": {40}}
    # a prefix the tiers hold already is not shared through a leader: b and d start from it
    assert meeting_points([a, b, c, d], lambda p: 40) == {}
