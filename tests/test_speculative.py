"""Speculative decoding (issue 16): the pure parts (prompt lookup, the accept rule, the
when-it-pays policy) without processes; the runner's speculative steps against plain decoding
token for token on tiny random models (prompt lookup; a draft model that is the target, so
every draft is accepted; a different random draft, so few are); seeded sampling; a request
joining a speculating row; and a daemon whose engine is killed mid-speculation resuming with
identical text."""

from __future__ import annotations

import queue
from typing import cast

import pytest
from mlx_lm.sample_utils import greedy_sampler

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.engine.admit.sampling import make_request_sampler
from mlxd.engine.batch.messages import AddRequest, StepTokens
from mlxd.engine.batch.runner import Runner
from mlxd.engine.load.loader import load_model
from mlxd.engine.speculative.policy import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    NEVER_PAYS_MAX,
    NgramIndex,
    SpecPolicy,
    accepted,
)
from mlxd.engine.speculative.step import Speculator, sampler_position
from mlxd.protocol.messages import SamplingParams
from support.harness import stream_chat

CODE = "def main():\n    print('hello world')\n    return 0\n" * 4

# ------------------------------------------------------------------ pure logic


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    idx = NgramIndex(max_n=3, min_n=2)
    idx.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2])
    # suffix [1, 2] last occurred at the start, followed by 3 4 5
    assert idx.propose(3) == [3, 4, 5]
    idx.extend([3])  # suffix [1 2 3] (3-gram) beats the more recent [2 3] -> 7
    assert idx.propose(2) == [4, 5]
    idx.extend([6])  # [3 6] and [2 3 6] never occurred
    assert idx.propose(4) == []
    # incremental building equals building at once
    whole = NgramIndex(max_n=3, min_n=2)
    whole.extend(idx.tokens)
    assert whole.propose(4) == idx.propose(4) and whole._after == idx._after


def test_accept_rule_keeps_drafts_while_they_equal_the_targets_samples():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted([], [4]) == 0


def test_policy_times_plain_steps_first_then_pauses_drafting_while_it_does_not_pay():
    p = SpecPolicy(max_draft=4)
    assert p.draft_len(100) == 0  # no plain timing yet
    p.record_plain(None)  # blurred by the step before: not a timing
    assert p.draft_len(100) == 0
    p.record_plain(0.010)
    assert p.draft_len(100) == 4 and p.draft_len(3) == 2 and p.draft_len(1) == 0
    p.record_spec(0.012, drafted=4, accepted=3, produced=4)  # 3 ms a token: pays
    assert p.pause == 0 and p.draft_len(100) == 4
    p.record_spec(0.040, drafted=4, accepted=0, produced=1)  # mean now above 10 ms a token
    assert p.pause == 8 and p.draft_len(100) == 0
    for _ in range(8):
        p.record_plain(0.010)
    assert p.counters.skipped == 8 and p.draft_len(100) == 4  # tried again
    p.record_spec(0.050, drafted=4, accepted=0, produced=1)
    assert p.pause == 16  # still not paying: a longer pause
    assert p.counters.steps == 3 and p.counters.drafted == 12 and p.counters.accepted == 3
    for _ in range(16):
        p.record_plain(0.010)
    p.record_spec(0.060, drafted=4, accepted=4, produced=5)  # 5 tokens for 6 plain steps' time
    assert p.pause == BACKOFF_MAX  # no acceptance rate could make it pay: a long pause
    for pause in (2 * BACKOFF_MAX, 4 * BACKOFF_MAX, 8 * BACKOFF_MAX, NEVER_PAYS_MAX,
                  NEVER_PAYS_MAX):  # ... longer each time it happens again, up to a bound
        for _ in range(p.pause):
            p.record_plain(0.010)
        p.record_spec(0.060, drafted=4, accepted=4, produced=5)
        assert p.pause == pause
    for _ in range(p.pause):
        p.record_plain(0.010)
    p.record_miss()  # a miss does not undo what the steps that could never pay earned
    assert p.pause == p.backoff == NEVER_PAYS_MAX
    for _ in range(p.pause):
        p.record_plain(0.010)
    p.record_spec(0.012, drafted=4, accepted=3, produced=4)  # it pays again: short pauses
    p.record_spec(0.040, drafted=4, accepted=0, produced=1)
    assert p.pause == BACKOFF_MIN


