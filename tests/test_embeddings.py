"""Embeddings through a real daemon: `/v1/embeddings` (float and base64, `dimensions`),
Ollama's `/api/embed` and `/api/embeddings`, with the openai, ollama and langchain-openai
clients. A random-weight BERT (written by the test) is served by an embedding engine; its
vectors equal what mlx-embeddings computes in-process. A causal LM embeds too (mean-pooled
last hidden states), beside an embedding engine in the pool, and a killed embedding engine is
restarted like any other."""

from __future__ import annotations

import os
import signal

import httpx
import httpx2
import mlx.core as mx
import numpy as np
import ollama
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from conftest import start_daemon, stop_and_check
from support.random_bert import write_random_bert

MODEL = "tiny-bert"
TEXTS = ["Hello, how are you today?", "The capital of France is Paris.",
         "the quick brown fox jumps over the lazy dog " * 3, "42"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write_random_bert(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture(scope="module")
def reference(bert):
    """The model run in-process with mlx-embeddings, as its README shows."""
    from mlx_embeddings import load
    model, tokenizer = load(str(bert))

    def embed(texts: list[str]) -> tuple[np.ndarray, int]:
        inputs = tokenizer(texts, return_tensors="mlx", padding=True)
        out = model(inputs["input_ids"], attention_mask=inputs["attention_mask"])
        return np.array(out.text_embeds), int(inputs["attention_mask"].sum().item())
    return embed


@pytest.fixture(scope="module")
def daemon(bert):
    d = start_daemon(bert)
    yield d
    stop_and_check(d)


def client(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_gets_the_vectors_mlx_embeddings_computes(daemon, reference):
    want, tokens = reference(TEXTS)
    # The SDK asks for base64 unless told otherwise and decodes it with numpy.
    got = client(daemon).embeddings.create(model=MODEL, input=TEXTS)
    assert [e.index for e in got.data] == [0, 1, 2, 3] and got.model == MODEL
    np.testing.assert_allclose(np.array([e.embedding for e in got.data]), want, atol=1e-5)
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    floats = client(daemon).embeddings.create(model=MODEL, input=TEXTS[1],
                                              encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, want[1], atol=1e-5)
    with daemon.http() as h:
        raw = h.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2],
                                             "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["object"] == "list"
    decoded = np.frombuffer(__import__("base64").b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, want[0], atol=1e-5)


def test_64_inputs_in_one_forward_pass(daemon, reference):
    texts = [f"input {i}: " + "the quick brown fox " * (i % 5 + 1) for i in range(64)]
    got = client(daemon).embeddings.create(model=MODEL, input=texts)
    # No other request of this module has more than 4 inputs: a forward pass of 64 is this one.
    daemon.wait_until(lambda s: s["engines"][0]["cache"]["embed_peak_batch"] == 64,
                      what="a forward pass of 64 inputs")
    want, _ = reference(texts)
    np.testing.assert_allclose(np.array([e.embedding for e in got.data]), want, atol=1e-5)


def test_dimensions_keep_the_first_and_renormalize(daemon, reference):
    want, _ = reference(TEXTS[:1])
    got = client(daemon).embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16)
    short = np.array(got.data[0].embedding)
    assert short.shape == (16,)
    np.testing.assert_allclose(short, want[0][:16] / np.linalg.norm(want[0][:16]), atol=1e-5)
    for bad in (0, 65):
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client(daemon).embeddings.create(model=MODEL, input="x", dimensions=bad)


def test_ollama_client_embed_and_embeddings(daemon, reference):
    want, tokens = reference(TEXTS[:2])
    api = ollama.Client(host=daemon.url)
    got = api.embed(model=MODEL, input=TEXTS[:2])
    np.testing.assert_allclose(np.array(got.embeddings), want, atol=1e-5)
    assert got.model == MODEL and got.prompt_eval_count == tokens
    assert got.total_duration and got.total_duration > 0
    one = api.embeddings(model=MODEL, prompt=TEXTS[0])
    np.testing.assert_allclose(one.embedding, want[0], atol=1e-5)
    assert api.embed(model=MODEL, input=[]).embeddings == []  # loads the model
    # Ollama truncates an input longer than the model takes unless told not to.
    long = "fox " * 400
    assert len(api.embed(model=MODEL, input=long).embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError, match="128"):
        api.embed(model=MODEL, input=long, truncate=False)


def test_langchain_openai_embeddings(daemon, reference):
    want, _ = reference(TEXTS[:3])
    lc = OpenAIEmbeddings(model=MODEL, base_url=daemon.url + "/v1", api_key="unused",
                          check_embedding_ctx_length=False, max_retries=0)
    np.testing.assert_allclose(np.array(lc.embed_documents(TEXTS[:3])), want, atol=1e-5)
    np.testing.assert_allclose(lc.embed_query(TEXTS[0]), want[0], atol=1e-5)


@pytest.mark.parametrize("body, says", [
    ({"input": ""}, "empty"),
    ({"input": []}, "empty"),
    ({"input": ["a", ""]}, "input[1] is empty"),
    ({"input": ["a", [1, 2]]}, "a list of strings"),
    ({"input": ["x"] * 2049}, "at most 2048"),
    ({"input": "x", "encoding_format": "float16"}, "encoding_format"),
    ({"input": [[1, 2, 99999]]}, "vocabulary"),
    ({"input": "fox " * 400}, "context_length_exceeded"),
    ({"input": "x", "dimensions": -3}, "dimensions"),
])
def test_bad_input_is_a_400_in_openai_envelope(daemon, body, says):
    with daemon.http() as h:
        r = h.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in f"{error['message']} {error['code']} {error['param']}"


def test_an_embedding_model_does_not_generate(daemon):
    with daemon.http() as h:
        r = h.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
        r = h.post("/api/embed", json={"input": "x"})
        assert r.status_code == 400 and "model" in r.json()["error"]
        show = h.post("/api/show", json={"model": MODEL}).json()
        assert "embedding" in show["capabilities"]


def test_a_causal_lm_embeds_beside_an_embedding_engine_in_the_pool(tiny_model, bert,
                                                                   reference):
    d = start_daemon(tiny_model, "--model-pool", "2", isolate=True)
    try:
        api = client(d)
        got = api.embeddings.create(model="tiny-llama", input=TEXTS[:2], encoding_format="float")
        np.testing.assert_allclose(np.array([e.embedding for e in got.data]),
                                   _pooled_hidden_states(tiny_model, TEXTS[:2]), atol=1e-4)
        # The BERT loads on demand in an engine of its own kind, beside the LM.
        via_path = api.embeddings.create(model=str(bert), input=TEXTS[:1])
        np.testing.assert_allclose(via_path.data[0].embedding, reference(TEXTS[:1])[0][0],
                                   atol=1e-5)
        engines = {e["model"]: e for e in d.stats()["engines"]}
        assert set(engines) == {"tiny-llama", MODEL}
        # A killed embedding engine is restarted like any other, and serves again.
        os.kill(engines[MODEL]["pid"], signal.SIGKILL)
        d.wait_until(lambda s: any(e["model"] == MODEL and e["state"] == "ready"
                                   and e["epoch"] > engines[MODEL]["epoch"]
                                   for e in s["engines"]), timeout=60, what="a restart")
        again = api.embeddings.create(model=str(bert), input=TEXTS[:1])
        np.testing.assert_allclose(again.data[0].embedding, via_path.data[0].embedding,
                                   atol=1e-6)
        chat = api.chat.completions.create(model="tiny-llama", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        with d.unix_http() as c:  # the storage worker writes the chat's blocks
            assert c.post("/admin/cache/flush").json()["failed"] == 0
        _small_processes_never_load_numpy(d)
    finally:
        stop_and_check(d)


def _small_processes_never_load_numpy(d) -> None:
    """The proxy (which relayed vectors as floats and as base64, and scores), the storage
    worker (which wrote blocks) and the supervisor have not loaded numpy: 14 MB each, which
    none of them needs (issue 35's memory item)."""
    import psutil
    children = {c["role"]: c["pid"] for c in d.stats()["children"] if c["role"] != "engine"}
    pids = {"supervisor": d.proc.pid, **children}
    assert set(pids) == {"supervisor", "proxy", "storage"}, pids
    for role, pid in pids.items():
        try:
            maps = [m.path for m in psutil.Process(pid).memory_maps()]
        except (AttributeError, NotImplementedError):  # not on macOS
            pytest.skip("memory maps are not readable on this platform")
        assert maps and not [m for m in maps if "/numpy" in m], (role, pid)


def _pooled_hidden_states(model_dir, texts: list[str]) -> np.ndarray:
    """mlx-lm's model run in-process: the mean of each text's last hidden states, normalized."""
    import mlx_lm
    model, tokenizer = mlx_lm.load(str(model_dir))[:2]
    rows = []
    for text in texts:
        h = model.model(mx.array([tokenizer.encode(text)]))
        v = np.array(h[0].astype(mx.float32)).mean(axis=0)
        rows.append(v / np.linalg.norm(v))
    return np.array(rows)


def test_unix_socket_and_missing_model(daemon):
    with httpx.Client(base_url="http://x", transport=httpx.HTTPTransport(uds=daemon.socket),
                      timeout=30) as h:
        r = h.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("deaths", [1, 2])
def test_a_request_whose_engine_dies_is_sent_again_once(bert, reference, deaths):
    """The embedding engine dies at its first forward pass (of its first `deaths` lives): the
    request is sent again to the restarted engine once; a second death fails it."""
    d = start_daemon(bert, isolate=True, env={"MLXD_FAULTS": f"engine.embed=kill@1#<{deaths}"})
    try:
        with d.http() as h:
            r = h.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2],
                                               "encoding_format": "float"})
        if deaths == 1:
            assert r.status_code == 200, r.text
            np.testing.assert_allclose([e["embedding"] for e in r.json()["data"]],
                                       reference(TEXTS[:2])[0], atol=1e-5)
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_crashed"
    finally:
        stop_and_check(d)


