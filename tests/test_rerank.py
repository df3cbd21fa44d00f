"""Reranking through a real daemon: `/v1/rerank`, `/v2/rerank` and `/rerank` served by
random-weight ModernBERT, BERT and XLM-RoBERTa cross-encoders (written by the test) in
embedding engines of one pool; their scores equal what is computed in-process for the same
pairs (mlx-embeddings, and for the heads it lacks numpy). Cohere's and Jina's request
shapes, `top_n`, `return_documents`; bad input is a 400; an embedding model and a generation
model in the same pool answer a rerank with a 400 and their engines never see it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

from conftest import start_daemon, stop_and_check
from support.random_bert import write_random_bert, write_random_cross_encoder

MODEL = "tiny-reranker"
QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "the quick brown fox jumps over the lazy dog",
        "Hello, how are you today?", "Numbers: 0 1 2 3 42", "Paris", "embeddings map sentences"]


FAMILIES = ("modernbert", "bert", "xlm_roberta")


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory) -> dict[str, Path]:
    """One cross-encoder per family; the ModernBERT is the daemon's model (`MODEL`)."""
    root = tmp_path_factory.mktemp("models")
    return {f: write_random_cross_encoder(root / (MODEL if f == "modernbert" else f"ce-{f}"),
                                          family=f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write_random_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


def reference(model_dir: Path, query: str, docs: list[str]) -> tuple[np.ndarray, int]:
    """Each pair's score computed in-process, and the pairs' tokens: mlx-embeddings' ModernBERT
    classifier as its README runs models; for BERT and XLM-RoBERTa (which mlx-embeddings has
    no head for) its encoder, and Hugging Face's head in numpy from the weight file."""
    from mlx_embeddings import load
    from mlx_embeddings.models import bert, xlm_roberta
    from transformers import AutoTokenizer
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pairs = tokenizer([query] * len(docs), docs, padding=True, return_tensors="np")
    ids, mask = mx.array(pairs["input_ids"]), mx.array(pairs["attention_mask"])
    tokens = int(pairs["attention_mask"].sum())
    if config["model_type"] == "modernbert":
        return np.array(load(str(model_dir))[0](ids, attention_mask=mask).pooler_output)[:, 0], \
            tokens
    weights = cast(dict[str, mx.array], mx.load(str(model_dir / "model.safetensors")))
    head = {k: np.array(v) for k, v in weights.items() if k.startswith("classifier.")}
    is_bert = config["model_type"] == "bert"
    module, prefix = (bert, "bert.") if is_bert else (xlm_roberta, "roberta.")
    encoder = module.Model(module.ModelArgs.from_dict({**config, "add_pooling_layer": is_bert}))
    encoder.load_weights([(k[len(prefix):], v) for k, v in weights.items()
                          if k.startswith(prefix)])
    encoder.eval()  # no dropout
    if is_bert:
        out = encoder(ids, attention_mask=mask,
                      token_type_ids=mx.array(pairs["token_type_ids"]))
        logit = np.array(out.pooler_output) @ head["classifier.weight"].T \
            + head["classifier.bias"]
    else:
        first = np.array(encoder(ids, attention_mask=mask).last_hidden_state)[:, 0]
        h = np.tanh(first @ head["classifier.dense.weight"].T + head["classifier.dense.bias"])
        logit = h @ head["classifier.out_proj.weight"].T + head["classifier.out_proj.bias"]
    return 1 / (1 + np.exp(-logit[:, 0])), tokens


@pytest.fixture(scope="module")
def daemon(rerankers):
    d = start_daemon(rerankers["modernbert"], "--model-pool", "5", isolate=True)
    yield d
    stop_and_check(d)


def rerank(d, body: dict, path: str = "/v1/rerank"):
    with d.http() as h:
        return h.post(path, json=body)


@pytest.mark.parametrize("family", FAMILIES)
def test_jina_shape_gets_the_in_process_scores_best_first(daemon, rerankers, family):
    want, tokens = reference(rerankers[family], QUERY, DOCS)
    assert np.ptp(want) > 1e-3  # the documents' scores differ: the order below means something
    model = MODEL if family == "modernbert" else str(rerankers[family])
    r = rerank(daemon, {"model": model, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = r.json()
    order = [x["index"] for x in got["results"]]
    assert sorted(order) == list(range(len(DOCS)))
    ref = [float(want[i]) for i in order]  # best first by the reference (ties within 1e-5)
    assert all(a >= b - 1e-5 for a, b in zip(ref, ref[1:], strict=False)), (order, want)
    scores = [x["relevance_score"] for x in got["results"]]
    assert scores == sorted(scores, reverse=True)
    for x in got["results"]:
        assert x["relevance_score"] == pytest.approx(float(want[x["index"]]), abs=1e-5)
        assert x["document"] == {"text": DOCS[x["index"]]}  # Jina's default: documents back
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert got["id"].startswith("rerank-")


def test_cohere_shape_top_n_without_documents_on_every_path(daemon, rerankers):
    want, _ = reference(rerankers["modernbert"], QUERY, DOCS)
    best = [int(i) for i in np.argsort(-want)[:2]]
    body = {"model": MODEL, "query": QUERY, "top_n": 2, "return_documents": False,
            "documents": [{"text": t, "title": "ignored"} for t in DOCS]}
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        got = rerank(daemon, body, path).json()
        top = [x["index"] for x in got["results"]]  # the best two (ties within 1e-5 either way)
        assert len(set(top)) == 2 and [float(want[i]) for i in top] == pytest.approx(
            [float(want[i]) for i in best], abs=1e-5), (path, top, want)
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
        # the embedding model resident (its capabilities known), the LM not loaded at all
        assert h.post("/v1/embeddings", json={"model": str(bert), "input": "x"}).status_code \
            == 200
        for model in (str(bert), str(tiny_model)):
            r = h.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCS})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_supported" and error["param"] == "model"
            assert "cannot rerank" in error["message"]
        # the embedding's input only (engines report their figures every so often)
        daemon.wait_until(lambda s: any(e["model"] == "tiny-bert"
                                        and e["cache"]["embed_inputs"] == 1
                                        for e in s["engines"]), what="the embedding counted")
        engines = {e["model"]: e for e in daemon.stats()["engines"]}
        assert engines["tiny-bert"]["cache"]["embed_requests"] == 1
        assert "tiny-llama" not in engines  # refused before loading: nothing evicted for it
        show = h.post("/api/show", json={"model": MODEL}).json()
        assert {"embedding", "rerank"} <= set(show["capabilities"])