def test_a_wait_that_found_no_draft_pauses_drafting_like_a_step_that_did_not_pay():
    p = SpecPolicy(max_draft=4)
    p.record_plain(0.010)
    p.record_miss()
    assert p.counters.missed == 1 and p.pause == 8 and p.draft_len(100) == 0
    for _ in range(8):
        p.record_plain(0.010)
    p.record_miss()
    assert p.pause == 16  # misses in a row wait longer each time
    for _ in range(16):
        p.record_plain(0.010)
    p.record_spec(0.012, drafted=4, accepted=3, produced=4)  # a step that pays
    assert p.backoff == 8 and p.draft_len(100) == 4  # the next miss pauses briefly again
    unjudged = SpecPolicy(max_draft=4, judge=False)
    unjudged.record_miss()
    assert unjudged.pause == 0 and unjudged.counters.missed == 1


def test_a_draft_model_fits_its_draft_length_to_what_is_accepted():
    p = SpecPolicy(max_draft=6, adaptive=True, judge=False)
    assert p.draft_len(100) == 6
    for _ in range(10):
        p.record_spec(0.01, drafted=6, accepted=0, produced=1)
    assert p.draft_len(100) == 1
    for _ in range(10):
        p.record_spec(0.01, drafted=6, accepted=6, produced=7)
    assert p.draft_len(100) == 6


def test_the_seeded_samplers_position_is_found_and_greedy_has_none():
    s = make_request_sampler(SamplingParams(temperature=0.8, seed=3), start_position=5)
    assert sampler_position(s) == [5]
    assert sampler_position(greedy_sampler) is None


# ------------------------------------------------------------------ the runner


@pytest.fixture(scope="module")
def models(tiny_model, tiny_model_b, tmp_path_factory):
    cache = tmp_path_factory.mktemp("c")
    target, tok, _ = load_model(str(tiny_model), cache)
    other, _, _ = load_model(str(tiny_model_b), cache)
    return target, other, tok


def drive(model, spec, requests, joins=None, max_steps=2000, batch_size=4):
    """Run requests through a Runner; `joins`: {step: AddRequest} added before that step.
    Returns ({request id: tokens}, {request id: step of its first token})."""
    q: queue.Queue = queue.Queue()
    r = Runner(model, [], batch_size=batch_size, prefill_step=64, outbox=q, speculator=spec)
    for add in requests:
        r.inbox.put(add)
    joins = dict(joins or {})
    out: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    done: set[str] = set()
    expected = len(requests) + len(joins)
    for step in range(max_steps):
        if step in joins:
            r.inbox.put(joins.pop(step))
        r.take_commands()
        r.step()
        while not q.empty():
            item = q.get()
            if isinstance(item, StepTokens):
                for rid, tok, fin in item.rows:
                    out.setdefault(rid, []).append(tok)
                    first.setdefault(rid, step)
                    if fin:
                        done.add(rid)
        if len(done) == expected:
            return out, first
    raise AssertionError("requests did not finish")


def greedy():
    return greedy_sampler


def seeded():
    return make_request_sampler(SamplingParams(temperature=0.8, seed=7))


def forced(num_draft, draft=None):
    spec = Speculator(num_draft, draft)
    spec.policy.judge = False  # always draft: the tests are about the tokens, not the pay
    spec.rows_policy.judge = False
    return spec


@pytest.mark.parametrize("drafter", ["ngram", "draft=target", "draft=other"])
def test_greedy_speculative_output_equals_plain_token_for_token(models, drafter):
    target, other, tok = models
    prompt = tok.encode(CODE)
    draft = {"ngram": None, "draft=target": target, "draft=other": other}[drafter]
    plain, _ = drive(target, None, [AddRequest("a", prompt, 80, greedy(), [])])
    spec = forced(4, draft)
    got, _ = drive(target, spec, [AddRequest("a", prompt, 80, greedy(), [])])
    assert got == plain and len(plain["a"]) == 80
    c = spec.counters
    assert c.steps > 0 and c.tokens <= 80
    if drafter == "draft=target":  # every draft accepted: up to 5 tokens a step
        assert c.accepted == c.drafted and c.tokens == c.steps + c.accepted
        assert c.tokens / c.steps > 4
    elif drafter == "draft=other":  # a different random model: few accepted
        assert c.accepted / c.drafted < 0.3
    else:
        assert c.accepted > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft=target"])