def test_a_pass_longer_than_the_hang_timeout_is_not_a_hang(tmp_path):
    """An encoder's input attends both ways and cannot be cut: on slow hardware (here a wider
    BERT on this CPU, an input of ~460 tokens: 1.6 s) its pass outlasts `--hang-timeout`.
    Passes are bounded by time where they can be (each input here gets a pass of its own), and
    the engine states the pass's pace (its tokens at the rate seen, stretched for their
    length): the watchdog waits for it: no restart, the vectors of an in-process run. A request
    whose client leaves gets no further pass."""
    from mlx_embeddings import load
    from tokenizers import Tokenizer
    wide = write_random_bert(tmp_path / "wide-bert", hidden=256, layers=4, intermediate=1024,
                             max_length=512)
    texts = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 50 for i in range(3)]
    lengths = [len(e.ids) for e in Tokenizer.from_file(str(wide / "tokenizer.json"))
               .encode_batch(texts)]
    assert 400 < min(lengths) and max(lengths) <= 512, lengths
    d = start_daemon(wide, "--hang-timeout", "1", isolate=True)
    try:
        with d.http() as h:
            r = h.post("/v1/embeddings", json={"model": "wide-bert", "input": texts,
                                               "encoding_format": "float"}, timeout=300)
        assert r.status_code == 200, r.text
        d.wait_until(lambda s: s["engines"][0]["cache"]["embed_requests"] == 1,
                     what="the engine's status after the passes")
        engine = d.stats()["engines"][0]
        assert engine["restarts"] == 0 and engine["epoch"] == 0, engine
        assert engine["cache"]["longest_step_s"] > 1.0, engine["cache"]  # it did outlast it
        assert engine["cache"]["embed_steps"] == len(texts), engine["cache"]  # one pass each
        model, tokenizer = load(str(wide))
        inputs = tokenizer(texts, return_tensors="mlx", padding=True)
        want = np.array(model(inputs["input_ids"],
                              attention_mask=inputs["attention_mask"]).text_embeds)
        np.testing.assert_allclose([e["embedding"] for e in r.json()["data"]], want, atol=1e-4)
        # a client that gives up during the first of three passes: the other two never run
        seen = given_up(d, {"model": "wide-bert", "input": texts}, 0.5)
        assert seen["embed_steps"] < 2 * len(texts), seen
        with d.http(timeout=60) as h:  # the engine serves on
            r = h.post("/v1/embeddings", json={"model": "wide-bert", "input": "short",
                                               "encoding_format": "float"})
        assert r.status_code == 200, r.text
    finally:
        stop_and_check(d)


