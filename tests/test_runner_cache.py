"""The MLX thread's cache use, driven directly (no processes): history reuse token-exactly, and
the next-token logits after a restore equal those of the live cache."""

from __future__ import annotations

import queue

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine.batch.burst import GROUP_MIN_CACHED_GPU
from mlxd.engine.batch.messages import AddRequest, StepTokens
from mlxd.engine.batch.runner import Runner
from mlxd.engine.kv.codec import CacheCodec
from mlxd.engine.load.loader import load_model
from support.runner_drive import run_one, run_together


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    m, tok, _ = load_model(str(tiny_model), tmp_path_factory.mktemp("c"))
    return m, tok



def test_a_finished_history_is_reused_token_exactly(model):
    m, tok = model
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=1 << 30)
    prompt = tok.encode("Hello, how are you today? The quick brown fox")
    gen1, s1 = run_one(r, outq, AddRequest("a", prompt, 10, greedy_sampler, []))
    assert s1.cached_tokens == 0
    follow = prompt + gen1 + tok.encode(" and then")
    gen2, s2 = run_one(r, outq, AddRequest("b", follow, 5, greedy_sampler, []))
    # the KV of the prompt and every generated token was published
    assert s2.cached_tokens == len(prompt) + len(gen1) and s2.source == "ram"
    cold = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=0)
    gen_cold, s3 = run_one(cold, outq, AddRequest("c", follow, 5, greedy_sampler, []))
    assert s3.cached_tokens == 0 and gen_cold == gen2


def test_a_hit_shorter_than_the_minimum_is_prefilled_whole(model, monkeypatch):
    """`min_cached_tokens` (a hidden setting): a shorter hit is not lent, a longer one is,
    and the answer is the same either way."""
    m, tok = model
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=1 << 30)
    prompt = tok.encode("Hello, how are you today? The quick brown fox")
    gen1, _ = run_one(r, outq, AddRequest("a", prompt, 4, greedy_sampler, []))
    follow = prompt + gen1 + tok.encode(" and then")
    held = len(prompt) + len(gen1)
    r._min_cached = held + 1
    gen_whole, whole = run_one(r, outq, AddRequest("b", follow, 5, greedy_sampler, []))
    assert whole.cached_tokens == 0 and whole.source == "none"
    r._min_cached = held
    gen_hit, hit = run_one(r, outq, AddRequest("c", follow, 5, greedy_sampler, []))
    assert hit.cached_tokens >= held and hit.source == "ram"
    assert gen_hit == gen_whole


def test_lend_floor_holds_back_short_hits_only_for_rows_admitted_together_on_a_gpu():
    from mlxd.engine.batch.burst import GROUP_MIN_CACHED_GPU, lend_floor
    assert lend_floor(1, gpu=True) == 0  # a lone request: any hit
    assert lend_floor(2, gpu=True) == GROUP_MIN_CACHED_GPU
    assert lend_floor(32, gpu=False) == 0  # a CPU's prefill is bound by its tokens
    assert lend_floor(1, gpu=False, min_cached=200) == 200
    assert lend_floor(8, gpu=True, min_cached=200) == 200


@pytest.mark.parametrize("gpu", [True, False])
def test_rows_admitted_together_on_a_gpu_are_not_lent_short_hits(model, gpu):
    """Two requests reaching an idle runner together, each with a RAM hit shorter than
    GROUP_MIN_CACHED_GPU: on a GPU both are prefilled whole, on a CPU both are lent the hit; a
    lone request is lent it either way, and the answers are the same."""
    m, tok = model
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=1 << 30)
    r._gpu = gpu  # the device this machine lacks, for the admission rule alone
    prompt = tok.encode("Hello, how are you today? The quick brown fox")
    gen1, _ = run_one(r, outq, AddRequest("a", prompt, 4, greedy_sampler, []))
    held = len(prompt) + len(gen1)
    assert held < GROUP_MIN_CACHED_GPU
    follows = [prompt + gen1 + tok.encode(tail) for tail in (" and then", " jumps over")]
    got, starts = run_together(r, outq, [AddRequest(f"b{i}", f, 5, greedy_sampler, [])
                                         for i, f in enumerate(follows)])
    assert len(starts) == 2
    for started in starts.values():
        assert (started.cached_tokens, started.source) == ((0, "none") if gpu else (held, "ram"))
    alone, started = run_one(r, outq, AddRequest("c", follows[0], 5, greedy_sampler, []))
    assert started.cached_tokens >= held and started.source == "ram"  # b0's history, too
    assert alone == got["b0"]