def test_seeded_sampling_equals_plain_and_itself_run_to_run(models, drafter):
    target, _, tok = models
    prompt = tok.encode(CODE)
    draft = target if drafter == "draft=target" else None
    plain, _ = drive(target, None, [AddRequest("a", prompt, 60, seeded(), [])])
    spec = forced(4, draft)
    one, _ = drive(target, spec, [AddRequest("a", prompt, 60, seeded(), [])])
    two, _ = drive(target, forced(4, draft), [AddRequest("a", prompt, 60, seeded(), [])])
    assert one == two == plain
    if draft is not None:  # the draft samples with the target's keys: all accepted
        assert spec.counters.steps > 0 and spec.counters.accepted == spec.counters.drafted


def test_a_request_joining_a_speculating_row_waits_no_longer_than_with_plain_steps(models):
    """Both rows' tokens equal plain decoding's with the same arrivals; the newcomer's first
    token comes at the same step as without speculation; the first row speculates alone,
    before and after the newcomer."""
    target, _, tok = models
    a = tok.encode(CODE)
    b = tok.encode("Hello, how are you today? I am fine, thank you for asking.")

    def requests():
        return ([AddRequest("a", a, 90, greedy(), [])],
                {6: AddRequest("b", b, 12, greedy(), [])})

    plain, plain_first = drive(target, None, *requests())
    spec = forced(4, target)
    got, got_first = drive(target, spec, *requests())
    assert got == plain
    assert got_first["b"] == plain_first["b"]
    c = spec.counters
    assert c.steps > 0 and c.tokens > c.steps  # drafts were accepted while "a" ran alone
    assert len(got["a"]) == 90 and len(got["b"]) == 12


ROW_PROMPTS = [CODE, "Hello, how are you today? I am fine, thank you for asking. " * 3,
               "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 " * 2,
               "The quick brown fox jumps over the lazy dog. " * 5]


def several_rows(tok, seeded_rows=(1, 3)):
    """Four rows of different prompt lengths (different left padding) and budgets (they
    finish at different steps, some inside a speculative step), greedy and seeded mixed."""
    return [AddRequest(f"r{i}", tok.encode(p), 30 + 7 * i,
                       seeded() if i in seeded_rows else greedy(), [])
            for i, p in enumerate(ROW_PROMPTS)]


@pytest.mark.parametrize("drafter", ["ngram", "draft=target", "draft=other"])
def test_several_rows_speculate_in_one_pass_with_the_tokens_of_plain_decoding(models, drafter):
    """Each row drafts on its own and keeps its own accepted count (all with the target as its
    own draft; few and different per row with another model: rows cut back by different
    counts), in one verify pass; every row's tokens are plain decoding's, greedy and seeded."""
    target, other, tok = models
    draft = {"ngram": None, "draft=target": target, "draft=other": other}[drafter]
    plain, _ = drive(target, None, several_rows(tok))
    spec = forced(4, draft)
    got, _ = drive(target, spec, several_rows(tok))
    assert got == plain
    assert [len(got[f"r{i}"]) for i in range(4)] == [30, 37, 44, 51]
    c = spec.counters
    assert c.batched > 0 and c.tokens > c.steps
    if drafter == "draft=target":
        assert c.accepted == c.drafted
    elif drafter == "draft=other":
        assert c.accepted / c.drafted < 0.3


def test_rows_speculate_together_only_up_to_rows_max(models):
    """A verify pass leaves rows that accepted different counts padded, and a padded batch
    attends with an array mask at every later step: beyond ROWS_MAX rows (a crowd of chats,
    where it cost 17 % on the CPU) the batch decodes plain, drafts or not."""
    from mlxd.engine.speculative.step import ROWS_MAX
    target, _, tok = models
    prompt = tok.encode(CODE)

    def rows(n: int) -> list[AddRequest]:  # finishing together: the batch never shrinks
        return [AddRequest(f"r{i}", prompt, 24, greedy(), []) for i in range(n)]
    spec = forced(4, target)
    plain, _ = drive(target, None, rows(ROWS_MAX + 1), batch_size=ROWS_MAX + 1)
    got, _ = drive(target, spec, rows(ROWS_MAX + 1), batch_size=ROWS_MAX + 1)
    assert got == plain and spec.counters.batched == 0
    spec = forced(4, target)
    drive(target, spec, rows(ROWS_MAX), batch_size=ROWS_MAX)
    assert spec.counters.batched > 0