def test_a_hung_pass_between_generation_steps_is_caught(tiny_model):
    """A causal LM embeds between its generation steps; a pass that hangs there is a hang like
    a step that does (the engine is busy while it runs): the watchdog aborts the engine, the
    supervisor restarts it, and the request, sent again once, is answered."""
    d = start_daemon(tiny_model, "--hang-timeout", "2", isolate=True,
                     env={"MLXD_FAULTS": "engine.embed=hang@1#0"})
    try:
        with d.http() as h:
            r = h.post("/v1/embeddings", json={"model": "tiny-llama", "input": TEXTS[:2],
                                               "encoding_format": "float"}, timeout=120)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([e["embedding"] for e in r.json()["data"]],
                                   _pooled_hidden_states(tiny_model, TEXTS[:2]), atol=1e-4)
        assert "no progress for" in d.log() and d.stats()["engines"][0]["epoch"] == 1
    finally:
        stop_and_check(d)


def test_a_long_input_goes_in_chunks_between_decode_steps_and_an_abandoned_one_stops(
        tiny_model):
    """A causal LM embeds between its generation steps. Each pass lasting 300 ms here (a
    fault's delay: slow hardware), the time bound (a quarter of `--hang-timeout`) cuts a long
    input into chunks through a KV cache, one pass a turn of the engine's loop: a running
    stream (its steps 20 ms) gets a token between two passes, and the vector is that of one
    whole pass. A
    request whose client leaves is dropped before the next pass: no pass of it runs after."""
    import threading
    import time
    d = start_daemon(tiny_model, "--hang-timeout", "1", isolate=True,
                     env={"MLXD_FAULTS": "engine.embed=delay:300,engine.step=delay:20"})
    long_text = "the quick brown fox jumps over the lazy dog " * 20

    def cache() -> dict:
        return d.stats()["engines"][0]["cache"]
    try:
        with d.http() as h:  # a short input's pass: the rate the next passes are sized by
            assert h.post("/v1/embeddings", json={"model": "tiny-llama",
                                                  "input": "hello"}).status_code == 200
            assert h.post("/v1/embeddings", json={
                "model": "tiny-llama", "input": "hello",
                "encoding_format": "float"}).status_code == 200
        arrivals: list[float] = []

        def stream() -> None:
            with d.http() as c, c.stream("POST", "/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
        runner = threading.Thread(target=stream)
        runner.start()
        d.wait_until(lambda s: s["engines"][0]["active_requests"] == 1, what="the stream")
        steps_before = cache()["embed_steps"]
        t0 = time.monotonic()
        with d.http() as h:
            r = h.post("/v1/embeddings", json={"model": "tiny-llama", "input": long_text,
                                               "encoding_format": "float"})
        t1 = time.monotonic()
        runner.join()
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                                   _pooled_hidden_states(tiny_model, [long_text])[0], atol=1e-4)
        d.wait_until(lambda s: s["engines"][0]["cache"]["embed_requests"] == 3,
                     what="the engine's status after the long input")
        passes = cache()["embed_steps"] - steps_before
        during = sum(t0 < t < t1 for t in arrivals)
        assert passes >= 5, passes  # ~180 tokens, at 300 ms a pass chunks of ~16 tokens
        assert during >= passes - 2, (during, passes)  # a token between passes

        seen = given_up(d, {"model": "tiny-llama", "input": long_text}, 0.6)
        steps_at_drop, answered = seen["embed_steps"], seen["embed_requests"]
        assert steps_at_drop - steps_before - passes < passes, seen  # stopped part-way
        with d.http() as h:
            assert h.post("/v1/embeddings", json={"model": "tiny-llama",
                                                  "input": "hello"}).status_code == 200
        d.wait_until(lambda s: s["engines"][0]["cache"]["embed_requests"] == answered + 1,
                     what="the short request's status")
        assert cache()["embed_steps"] == steps_at_drop + 1  # its own pass, none of the other's
        assert d.stats()["engines"][0]["epoch"] == 0
    finally:
        stop_and_check(d)


def given_up(d, body: dict, timeout: float) -> dict:
    """A client gives up on `body` after `timeout`; the engine's figures once it has dropped
    the request (a snapshot: the passes run for it are all counted there)."""
    with pytest.raises(httpx2.TimeoutException), d.http(timeout=timeout) as h:
        h.post("/v1/embeddings", json=body)
    seen: dict = {}

    def dropped(s: dict) -> bool:
        seen.update(s["engines"][0]["cache"])
        return seen["embed_abandoned"] == 1
    d.wait_until(dropped, what="the abandoned request dropped")
    return seen