def test_logits_after_restore_equal_live_logits(model):
    m, tok = model
    prompt = tok.encode("What is the capital of France? The capital of France is")
    live = make_prompt_cache(m)
    logits_live = m(mx.array([prompt]), cache=live)[:, -1]
    # restore: new cache objects over copies of the stored K/V (what an SSD restore builds)
    layers = [(np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :]))
              for c in live]
    restored = CacheCodec.for_model(m).lend([(mx.array(k), mx.array(v)) for k, v in layers], [],
                                            len(prompt), None)
    nxt = mx.array([[int(mx.argmax(logits_live))]])
    a = m(nxt, cache=live)[:, -1]
    b = m(nxt, cache=restored)[:, -1]
    assert mx.array_equal(a, b).item()


def test_a_steps_new_entries_go_to_the_ssd_tier_together_after_its_tokens(model):
    """Requests ending in one step hand their RAM entries (history and prompt boundary) to the
    SSD tier in one call, made after the step's tokens are in the outbox: on a GPU each call
    costs milliseconds of the MLX thread, and a step can end dozens of requests."""
    m, tok = model
    outq: queue.Queue = queue.Queue()
    calls: list[tuple[list, bool]] = []
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=1 << 30,
               persist=lambda entries: calls.append(
                   (entries, any(isinstance(x, StepTokens) and any(f for *_, f in x.rows)
                                 for x in list(outq.queue)))))
    prompts = [tok.encode(f"Prompt number {i} is about the sea") for i in range(3)]
    for i, p in enumerate(prompts):
        r.inbox.put(AddRequest(f"r{i}", p, 6, greedy_sampler, []))
    r.take_commands()
    while r.rows:
        r.step()
    calls = [c for c in calls if c[0]]  # (every step calls: the tier may have work left)
    assert len(calls) == 1, [len(e) for e, _ in calls]
    entries, tokens_out_first = calls[0]
    assert tokens_out_first
    # each request's history (prompt and generated) and its prompt boundary (one token short)
    assert sorted(len(e.tokens) for e in entries) == sorted(
        [len(p) + 6 for p in prompts] + [len(p) - 1 for p in prompts])


@pytest.mark.parametrize("family", ["gemma3_text", "mamba2"])
def test_state_models_prefill_a_shared_head_once_for_requests_admitted_together(family,
                                                                                tmp_path):
    """N agents with one long system prompt, arriving together, on a model with sliding-window
    or recurrent layers: the first stops where they part ways, its snapshot there starts the
    others, and every answer is that of a cold run."""
    from support.random_model import write_random_model
    m, _, _ = load_model(str(write_random_model(tmp_path / family, family=family)),
                         tmp_path / "c")
    head = [5 + (i * 37) % 290 for i in range(200)]
    prompts = [head + [7 + (i * 11 + j) % 280 for j in range(30)] for i in range(3)]
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=8, prefill_step=64, outbox=outq, cache_bytes=1 << 30)
    adds = [AddRequest(f"r{i}", p, 6, greedy_sampler, []) for i, p in enumerate(prompts)]
    got, started = run_together(r, outq, adds)
    assert started["r0"].cached_tokens == 0
    assert all(started[f"r{i}"].cached_tokens >= len(head) for i in (1, 2))
    assert r.counters.prefilled_tokens <= len(head) + 3 * 31
    cold = Runner(m, [], batch_size=8, prefill_step=64, outbox=outq, cache_bytes=0)
    for i, p in enumerate(prompts):
        assert run_one(cold, outq, AddRequest(f"c{i}", p, 6, greedy_sampler, []))[0] == \
            got[f"r{i}"]