def test_rows_finishing_together_in_a_plain_step_are_served(models):
    """As mlxd runs it (drafting judged, so the first steps are plain and timed): rows that
    all finish in one plain step leave an empty batch behind, and the step's timing must
    not divide by it."""
    target, _, tok = models
    prompt = tok.encode(CODE)
    got, _ = drive(target, Speculator(4), [AddRequest("a", prompt, 3, greedy(), []),
                                           AddRequest("b", prompt, 3, greedy(), [])])
    assert len(got["a"]) == len(got["b"]) == 3


def test_a_resumed_row_continues_its_seeded_draws_beside_speculating_rows(models):
    """A row resumed as after an engine death (its delivered tokens appended to the prompt,
    its sampler continuing at their count) next to other speculating rows gives the tokens
    the uninterrupted row gave."""
    target, _, tok = models
    whole, _ = drive(target, forced(4, target), several_rows(tok))
    cut = 12
    prompt = tok.encode(ROW_PROMPTS[1]) + whole["r1"][:cut]
    resumed = AddRequest("r1", prompt, 37 - cut,
                         make_request_sampler(SamplingParams(temperature=0.8, seed=7),
                                              start_position=cut), [])
    others = [r for r in several_rows(tok) if r.request_id != "r1"]
    spec = forced(4, target)
    got, _ = drive(target, spec, [resumed, *others])
    assert got["r1"] == whole["r1"][cut:]
    assert spec.counters.batched > 0


def test_rows_asking_for_logprobs_or_with_penalties_are_decoded_plain(models):
    target, _, tok = models
    prompt = tok.encode(CODE)
    spec = forced(4, target)
    drive(target, spec, [AddRequest("a", prompt, 20, greedy(), [], logprobs=2)])
    from mlxd.engine.admit.sampling import make_request_processors
    procs = make_request_processors(SamplingParams(repetition_penalty=1.3))
    drive(target, spec, [AddRequest("b", prompt, 20, greedy(), procs)])
    assert spec.counters.steps == 0
    # nor does a batch holding such a row speculate
    drive(target, spec, [AddRequest("c", prompt, 20, greedy(), []),
                         AddRequest("d", prompt, 20, greedy(), [], logprobs=2)])
    assert spec.counters.batched == 0


