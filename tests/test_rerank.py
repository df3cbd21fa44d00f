"""Reranking through a real daemon: `/v1/rerank`, `/v2/rerank` and `/rerank` served by a
random-weight ModernBERT cross-encoder (written by the test) in an embedding engine; its scores
equal what mlx-embeddings computes in-process for the same pairs. Cohere's and Jina's request
shapes, `top_n`, `return_documents`; bad input is a 400; an embedding model and a generation
model in the same pool answer a rerank with a 400 and their engines never see it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import start_daemon, stop_and_check
from support.random_bert import write_random_bert, write_random_cross_encoder

MODEL = "tiny-reranker"
QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "the quick brown fox jumps over the lazy dog",
        "Hello, how are you today?", "Numbers: 0 1 2 3 42", "Paris", "embeddings map sentences"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_random_cross_encoder(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write_random_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="module")
def reference(reranker):
    """The cross-encoder run in-process with mlx-embeddings: each pair's score, and the
    pairs' tokens."""
    from mlx_embeddings import load
    model, tokenizer = load(str(reranker))

    def score(query: str, docs: list[str]) -> tuple[np.ndarray, int]:
        pairs = tokenizer([query] * len(docs), docs, padding=True, return_tensors="mlx")
        out = model(pairs["input_ids"], attention_mask=pairs["attention_mask"])
        return np.array(out.pooler_output)[:, 0], int(pairs["attention_mask"].sum().item())
    return score


@pytest.fixture(scope="module")
def daemon(reranker):
    d = start_daemon(reranker, "--model-pool", "3", isolate=True)
    yield d
    stop_and_check(d)


def rerank(d, body: dict, path: str = "/v1/rerank"):
    with d.http() as h:
        return h.post(path, json=body)


def test_jina_shape_gets_mlx_embeddings_scores_best_first(daemon, reference):
    want, tokens = reference(QUERY, DOCS)
    assert len(set(np.round(want, 4))) == len(DOCS), "the test needs distinct scores"
    r = rerank(daemon, {"model": MODEL, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [x["index"] for x in got["results"]] == list(np.argsort(-want))
    for x in got["results"]:
        assert x["relevance_score"] == pytest.approx(float(want[x["index"]]), abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}  # Jina's default: documents back
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert got["model"] == MODEL and got["id"].startswith("rerank-")


def test_cohere_shape_top_n_without_documents_on_every_path(daemon, reference):
    want, _ = reference(QUERY, DOCS)
    best = [int(i) for i in np.argsort(-want)[:2]]
    body = {"model": MODEL, "query": QUERY, "top_n": 2, "return_documents": False,
            "documents": [{"text": t, "title": "ignored"} for t in DOCS]}
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        got = rerank(daemon, body, path).json()
        assert [x["index"] for x in got["results"]] == best, path
        assert all(set(x) == {"index", "relevance_score"} for x in got["results"])
        assert got["meta"]["api_version"]["version"] == "2"
    # top_n beyond the documents is all of them; one document alone scores as in a batch
    assert len(rerank(daemon, {**body, "top_n": 50}).json()["results"]) == len(DOCS)
    one = rerank(daemon, {"model": MODEL, "query": QUERY, "documents": [DOCS[3]]}).json()
    assert one["results"][0]["relevance_score"] == pytest.approx(float(want[3]), abs=1e-5)


@pytest.mark.parametrize("body,param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": ["d"] * 1001}, "documents"),
    ({"query": QUERY, "documents": ["x" * 262_145]}, "documents"),
    ({"query": 42, "documents": DOCS}, "query"),
    ({"query": {"text": QUERY}, "documents": DOCS}, "query"),
    ({"documents": DOCS}, "query"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": [[[["deep"]]] * 1]}, "documents"),
])
def test_bad_input_is_a_400_in_openai_envelope(daemon, body, param):
    r = rerank(daemon, {"model": MODEL, **body})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"].startswith(param), r.text[:300]


def test_deep_json_and_a_too_long_query(daemon):
    with daemon.http() as h:
        r = h.post("/v1/rerank", content=b'{"query": "q", "documents": ' + b"[" * 100_000
                   + b"]" * 100_000 + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = rerank(daemon, {"model": MODEL, "query": "fox " * 200, "documents": ["d"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_models_that_cannot_rerank_get_a_400_their_engines_never_see(daemon, bert,
                                                                     tiny_model):
    with daemon.http() as h:
        for model in (str(bert), str(tiny_model)):
            r = h.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCS})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_supported" and error["param"] == "model"
            assert "cannot rerank" in error["message"]
        engines = {e["model"]: e for e in daemon.stats()["engines"]}
        assert engines["tiny-bert"]["cache"]["embed_inputs"] == 0
        assert engines["tiny-llama"]["cache"]["embed_inputs"] == 0
        # both still serve what they do serve; the reranker says it reranks
        assert h.post("/v1/embeddings", json={"model": str(bert), "input": "x"}).status_code \
            == 200
        chat = h.post("/v1/chat/completions", json={
            "model": str(tiny_model), "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        show = h.post("/api/show", json={"model": MODEL}).json()
        assert {"embedding", "rerank"} <= set(show["capabilities"])
