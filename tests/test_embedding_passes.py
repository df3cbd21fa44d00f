"""Embedding passes bounded by time (`engine/embeddings/passes.py`) and requests dropped when
their clients go away (`batching.Embedding.abort`), on the MLX-thread side with real
random-weight causal LMs (sliding-window and hybrid ones too), no daemon: a long input is
embedded a chunk a pass through a KV cache and gives the vector of one whole pass; an
abandoned request's remaining inputs are never embedded, a long one stopping within a chunk."""

from __future__ import annotations

import json
import queue
import threading

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlxd.engine.batch.timing.chunking import FLOOR, IDLE_STEP
from mlxd.engine.embeddings.batching import Embedding
from mlxd.engine.embeddings.models import CausalLMEmbedder
from mlxd.engine.embeddings.passes import MAX_STEP_TOKENS, chunk_tokens, pass_tokens, plan_steps
from mlxd.protocol.messages import Delta, Embed, Embeddings
from support.random_model import write_random_model


def test_a_pass_holds_what_fits_in_the_step_target():
    assert pass_tokens(2.0, None) == MAX_STEP_TOKENS  # not timed yet: tokens bound it alone
    assert pass_tokens(2.0, 0.01) == 160  # 0.8 of 2 s at 10 ms a token
    assert pass_tokens(2.0, 10.0) == FLOOR
    assert pass_tokens(2.0, 1e-9) == MAX_STEP_TOKENS
    assert chunk_tokens(2.0, None) == IDLE_STEP
    assert chunk_tokens(2.0, 1e-9) == IDLE_STEP  # a chunk is never longer than mlx-lm's
    assert chunk_tokens(2.0, 0.01) == 160


def test_passes_group_similar_lengths_within_the_bound():
    lengths = [10, 300, 12, 290, 11]
    assert plan_steps(lengths, max_tokens=600) == [[1, 3], [2, 4, 0]]
    assert plan_steps(lengths, max_tokens=100) == [[1], [3], [2, 4, 0]]  # a long one alone
    assert plan_steps(lengths, max_inputs=2) == [[1, 3], [2, 4], [0]]


@pytest.fixture(scope="module")
def causal(tiny_model):
    model, tokenizer = mlx_lm.load(str(tiny_model))[:2]
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return CausalLMEmbedder(model, tokenizer, 256, vocab, mx.default_stream(mx.default_device()))


def token_ids(causal: CausalLMEmbedder, n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, causal.vocab, n)]


def test_a_long_input_in_chunks_gives_the_vector_of_one_pass(causal):
    ids = token_ids(causal, 200, 0)
    assert causal.chunks
    whole = causal.forward([ids])[0]
    running = causal.begin()
    for at in range(0, len(ids), 37):
        causal.feed(running, ids[at:at + 37])
    np.testing.assert_allclose(causal.pooled(running), whole, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "qwen3_next", "lfm2"])
def test_sliding_window_and_hybrid_models_in_chunks_give_the_vector_of_one_pass(tmp_path,
                                                                               family):
    """Their caches (a 16-token window that rotates, recurrent state) fed 37 tokens at a time
    over 200: the same vector as one pass without a cache."""
    path = write_random_model(tmp_path / family, family=family)
    model, tokenizer = mlx_lm.load(str(path))[:2]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    embedder = CausalLMEmbedder(model, tokenizer, 512, vocab,
                                mx.default_stream(mx.default_device()))
    ids = token_ids(embedder, 200, 3)
    assert embedder.chunks
    running = embedder.begin()
    for at in range(0, len(ids), 37):
        embedder.feed(running, ids[at:at + 37])
    np.testing.assert_allclose(embedder.pooled(running), embedder.forward([ids])[0], atol=1e-5)


class Engine:
    """An `Embedding` as an engine holds it, its MLX thread driven by the test."""

    def __init__(self, embedder: CausalLMEmbedder, token_s: float | None) -> None:
        self.outq: queue.Queue = queue.Queue()
        self.woken = threading.Semaphore(0)
        self.emb = Embedding(embedder, self.outq, "e", 0, wake=self.woken.release,
                             token_s=token_s, target_s=0.25)

    def submit(self, rid: str, ids: list[int]) -> None:
        self.emb.submit(Embed(rid, input_token_ids=[ids]))
        assert self.woken.acquire(timeout=30)  # the lane has prepared it

    def answers(self) -> list:
        out = []
        while not self.outq.empty():
            out.append(self.outq.get_nowait())
        return out


def test_a_long_input_goes_a_chunk_a_pass_and_an_abandoned_one_stops_within_a_chunk(causal):
    long, short = token_ids(causal, 200, 1), token_ids(causal, 12, 2)
    # 10 ms a token: the 0.25 s target's first chunk is 20 tokens; a pass here is much faster,
    # so the chunks then grow, at most 2x the last: 20, 40, 80 and the last 60
    eng = Engine(causal, token_s=0.01)
    eng.submit("whole", long)
    while eng.emb.run_pass():
        pass
    assert eng.emb.counters.steps == 4
    (got,) = eng.answers()
    assert isinstance(got, Embeddings) and got.request_id == "whole"
    vector = np.frombuffer(got.vectors, "<f4")
    np.testing.assert_allclose(vector, causal.forward([long])[0], atol=1e-5)

    eng = Engine(causal, token_s=0.01)
    eng.submit("gone", long)
    eng.submit("kept", short)
    assert eng.emb.run_pass() and eng.emb.run_pass()  # 60 of the long input's 200 tokens
    steps = eng.emb.counters.steps
    eng.emb.abort(["gone", "never-seen"])
    while eng.emb.run_pass():
        pass
    c = eng.emb.counters
    assert c.steps == steps + 1  # the short input's pass; no further chunk of the long one
    assert (c.abandoned, c.active, c.requests) == (1, 0, 1)
    (got,) = eng.answers()  # the abandoned request gets no answer: its client is gone
    assert isinstance(got, Embeddings) and got.request_id == "kept"
    assert not eng.emb._live and not eng.emb._abandoned  # nothing kept for either id


def test_a_request_abandoned_before_its_first_pass_never_runs(causal):
    eng = Engine(causal, token_s=None)
    eng.submit("gone", [5, 6, 7])
    eng.emb.abort(["gone"])
    assert not eng.emb.run_pass()
    assert (eng.emb.counters.steps, eng.emb.counters.abandoned) == (0, 1)
    assert eng.answers() == []
    eng.submit("late-abort", [5, 6, 7])
    assert not eng.emb.run_pass()  # embedded in one pass, answered
    eng.emb.abort(["late-abort"])  # a finished request's abort is ignored
    assert isinstance(eng.answers()[0], Embeddings) and not eng.emb._abandoned
    assert not any(isinstance(a, Delta) for a in eng.answers())
