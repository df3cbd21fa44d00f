"""A row's first token goes out in the step of its prompt's last chunk, driven directly (no
processes): that step also feeds the prompt's last token (mlx-lm feeds it in the next step)
and sends the token it samples (mlx-lm's `next()` returns it a step later still); the same
tokens as mlx-lm's own generator, and no token twice. Rows whose first token may end them
(one-token budgets, end-of-sequence tokens) or that ask for log-probabilities get it from
mlx-lm's `next()`, one step after that feed."""

from __future__ import annotations

import queue

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine.batch.messages import AbortRequest, AddRequest, StepTokens
from mlxd.engine.batch.runner import Runner
from mlxd.engine.load.loader import load_model
from mlxd.protocol.settings import TuningSettings
from support.runner_drive import LogprobsRecorder, run_together


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("f"))
    return m, tok


def _mlx_lm_tokens(m, prompt: list[int], max_tokens: int, prefill_step: int
                   ) -> tuple[list[int], int]:
    """mlx-lm's `BatchGenerator` alone: the tokens, and the step whose `next()` returned the
    first."""
    gen = BatchGenerator(m, max_tokens=max_tokens, prefill_step_size=prefill_step,
                         sampler=greedy_sampler)
    gen.insert([prompt], max_tokens=[max_tokens])
    tokens: list[int] = []
    first_step, steps = 0, 0
    while True:
        steps += 1
        _, responses = gen.next()
        for r in responses:
            first_step = first_step or steps
            tokens.append(r.token)
            if r.finish_reason is not None:
                gen.close()
                return tokens, first_step


def _runner_steps(r: Runner, outq: queue.Queue, add: AddRequest
                  ) -> tuple[list[int], list[str | None], int]:
    """`add` through the runner one step at a time: its tokens, their finish reasons and the
    step whose tokens carried the first."""
    r.inbox.put(add)
    r.take_commands()
    tokens: list[int] = []
    finishes: list[str | None] = []
    first_step, steps = 0, 0
    while not finishes or finishes[-1] is None:
        r.step()
        steps += 1
        while not outq.empty():
            item = outq.get()
            if isinstance(item, StepTokens):
                for _rid, tok, fin in item.rows:
                    first_step = first_step or steps
                    tokens.append(tok)
                    finishes.append(fin)
    return tokens, finishes, first_step


@pytest.mark.parametrize("length", [20, 150])
def test_the_first_token_goes_out_two_steps_before_mlx_lm_returns_it(model, length):
    m, tok = model
    prompt = (tok.encode("The quick brown fox jumps over the lazy dog. ") * 20)[:length]
    reference, ref_first = _mlx_lm_tokens(m, prompt, 8, prefill_step=64)
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq)
    tokens, finishes, first = _runner_steps(r, outq, AddRequest("a", prompt, 8, greedy_sampler,
                                                                []))
    assert tokens == reference
    assert finishes == [None] * 7 + ["length"]
    # the step of the prompt's last chunk (but its last token), which also feeds that token,
    # where mlx-lm feeds it in the next step and returns its first token in the one after
    assert first == -(-(length - 1) // 64) == ref_first - 2
    assert r.counters.generated_tokens == 8 and r.counters.first_tokens == 0  # (no clock)


def test_a_first_token_that_may_end_its_row_comes_from_mlx_lms_next(model):
    m, tok = model
    prompt = tok.encode("Once upon a time in a land far away")
    reference, ref_first = _mlx_lm_tokens(m, prompt, 6, prefill_step=64)
    outq: queue.Queue = queue.Queue()
    # a one-token budget: the token carries its finish reason, so it waits for mlx-lm's
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq)
    tokens, finishes, first = _runner_steps(r, outq, AddRequest("a", prompt, 1, greedy_sampler,
                                                                []))
    assert (tokens, finishes, first) == (reference[:1], ["length"], ref_first - 1)
    # the first token is an end-of-sequence token: sent once, with "stop"
    r = Runner(m, [reference[0]], batch_size=4, prefill_step=64, outbox=outq)
    tokens, finishes, first = _runner_steps(r, outq, AddRequest("b", prompt, 6, greedy_sampler,
                                                                []))
    assert (tokens, finishes, first) == (reference[:1], ["stop"], ref_first - 1)


def test_rows_with_and_without_an_early_first_token_in_one_batch_match_their_lone_runs(model):
    m, tok = model
    texts = ["Hello there, how are you", "A long time ago in a galaxy far, far away there was",
             "Numbers: 1 2 3 4 5 6 7 8 9", "def f(x):\n    return"]
    prompts = [tok.encode(t) for t in texts]
    budgets = [7, 5, 1, 9]
    alone = [_mlx_lm_tokens(m, p, n, prefill_step=16)[0]
             for p, n in zip(prompts, budgets, strict=True)]
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=8, prefill_step=16, outbox=outq)
    adds = [AddRequest(f"r{i}", p, n, greedy_sampler, [], logprobs=2 if i == 3 else -1)
            for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    r._outbox = outq = recorder = LogprobsRecorder()
    logprobs = recorder.logprobs
    tokens, _ = run_together(r, outq, adds)
    assert [tokens[a.request_id] for a in adds] == alone
    # the row asking for log-probabilities has them for every token, its first included
    assert sum("r3" in lp for lp in logprobs) == budgets[3]


def _checkpointed(m, prompt: list[int], early: bool) -> tuple[list[int], list[int]]:
    """A row of 12 tokens with a generation checkpoint every 4: its tokens and the token
    counts of the checkpoints handed to the SSD tier (the prompt's own entry left out)."""
    persisted: list[int] = []

    def persist(entries):
        persisted.extend(len(e.tokens) for e in entries if len(e.tokens) > len(prompt))

    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, persist=persist,
               checkpoint_every=4, tuning=TuningSettings(early_first_token=early))
    tokens, _, _ = _runner_steps(r, outq, AddRequest("a", prompt, 12, greedy_sampler, []))
    r._gen.close()
    return tokens, persisted


def test_generation_checkpoints_cover_the_same_tokens_with_the_first_token_early(model):
    m, tok = model
    prompt = tok.encode("A checkpoint is what a resumed request restarts from")
    early = _checkpointed(m, prompt, True)
    assert early == _checkpointed(m, prompt, False)
    assert len(early[1]) >= 2  # (checkpoints were taken)


def test_a_row_aborted_after_its_early_first_token_leaves_the_others_as_they_were(model):
    m, tok = model
    prompts = [tok.encode("The first of two rows"), tok.encode("And the second row, longer")]
    alone = _mlx_lm_tokens(m, prompts[1], 6, prefill_step=64)[0]
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq)
    for i, p in enumerate(prompts):
        r.inbox.put(AddRequest(f"r{i}", p, 6, greedy_sampler, []))
    r.take_commands()
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    done: set[str] = set()
    while "r1" not in done:
        r.step()
        while not outq.empty():
            item = outq.get()
            if isinstance(item, StepTokens):
                for rid, tok_id, fin in item.rows:
                    got[rid].append(tok_id)
                    if fin:
                        done.add(rid)
        if got["r0"] and "r0" not in done:
            r.inbox.put(AbortRequest("r0"))  # before mlx-lm returns its first token
            r.take_commands()
            done.add("r0")
    assert got["r1"] == alone and len(got["r0"]) == 1
    assert not r.rows and r.counters.generated_tokens == 7
