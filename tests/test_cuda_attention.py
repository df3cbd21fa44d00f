"""Which attention kernel each multi-token pass runs on CUDA (engine/load/cuda_attention.py):
the policy, the unfused attention against MLX's own, and the route through mlx-lm's models.
The route is installed only on CUDA; here it is installed by hand on the CPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxd.engine.load import cuda_attention
from mlxd.engine.load.cuda_attention import (
    BUILD_EQUIVALENT_SCORES,
    SPLIT_FROM_KEYS,
    Router,
    by_row,
    routed,
    unfused,
)
from mlxd.engine.mlx_lm_internals import route_attention, unpadded_batch_masks

BF16 = mx.bfloat16


def test_mlxs_default_stands_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda_attention.ENV, raising=False)
    assert cuda_attention.apply() == "1" and cuda_attention.ENV not in os.environ
    monkeypatch.setenv(cuda_attention.ENV, "0")
    assert cuda_attention.apply() == "0"
    assert not Router(16, fused_allowed=False).fused((1, 32, 2048, 64), (1, 8, 90_000, 64),
                                                     BF16, False)


def test_a_pass_runs_fused_when_its_graph_pays_or_was_built_and_never_with_an_array_mask():
    r = Router(layers=16)
    assert r.fused((8, 32, 1, 64), (8, 8, 5000, 64), BF16, True)  # one token: MLX decides
    short = ((1, 32, 400, 64), (1, 8, 400, 64))
    assert not r.fused(*short, BF16, False)  # a chat's prompt: a build would cost more
    assert not r.fused(*short, BF16, False)  # and is not made the second time either
    long_q, long_k = (1, 32, 2048, 64), (1, 8, 66_000, 64)  # an agent's turn over 64k
    assert 32 * 2048 * 66_000 * 16 > BUILD_EQUIVALENT_SCORES
    assert r.fused(long_q, long_k, BF16, False)
    assert not r.fused(long_q, long_k, BF16, True)  # rows of different lengths
    assert not Router(layers=1).fused(long_q, long_k, BF16, False)  # a pass of fewer layers
    assert (long_q, long_k, BF16) in r._seen
    for i in range(cuda_attention.SEEN_SHAPES):  # the oldest shape falls out, as in MLX
        assert r.fused((1, 32, 2048, 64), (1, 8, 200_000 + i, 64), BF16, False)
    assert (long_q, long_k, BF16) not in r._seen and len(r._seen) == cuda_attention.SEEN_SHAPES


@pytest.mark.parametrize("heads,kv_heads,queries,keys", [(8, 2, 5, 12), (4, 4, 3, 9),
                                                         (8, 2, 1, 7)])
def test_unfused_attention_is_mlxs_own(heads, kv_heads, queries, keys):
    mx.random.seed(heads * queries)
    q = mx.random.normal((2, heads, queries, 16))
    k, v = mx.random.normal((2, kv_heads, keys, 16)), mx.random.normal((2, kv_heads, keys, 16))
    padded = create_causal_mask(queries, keys - queries, left_padding=mx.array([0, 2]))
    additive = mx.where(padded, 0.0, -1e9)
    for mask in (None, "causal", padded, additive):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        assert mx.allclose(unfused(q, k, v, 0.25, mask), want, atol=1e-5), mask


def test_a_routed_model_computes_what_mlx_lm_computes(tiny_model: Path):
    model, _ = load(str(tiny_model))[:2]
    tokens = mx.array([[(7 * i) % 400 + 1 for i in range(40)]])

    def logits() -> mx.array:
        cache = make_prompt_cache(model)
        first = model(tokens[:, :30], cache=cache)
        return mx.concatenate([first, model(tokens[:, 30:], cache=cache)], axis=1)

    want = logits()
    calls: list[bool] = []
    router = Router(layers=len(model.layers))
    decide = router.fused

    def counted(*args):
        calls.append(decide(*args))
        return calls[-1]
    router.fused = counted  # type: ignore[method-assign]
    route_attention(routed(router))
    try:
        got = logits()
    finally:
        route_attention(None)
    assert calls and not any(calls)  # every pass of this tiny model ran unfused, by the route
    assert mx.allclose(got, want, atol=1e-4)
    calls.clear()
    logits()
    assert not calls  # mlx-lm's own function is back


def test_padded_rows_decode_row_by_row_as_the_masked_batch_does(tiny_model: Path, monkeypatch):
    mx.random.seed(1)
    q = mx.random.normal((3, 8, 1, 16))
    k, v = mx.random.normal((3, 2, 20, 16)), mx.random.normal((3, 2, 20, 16))
    pads = [0, 7, 3]
    mask = create_causal_mask(1, 19, left_padding=mx.array(pads))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = by_row(q, k, v, 0.25, pads, mx.fast.scaled_dot_product_attention)
    assert mx.allclose(got, want, atol=1e-5)
    assert not Router(16).split(2, SPLIT_FROM_KEYS - 1) and Router(16).split(2, SPLIT_FROM_KEYS)
    assert not Router(16).split(1, 10 * SPLIT_FROM_KEYS)  # one row has no padding to skip

    # through a model: two rows of different lengths decode split, as with mlx-lm's mask
    unpadded_batch_masks()
    monkeypatch.setattr(cuda_attention, "SPLIT_FROM_KEYS", 1)
    model, _ = load(str(tiny_model))[:2]

    def decode() -> mx.array:
        rows = []
        for n in (23, 15):
            cache = make_prompt_cache(model)
            model(mx.array([[(5 * i) % 300 + 1 for i in range(n)]]), cache=cache)
            rows.append(cache)
        batch = [BatchKVCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
        assert all(isinstance(r[0], KVCache) for r in rows)
        return model(mx.array([[7], [9]]), cache=batch)

    want = decode()
    router = Router(layers=len(model.layers))
    splits: list[bool] = []
    decide = router.split

    def counted(rows: int, keys: int) -> bool:
        splits.append(decide(rows, keys))
        return splits[-1]
    router.split = counted  # type: ignore[method-assign]
    route_attention(routed(router))
    try:
        got = decode()
    finally:
        route_attention(None)
    assert splits and all(splits)
    assert mx.allclose(got, want, atol=1e-4)


def test_a_vision_models_language_model_is_routed_too(tmp_path: Path) -> None:
    """mlx-vlm's language models attend through mlx-vlm's own function: with the route
    installed, a vision engine's passes reach the router (a new shape's graph is decided as
    for a text model's) and give the same logits."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from mlxd.engine.kinds.vision.model import load_vision
    from support.random_vlm import write_random_vlm
    model, _, _, _ = load_vision(write_random_vlm(tmp_path / "tiny-llava"), "float32")

    def logits() -> mx.array:
        cache = model.make_cache()
        model(mx.array([[3, 5, 7, 11, 13, 17]]), cache=cache)
        return model(mx.array([[19]], dtype=mx.uint32), cache=cache)

    want = logits()
    seen: list[tuple[int, ...]] = []
    fast = routed(Router(layers=len(model.layers)))

    def recorded(q: mx.array, k: mx.array, v: mx.array, **kw: Any) -> mx.array:
        seen.append(tuple(q.shape))
        return fast(q, k, v, **kw)
    route_attention(recorded)
    try:
        got = logits()
    finally:
        route_attention(None)
    assert len(seen) == 2 * len(model.layers)  # every layer, the prompt's pass and a step
    assert {s[2] for s in seen} == {6, 1}
    assert mx.allclose(got, want, atol=1e-5)
    logits()  # the route removed: nothing recorded
    assert len(seen) == 2 * len(model.layers)
