"""Which requests wait to share another's prefill instead of prefilling the same tokens again,
pure (the runner acts on the answers).

- A prompt that shares `MIN_SHARED_PREFIX` tokens, beyond what the caches already give it,
  with a row still prefilling waits for that row (its leader) and then hits the cache: N agents
  with one system prompt prefill it once (`leader_for`). With state layers (sliding windows,
  recurrent states) a cache hit is usable only where a snapshot was taken, so the leader must
  be one that stops at a snapshot point inside what they share; the follower waits for that
  point.
- With state layers, requests admitted together that share a long prefix: where the first of
  them must stop (a snapshot point) so that the others start from there (`meeting_points`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.rows import Row
from mlxd.engine.kv.prefix_cache import common_prefix

MIN_SHARED_PREFIX = 32  # tokens two simultaneous prompts must share to prefill them once


def leader_for(prompt: list[int], cached: int, rows: Iterable[Row], exact: bool
               ) -> tuple[Row, int] | None:
    """The prefilling row `prompt` should wait for, given the `cached` tokens the tiers hold
    of it (one slice comparison per candidate, at C speed), and, where the cache is `exact`
    (state layers), the snapshot point it waits for (0 otherwise); None: prefill it now."""
    need = cached + MIN_SHARED_PREFIX
    if need >= len(prompt):
        return None
    head = prompt[:need]
    for row in rows:
        if row.prefilling is None or row.prefilling[:need] != head:
            continue
        if not exact:
            return row, 0
        shared = min(common_prefix(tuple(row.prefilling), tuple(prompt)), len(prompt) - 1)
        point = max((p for p in row.snap_at if need <= p <= shared and p not in row.snaps),
                    default=0)
        if point:
            return row, point
    return None


def meeting_points(adds: list[AddRequest], peek: Callable[[list[int]], int]
                   ) -> dict[str, set[int]]:
    """(State layers) for requests admitted together: where each leader must stop so that its
    followers can start from its snapshot (they part ways there), by the leader's request id.
    `peek(prompt)`: the tokens the tiers already hold of a prompt."""
    leaders: list[AddRequest] = []
    points: dict[str, set[int]] = {}
    for add in adds:
        for lead in leaders:
            shared = min(common_prefix(tuple(lead.prompt), tuple(add.prompt)),
                         len(add.prompt) - 1, len(lead.prompt) - 1)
            if shared >= MIN_SHARED_PREFIX + peek(add.prompt):
                points.setdefault(lead.request_id, set()).add(shared)
                break
        else:
            leaders.append(add)
    return points
