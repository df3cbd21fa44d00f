"""A prompt's last token fed in its final chunk's pass (`engine/last_token_fold.py`), driven
directly (no processes): one forward pass fewer per prompt, the same tokens and
log-probabilities as mlx-lm's own generator, the same cached prefixes for the next turn, and
mlx-lm's path kept where folding is not safe or not cheap."""

from __future__ import annotations

import queue
from typing import cast

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine import mlx_lm_internals as door
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.runner import Runner
from mlxd.engine.last_token_fold import (
    GPU_CHUNK,
    MAX_LOGITS,
    chunk_limit,
    fold_rows,
    row_may_fold,
)
from mlxd.engine.load.loader import load_model
from mlxd.protocol.settings import TuningSettings
from support.runner_drive import LogprobsRecorder, run_one, run_together


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("fold"))
    return m, tok


@pytest.fixture
def passes(model, monkeypatch):
    """The model's forward passes, each as (rows, tokens fed)."""
    return _count_passes(model[0], monkeypatch)


def _count_passes(m, monkeypatch) -> list[tuple[int, int]]:
    door._heads_of(m)  # its output head probed (two short passes, once a model) beforehand
    seen: list[tuple[int, int]] = []
    call = type(m).__call__

    def counted(self, inputs, *args, **kwargs):
        seen.append(tuple(inputs.shape[:2]))
        return call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(m), "__call__", counted)
    return seen


def test_rows_are_folded_only_where_their_last_chunk_and_the_logits_stay_small():
    one = [[7]]
    # row 0 ends this pass, row 1 has two segments left, row 2 is not allowed, row 3's chunk
    # fills the step (the token added would need a second pass)
    assert fold_rows([10, 10, 10, 64], [one, [[1, 2], [3]], one, one],
                     [True, True, False, True], step=64, vocab=1000, limit=64) == [0]
    assert fold_rows([63], [one], [True], step=64, vocab=1000, limit=64) == [0]
    assert fold_rows([63], [one], [True], step=64, vocab=1000, limit=32) == []  # too long
    # the default limit: a GPU's short chunks; the CPU's, as many tokens as the model's layers
    assert chunk_limit(True, 16) == GPU_CHUNK and chunk_limit(False, 30) == 30
    assert chunk_limit(False, 0) == 1
    assert fold_rows([5], [[[1, 2]]], [True], step=64, vocab=1000) == []  # more to feed
    # the whole batch's logits are bounded: a burst of long chunks keeps mlx-lm's path
    rows, longest = 8, 512
    vocab = MAX_LOGITS // (rows * (longest + 1)) + 1
    assert fold_rows([longest] * rows, [one] * rows, [True] * rows, 2048, vocab, 2048) == []
    assert fold_rows([longest] * rows, [one] * rows, [True] * rows, 2048, vocab - 1, 2048) \
        == list(range(rows))
    # only the folded positions' logits computed (a sliced head): no bound
    assert fold_rows([longest] * rows, [one] * rows, [True] * rows, 2048, 0, 2048) \
        == list(range(rows))


def _mlx_lm(m, prompts: list[list[int]], budgets: list[int], step: int,
            logprobs: bool = False) -> tuple[list[list[int]], list[list[float]]]:
    """mlx-lm's `BatchGenerator` alone, the prompts in one batch: each row's tokens (and the
    log-probability of each)."""
    gen = BatchGenerator(m, prefill_step_size=step, sampler=greedy_sampler)
    uids = gen.insert(prompts, max_tokens=budgets)
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    lps: dict[int, list[float]] = {u: [] for u in uids}
    done: set[int] = set()
    while len(done) < len(uids):
        _, responses = gen.next()
        for r in responses:
            tokens[r.uid].append(r.token)
            if logprobs:
                lps[r.uid].append(float(r.logprobs[r.token]))
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [tokens[u] for u in uids], [lps[u] for u in uids]


def _runner(m, fold: bool, outq: queue.Queue, step: int = 64, cache_bytes: int = 0) -> Runner:
    """`fold`: every final chunk that fits the step folds (the tiny model's two layers would
    let the CPU's default fold chunks of two tokens at most); else none."""
    return Runner(m, [], batch_size=8, prefill_step=step, outbox=outq, cache_bytes=cache_bytes,
                  tuning=TuningSettings(fold_last_token=4096 if fold else 0))


@pytest.mark.parametrize("fold", [True, False])
def test_a_folded_prompt_costs_one_pass_fewer_and_gives_mlx_lms_tokens(model, passes, fold):
    m, tok = model
    prompt = (tok.encode("The quick brown fox jumps over the lazy dog. ") * 20)[:150]
    (reference,), _ = _mlx_lm(m, [prompt], [8], step=64)
    before = len(passes)
    outq: queue.Queue = queue.Queue()
    tokens, _ = run_one(_runner(m, fold, outq), outq,
                        AddRequest("a", prompt, 8, greedy_sampler, []))
    assert tokens == reference
    ours = passes[before:]
    # chunks of 64, 64 and 21 (the last token added when folded), then one-token passes: the
    # last token's own (unfolded), one per token after the first, and one dispatched ahead
    # as the last token is read (mlx-lm's)
    fed = [t for _, t in ours]
    assert fed[:3] == ([64, 64, 22] if fold else [64, 64, 21])
    assert fed[3:] == [1] * (8 if fold else 9)