def _greedy_continuation(model, context: list[int], k: int) -> list[int]:
    """What a draft model proposes for one row on its own: greedy after the whole context."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    logits = model(mx.array([context]), cache=cache)[:, -1]
    out: list[int] = []
    for _ in range(k):
        y = mx.argmax(logits, axis=-1)
        out.append(cast(int, y.item()))
        logits = model(y[:, None], cache=cache)[:, -1]
    return out


def test_a_draft_model_drafts_for_all_rows_in_one_pass_per_position(models):
    """DraftRows: k drafts for each of several rows (different lengths: padded rows) in k
    passes of the draft model, each row's drafts those it would propose alone; after rows
    accepted different counts, again k passes; rows behind by plain steps caught up in one
    pass together; a row leaving and one joining keep the others' drafts right."""
    from mlxd.engine.speculative.draft_rows import DraftRows
    target, other, tok = models
    draft = DraftRows(other, prefill_step=64)
    contexts = {u: tok.encode(p) for u, p in enumerate(ROW_PROMPTS[:3])}

    def propose(k: int = 4) -> dict[int, list[int]]:
        uids = list(contexts)
        got = draft.propose(uids, [contexts[u][:-1] for u in uids],
                            [contexts[u][-1] for u in uids], k, [None] * len(uids))
        for u, d in zip(uids, got, strict=True):
            assert d == _greedy_continuation(other, contexts[u], k), u
        return dict(zip(uids, got, strict=True))

    before = draft.passes
    got = propose()
    new_rows = sum(-(-(len(c) - 1) // 64) for c in contexts.values())  # each prefilled alone
    assert draft.passes - before == new_rows + 4
    # row 0 accepted all four (its cache lacks the last), row 1 two, row 2 none
    for u, n in zip(contexts, (4, 2, 0), strict=True):
        contexts[u] += [*got[u][:n], 7]
    before = draft.passes
    got = propose()
    assert draft.passes - before == 4
    # ten plain steps for every row: one catch-up pass for all, then the drafts
    for u in contexts:
        contexts[u] += list(range(20, 30))
    before = draft.passes
    propose()
    assert draft.passes - before == 1 + 4
    # row 1 leaves, row 3 joins: only row 3 is prefilled
    del contexts[1]
    contexts[3] = tok.encode(ROW_PROMPTS[3])
    before = draft.passes
    propose(3)
    assert draft.passes - before == -(-(len(contexts[3]) - 1) // 64) + 3


def test_rows_joining_and_leaving_a_batch_drafted_by_a_model_keep_plain_tokens(models):
    """Rows decoding with a draft model (the target itself: all accepted; another model: few),
    two joining while the others speculate and rows finishing at different steps: every row's
    tokens are plain decoding's, and the draft model ran batched (a pass per drafted position
    for all rows, not one per row)."""
    target, other, tok = models
    for draft in (target, other):
        def requests():
            rows = several_rows(tok)
            return rows[:2], {8: rows[2], 15: rows[3]}
        plain, _ = drive(target, None, *requests())
        spec = forced(4, draft)
        got, _ = drive(target, spec, *requests())
        assert got == plain
        c = spec.counters
        assert c.batched > 0
        assert spec.draft_rows is not None
        # row by row would be at least 2 rows x 4 drafts per batched step
        assert spec.draft_rows.passes < 8 * c.batched
        if draft is target:
            assert c.accepted == c.drafted


# ------------------------------------------------------------------ a daemon

CHAT = [{"role": "user", "content": "Tell me a long story about the sea and the lighthouse."}]




def test_resume_after_a_kill_mid_speculation_gives_identical_text(tiny_model):
    # --draft-model: the target itself, so greedy and seeded rows both speculate every step;
    # 50 ms steps (a fault delay) in the first two epochs leave time to aim the kill
    d = start_daemon(tiny_model, "--restart-backoff", "0.1", "--block-tokens", "16",
                     "--no-warm-up", "--draft-model", str(tiny_model), "--num-draft-tokens", "3",
                     isolate=True, env={"MLXD_FAULTS": "engine.step=delay@1#<2"})
    try:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
            body = {"messages": CHAT, "max_tokens": 32, **sampling}
            # a row asking for log-probabilities is decoded plain: the reference
            plain, _ = stream_chat(d, {**body, "logprobs": True, "top_logprobs": 1})
            spec, _ = stream_chat(d, body)
            assert spec == plain
        # seeded: the resumed row's draws continue at the positions the killed one reached
        def speculating(engine: dict) -> None:
            assert engine["cache"]["spec_steps"] > 0  # killed mid-speculation

        text, usage = stream_chat(d, body, kill_after=10, before_kill=speculating)
        assert text == plain
        assert usage["completion_tokens"] == 32 and usage["resumes"] == 1
        st = d.stats()["engines"][0]["cache"]
        assert st["spec_mode"] == "draft" and st["spec_acceptance"] == 1.0
        assert st["spec_tokens_per_step"] > 2
        with d.http() as c:
            metrics = c.get("/metrics").text
        assert 'mlxd_speculative_tokens_total{kind="accepted"' in metrics
    finally:
        stop(d)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_a_state_model_speculates_and_rewinds_rejected_drafts_to_the_plain_text(
        family, models, tmp_path):
    """Sliding-window (wrapped: 16 tokens) and recurrent layers cannot be trimmed: a rejected
    draft is rewound (state restored, accepted tokens fed again), and the text is the plain
    steps' token for token. The drafts come from another random model (a plain llama with the
    same vocabulary): most are rejected."""
    from support.random_model import write_random_model
    _, other, _ = models
    model, tok, _ = load_model(str(write_random_model(tmp_path / family, family=family)),
                               tmp_path / "c")
    prompt = tok.encode(CODE)
    plain, _ = drive(model, None, [AddRequest("a", prompt, 60, greedy(), [])])
    spec = forced(4, other)
    got, _ = drive(model, spec, [AddRequest("a", prompt, 60, greedy(), [])])
    assert got == plain and len(plain["a"]) == 60
    c = spec.counters
    assert c.steps > 0 and c.drafted > c.accepted  # drafts were rejected, and rewound


def test_a_draft_model_that_cannot_be_trimmed_is_refused_at_load(models, tmp_path):
    from mlxd.engine.load.loader import ModelLoadError, load_draft
    from support.random_model import write_random_model
    target, _, _ = models
    recurrent = write_random_model(tmp_path / "m", family="mamba2")
    with pytest.raises(ModelLoadError, match="cannot be trimmed"):
        load_draft(str(recurrent), tmp_path / "c", "auto", target)
