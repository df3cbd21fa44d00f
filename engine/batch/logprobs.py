"""Chosen-token and top-k log-probabilities for the rows of a step that asked for them, read
in one evaluation on the MLX thread (the vectors are already computed; this reads a few
numbers of each)."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

TopLogprobs = tuple[float, list[tuple[int, float]]]  # the token's, then (id, logprob) best first


def top_logprobs(wanted: list[tuple[str, Any, int]]) -> dict[str, TopLogprobs]:
    """`wanted`: (request id, mlx-lm's response for its row, alternatives wanted)."""
    if not wanted:
        return {}
    k = max(1, max(n for _, _, n in wanted))
    lp = mx.stack([r.logprobs.reshape(-1) for _, r, _ in wanted])
    chosen = mx.take_along_axis(lp, mx.array([[r.token] for _, r, _ in wanted]), axis=-1)
    part = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    part_lp = mx.take_along_axis(lp, part, axis=-1)
    order = mx.argsort(-part_lp, axis=-1)
    top_ids = mx.take_along_axis(part, order, axis=-1)
    top_lp = mx.take_along_axis(part_lp, order, axis=-1)
    mx.eval(chosen, top_ids, top_lp)
    # tolist() of 2-D arrays: nested lists (its annotation covers every rank)
    chosen_l = cast(list[list[float]], chosen.tolist())
    ids_l = cast(list[list[int]], top_ids.tolist())
    lps_l = cast(list[list[float]], top_lp.tolist())
    return {rid: (chosen_l[i][0], list(zip(ids_l[i][:n], lps_l[i][:n], strict=True)))
            for i, (rid, _, n) in enumerate(wanted)}