def test_a_batch_of_folded_and_unfolded_rows_matches_mlx_lm(model, passes):
    """Rows of different lengths padded into one pass, one asking for log-probabilities, one
    with a logits processor (never folded), one whose last chunk fills the step (not folded):
    each row's tokens as mlx-lm's generator gives them, the log-probabilities within float
    noise of its."""
    m, _ = model
    prompts = [[(7 * i + 13 * n) % 400 + 5 for i in range(n)] for n in (7, 20, 13, 33)]
    budgets = [6, 5, 7, 4]
    step = 32
    reference, ref_lps = _mlx_lm(m, prompts, budgets, step, logprobs=True)
    seen: list[list[int]] = []

    def processor(context, logits):  # an identity that marks its row unfoldable
        seen.append(context.tolist())
        return logits

    outq: queue.Queue = queue.Queue()
    r = _runner(m, True, outq, step=step)
    adds = [AddRequest(f"r{i}", p, n, greedy_sampler, [processor] if i == 2 else [],
                       logprobs=1 if i == 1 else -1)
            for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    r._outbox = outq = recorder = LogprobsRecorder()
    logprobs = recorder.logprobs
    before = len(passes)
    tokens, _ = run_together(r, outq, adds)
    assert [tokens[a.request_id] for a in adds] == reference
    got = [lp["r1"] for lp in logprobs if "r1" in lp]
    assert len(got) == budgets[1]
    for mine, theirs in zip(got, ref_lps[1], strict=True):
        assert abs(mine[0] - theirs) < 1e-4
    # the processor saw the whole prompt as its first context (mlx-lm's path)
    assert seen[0] == prompts[2]
    # rows 0 and 1 fold; row 2 (processor) and row 3 (33 tokens: 32 then 1) do not: the first
    # prompt pass feeds 4 rows, rows 2 and 3 start with a pass of their own
    # the first pass feeds the four rows' chunks (rows 0 and 1 with their last tokens, row 3's
    # 32 tokens the longest); rows 2 and 3 then feed their last tokens in a pass of their own;
    # every later pass is a decode step
    ours = passes[before:]
    assert ours[:2] == [(4, 32), (2, 1)]
    assert all(t == 1 for _, t in ours[2:])


def test_the_next_turn_finds_the_same_cached_prefix_folded_or_not(model):
    m, tok = model
    first = tok.encode("Tell me about the moon and the tides, please.")
    got = {}
    for fold in (True, False):
        outq: queue.Queue = queue.Queue()
        r = _runner(m, fold, outq, cache_bytes=64 << 20)
        answer, started = run_one(r, outq, AddRequest("a", first, 6, greedy_sampler, []))
        assert started.cached_tokens == 0
        follow = first + answer + tok.encode(" And the sun?")
        tokens, again = run_one(r, outq, AddRequest("b", follow, 6, greedy_sampler, []))
        got[fold] = (answer, tokens, again.cached_tokens)
        r._gen.close()
    assert got[True] == got[False]
    assert got[True][2] >= len(first)  # the first turn's prompt (and answer) came from cache


def test_a_generator_left_with_nothing_to_fold_keeps_no_state(model):
    """A pass in which nothing folds leaves no logits or arrays behind for a later step."""
    m, tok = model
    outq: queue.Queue = queue.Queue()
    r = _runner(m, True, outq, step=16)
    prompt = (tok.encode("abc def ghi ") * 10)[:17]  # 16 then the last token: no fold
    run_one(r, outq, AddRequest("a", prompt, 3, greedy_sampler, []))
    assert not door._folded and not door._eval_with and door._fold_gen is None
    mx.eval(mx.array(0))


def test_a_state_models_row_never_skips_its_snapshot_one_short_of_the_end():
    assert row_may_fold(1000, frozenset())  # a plain KV model: no snapshot is due
    assert row_may_fold(1000, {4096})
    assert not row_may_fold(300, {299})  # a state model's: a re-sent prompt restores it


@pytest.fixture(scope="module")
def state_model(tmp_path_factory):
    from support.random_model import write_random_model
    path = write_random_model(tmp_path_factory.mktemp("g") / "gemma3", family="gemma3_text")
    m, tok, _ = load_model(str(path), tmp_path_factory.mktemp("g2"))
    return m, tok


def test_a_sliding_window_model_keeps_mlx_lms_path_and_a_resent_prompt_hits(state_model,
                                                                           monkeypatch):
    """Gemma 3's sliding windows: no row folds (its snapshot one short of the prompt's end
    is due), so a re-sent prompt restores all but its last token, as unfolded."""
    m, _ = state_model
    prompt = [(11 * i) % 300 + 5 for i in range(40)]
    passes = _count_passes(m, monkeypatch)
    got, counts = {}, {}
    for fold in (True, False):
        outq: queue.Queue = queue.Queue()
        r = _runner(m, fold, outq, cache_bytes=64 << 20)
        before = len(passes)
        answer, _ = run_one(r, outq, AddRequest("a", prompt, 6, greedy_sampler, []))
        counts[fold] = len(passes) - before
        again, started = run_one(r, outq, AddRequest("b", prompt, 6, greedy_sampler, []))
        got[fold] = (answer, again, started.cached_tokens)
        r._gen.close()
    assert got[True] == got[False] and got[True][2] == len(prompt) - 1
    assert counts[True] == counts[False]


@pytest.mark.parametrize("tied", [True, False])
def test_a_folded_pass_computes_the_logits_of_its_folded_positions_only(tmp_path, tied):
    """The output head (an `lm_head`, or the embedding tied to it) applied to the folded rows'
    last positions alone: the same logits there as the whole output's, and a pass whose
    output is (rows, 1, vocabulary); the model is left as it was."""
    import json

    from support.random_model import write_random_model
    path = write_random_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    (path / "config.json").write_text(json.dumps(config))
    if not tied:  # an lm_head of its own
        import mlx.core as mx_
        w = cast(dict, mx_.load(str(path / "model.safetensors")))
        w["lm_head.weight"] = w["model.embed_tokens.weight"] * 0.5
        mx_.save_safetensors(str(path / "model.safetensors"), w)
    m, _, _ = load_model(str(path), tmp_path / "c")
    heads = door._heads_of(m)
    assert heads.sliced
    from mlx_lm.models.cache import make_prompt_cache
    x = mx.array([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    rows, positions = mx.array([1, 0]), mx.array([4, 2])
    whole = m(x, cache=make_prompt_cache(m))
    with heads.at(rows, positions):
        sliced = m(x, cache=make_prompt_cache(m))
    assert sliced.shape == (2, 1, whole.shape[-1])
    assert mx.allclose(sliced[:, 0, :], whole[rows, positions], atol=1e-5).item()
    again = m(x, cache=make_prompt_cache(m))  # restored: the whole output again
    assert again.shape == whole.shape and mx.allclose(again, whole).item()
    if not tied:  # a head of another class (a LoRA adapter's: per-row deltas) is not sliced
        m.lm_head.__class__ = type("PerRowLinear", (type(m.lm_head),), {})
        assert not door._Heads(m).sliced


@pytest.mark.parametrize("sliced", [True, False])
def test_a_burst_whose_whole_logits_pass_the_bound_folds_only_with_a_sliced_head(
        model, passes, monkeypatch, sliced):
    """Eight rows of 200 tokens, the bound on whole logits set below their size: folded
    when only their last positions' logits are computed, not when the head is unknown."""
    from mlxd.engine import last_token_fold
    m, _ = model
    monkeypatch.setattr(last_token_fold, "MAX_LOGITS", 1000)
    monkeypatch.setattr(door._heads_of(m), "sliced", sliced)
    n, length = 8, 200
    prompts = [[(3 * i + 7 * r) % 400 + 5 for i in range(length)] for r in range(n)]
    reference, _ = _mlx_lm(m, prompts, [3] * n, step=256)
    outq: queue.Queue = queue.Queue()
    before = len(passes)
    tokens, _ = run_together(_runner(m, True, outq, step=256), outq,
                             [AddRequest(f"r{i}", p, 3, greedy_sampler, [])
                              for i, p in enumerate(prompts)])
    assert [tokens[f"r{i}"] for i in range(n)] == reference
    # folded: every row's whole prompt in one pass; else all but the last token, then it alone
    assert passes[before] == ((n, length) if sliced else (n, length - 1))
    assert passes[before + 1] == (n, 1)


def test_the_cpus_default_folds_a_chunk_no_longer_than_the_models_layers(tmp_path, monkeypatch):
    """On the CPU a fold pays the last layer over the whole chunk: by default, a final chunk
    of up to as many tokens as the model has layers folds, a longer one keeps its pass."""
    from support.random_model import write_random_model
    path = write_random_model(tmp_path / "m", layers=8)
    m, _, _ = load_model(str(path), tmp_path / "c")
    passes = _count_passes(m, monkeypatch)
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq)  # the defaults
    fed = {}
    for n in (8, 9):  # a prompt of n tokens: one chunk of n (folded) or n - 1, then 1
        before = len(passes)
        run_one(r, outq, AddRequest(f"p{n}", [(5 * i + n) % 400 + 5 for i in range(n)], 2,
                                    greedy_sampler, []))
        fed[n] = [t for _, t in passes[before:before + 2]]
    assert fed == {8: [8, 1], 9: [8, 1]}
