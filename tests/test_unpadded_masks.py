"""A batch none of whose rows is padded attends as one sequence does: no mask for a decode step,
`"causal"` for a prefill (`mlx_lm_internals.unpadded_batch_masks`), so that MLX's fused
attention takes it (on CUDA an array mask sends every step to the unfused fallback). Rows that
are padded keep mlx-lm's array mask; the tokens are the same either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.sample_utils import make_sampler

from mlxd.engine.mlx_lm_internals import left_padding, unpadded_batch_masks


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model: Path) -> tuple[Any, Any]:
    unpadded_batch_masks()
    return load(str(tiny_model))[:2]


def _row(tokens: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
    return c


def _tracked(cache: BatchKVCache) -> bool:
    """The host-side padding is the array's."""
    return left_padding(cache) == cache.left_padding.tolist()


def _kind(mask: Any) -> str:
    return "none" if mask is None else mask if isinstance(mask, str) else "array"


def test_only_a_batch_without_padding_leaves_the_array_mask_out(model_and_tokenizer):
    even = BatchKVCache.merge([_row(5), _row(5)])
    assert (_kind(even.make_mask(1)), _kind(even.make_mask(4))) == ("none", "causal")
    assert _kind(even.make_mask(1, return_array=True)) == "array"  # a model that asks for one

    uneven = BatchKVCache.merge([_row(5), _row(3), _row(4)])
    assert (_kind(uneven.make_mask(1)), _kind(uneven.make_mask(4))) == ("array", "array")
    assert left_padding(uneven) == [0, 2, 1] and _tracked(uneven)
    uneven.filter([1, 2])  # the padding the rows have in common is shifted away
    assert left_padding(uneven) == [1, 0] and _tracked(uneven)
    uneven.filter([0])  # the shorter row alone: no padding left
    assert _kind(uneven.make_mask(1)) == "none" and _tracked(uneven)

    longer = BatchKVCache.merge([_row(5), _row(5)])
    longer.update_and_fetch(mx.zeros((2, 2, 2, 8)), mx.zeros((2, 2, 2, 8)))
    joined = BatchKVCache.merge([_row(5)])
    joined.extend(longer)  # rows of different lengths: the shorter is padded
    assert _kind(joined.make_mask(1)) == "array"
    assert left_padding(joined) == [2, 0, 0] and _tracked(joined)

    prompt = BatchKVCache([0, 0])
    prompt.prepare(lengths=[3, 5], right_padding=[2, 0])
    prompt.update_and_fetch(mx.zeros((2, 2, 5, 8)), mx.zeros((2, 2, 5, 8)))
    prompt.finalize()  # the right padding becomes the first row's left padding
    assert _kind(prompt.make_mask(1)) == "array"
    assert left_padding(prompt) == [2, 0] and _tracked(prompt)

    restored = BatchKVCache([0])
    restored.state = uneven.state  # from the array, read once
    assert _kind(restored.make_mask(1)) == "none"
    restored.state = BatchKVCache.merge([_row(5), _row(3)]).state
    assert _kind(restored.make_mask(1)) == "array" and left_padding(restored) == [0, 2]


def test_the_generator_decodes_alone_without_a_mask_and_as_one_sequence_does(
        model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    seen: list[str] = []
    patched = BatchKVCache.make_mask

    def recording(self: Any, N: int, **kwargs: Any) -> Any:
        mask = patched(self, N, **kwargs)
        seen.append(f"{N}:{_kind(mask)}")
        return mask
    monkeypatch.setattr(BatchKVCache, "make_mask", recording)

    prompts = [[1 + (7 * i) % 400 for i in range(n)] for n in (37, 12)]
    budgets = [24, 6]  # the short prompt's row finishes first: the long one decodes alone
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=budgets)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    gen.close()

    greedy = make_sampler(0.0)
    for uid, prompt, budget in zip(uids, prompts, budgets, strict=True):
        alone = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=budget,
                                                  sampler=greedy)]
        assert out[uid] == alone[:len(out[uid])] and len(out[uid]) == budget
    single_steps = [s for s in seen if s.startswith("1:")]
    # two rows of different lengths decode with the array mask, the long row alone with none
    assert "1:array" in single_steps and single_steps[-1] == "1:none"
    assert single_steps.count("1:none") >= budgets[0] - budgets[1] - 1