def test_generation_checkpoints_of_a_state_model_carry_its_snapshot(tmp_path):
    """--generation-checkpoint on a hybrid model: each checkpoint holds the state layers'
    snapshot at exactly its length (what a resumed request restarts from)."""
    from support.random_model import write_random_model
    m, _, _ = load_model(str(write_random_model(tmp_path / "q", family="qwen3_next")),
                         tmp_path / "c")
    persisted: list = []
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=1 << 30,
               persist=persisted.extend, checkpoint_every=4)
    prompt = [5 + (i * 37) % 290 for i in range(40)]
    run_one(r, outq, AddRequest("a", prompt, 12, greedy_sampler, []))
    checkpoints = [e for e in persisted if len(e.tokens) > len(prompt)
                   and len(e.tokens) < len(prompt) + 12]
    assert r.counters.checkpoints >= 2 and checkpoints
    for e in checkpoints:
        assert list(e.states) == [len(e.tokens)] and len(e.states[len(e.tokens)]) == 2


def test_agent_sessions_stay_in_a_full_cache_and_one_off_prompts_go_first(model):
    """Two sessions' turns (each prompt the last one, its answer and a new tool result) in a
    cache with room for two of their entries and not much more: each new turn supersedes its
    session's previous entry (one entry per session), and unrelated one-off prompts, however
    many, are evicted before a session's latest turn (keep_policy.py)."""
    m, tok = model
    outq: queue.Queue = queue.Queue()
    rng = np.random.default_rng(7)

    def tokens(n: int) -> list[int]:
        return rng.integers(100, 400, n).tolist()

    r = Runner(m, [], batch_size=4, prefill_step=256, outbox=outq, cache_bytes=1 << 30)
    system = tokens(300)
    prompts = {s: system + tokens(100) for s in "ab"}  # tails past SUPERSEDE_SLACK
    for s in "ab":
        gen, _ = run_one(r, outq, AddRequest(f"{s}0", prompts[s], 8, greedy_sampler, []))
        prompts[s] = prompts[s] + gen + tokens(120)
    per_token = r.cache.nbytes / sum(len(e.tokens) for e in r.cache.entries())
    final = len(prompts["a"]) + 3 * (8 + 120)  # a session's last prompt
    r.cache.resize(int(per_token * 2.5 * final))  # two sessions, not two and a one-off
    for k in range(1, 4):
        for s in "ab":
            gen, st = run_one(r, outq, AddRequest(f"{s}{k}", prompts[s], 8, greedy_sampler, []))
            assert st.source == "ram" and st.cached_tokens >= len(prompts[s]) - 120 - 8
            prompts[s] = prompts[s] + gen + tokens(120)
        kept = [e for e in r.cache.entries() if e.kept]
        assert sorted(list(e.tokens) == prompts[s][:len(e.tokens)]
                      for e in kept for s in "ab") == [False, False, True, True]
        for j in range(2):  # one-offs: as long as a session's turn, sharing nothing
            run_one(r, outq, AddRequest(f"x{k}{j}", tokens(len(prompts["a"])), 4,
                                        greedy_sampler, []))
        assert sorted(e.kept for e in r.cache.entries()) in ([True, True], [False, True, True])
    assert r.cache.stats.superseded >= 6 and r.cache.stats.evictions >= 5
    for s in "ab":
        _, st = run_one(r, outq, AddRequest(f"{s}-last", prompts[s], 4, greedy_sampler, []))
        assert st.source == "ram" and st.cached_tokens >= len(prompts[s]) - 120 - 8
