"""The Anthropic Messages API and Ollama's API through a real daemon (in-process and
--isolate), with the official `anthropic` and `ollama` clients, and each dialect's own error
envelope for bad input."""

from __future__ import annotations

import hashlib
import json
import time

import anthropic
import ollama
import openai
import pytest
from anthropic.types import MessageParam

from mlxd.proxy.dialects.ollama.weights import Digests, human_number
from mlxd.proxy.dialects.ollama.weights import details as ollama_details
from support.harness import Daemon
from support.sdk import prompt_tokens, reasoning_of, text_of, thinking_of

MODEL = "tiny-llama"
QUESTION = "What is the capital of France?"
HI: list[MessageParam] = [{"role": "user", "content": QUESTION}]


def claude(d: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0)


def olla(d: Daemon) -> ollama.Client:
    return ollama.Client(host=d.url)


# ---------------------------------------------------------------- Anthropic

def test_messages_non_streaming(daemon):
    m = claude(daemon).messages.create(model=MODEL, max_tokens=12, messages=HI,
                                       system="Answer briefly.")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and text_of(m.content[0])
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 12
    assert prompt_tokens(m.usage) > 5


def _sse_events(d: Daemon, body: dict) -> list[tuple[str, dict]]:
    with d.http() as c, c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events: list[tuple[str, dict]] = []
        name = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert name, f"data before any event name: {line}"
                events.append((name, json.loads(line[6:])))
    return events


def test_messages_streaming_event_sequence_and_text(daemon):
    events = _sse_events(daemon, {"model": MODEL, "max_tokens": 16, "messages": HI,
                                  "stream": True})
    names = [n for n, _ in events if n != "ping"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(n == e["type"] for n, e in events)  # event name and type agree
    assert "ping" in [n for n, _ in events]
    start = events[0][1]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["usage"]
    deltas = [e["delta"] for n, e in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    final = next(e for n, e in events if n == "message_delta")
    assert final["delta"]["stop_reason"] == "max_tokens"
    assert final["usage"]["output_tokens"] == 16
    # greedy: the same text either way
    whole = claude(daemon).messages.create(model=MODEL, max_tokens=16, messages=HI)
    assert "".join(d["text"] for d in deltas) == text_of(whole.content[0])
    # and through the official client's stream helper
    with claude(daemon).messages.stream(model=MODEL, max_tokens=16, messages=HI) as s:
        text = "".join(s.text_stream)
        assert s.get_final_message().usage.output_tokens == 16
    assert text == text_of(whole.content[0])


def test_messages_system_blocks_and_cache_read(daemon):
    c = claude(daemon)
    as_blocks = c.messages.count_tokens(
        model=MODEL, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                               {"type": "text", "text": "there"}]}])
    as_strings = c.messages.count_tokens(model=MODEL, system="Be kind.",
                                         messages=[{"role": "user", "content": "Hello there"}])
    no_system = c.messages.count_tokens(model=MODEL,
                                        messages=[{"role": "user", "content": "Hello there"}])
    assert as_blocks.input_tokens == as_strings.input_tokens > no_system.input_tokens
    long: list[MessageParam] = [
        {"role": "user", "content": "Tell me about lighthouses and the sea. " * 3}]
    first = c.messages.create(model=MODEL, max_tokens=4, messages=long)
    again = c.messages.create(model=MODEL, max_tokens=4, messages=long)
    total = c.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert prompt_tokens(first.usage) == total
    assert prompt_tokens(again.usage) == total
    assert again.usage.cache_read_input_tokens  # the prefix came from the KV cache


def test_messages_stop_sequences(daemon):
    c = claude(daemon)
    text = text_of(c.messages.create(model=MODEL, max_tokens=24, messages=HI).content[0])
    stop = next(ch for ch in text[1:] if ch.isalnum())
    m = c.messages.create(model=MODEL, max_tokens=24, messages=HI, stop_sequences=[stop, "@@@@"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m.content[0]) == text[:text.index(stop)]


@pytest.mark.parametrize("body, status, fragment", [
    ({"messages": HI, "max_tokens": 5}, 400, "model"),
    ({"model": MODEL, "messages": HI}, 400, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5}, 400, "messages"),
    ({"model": MODEL, "max_tokens": "five", "messages": HI}, 400, "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": HI}, 400, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": []}, 400, "messages"),
    ({"model": MODEL, "max_tokens": 5, "temperature": 1.5, "messages": HI}, 400, "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "role"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]}, 400, "image"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "42"}]}]}, 400,
     "tool_result"),
    ({"model": MODEL, "max_tokens": 5, "messages": HI,
      "tools": [{"name": "f", "input_schema": {"type": "objectx"}}]}, 400, "tools"),
    ({"model": MODEL, "max_tokens": 5, "messages": HI, "tool_choice": {"type": "tool",
                                                                       "name": "nope"},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "tool_choice"),
    ({"model": "no-such-model", "max_tokens": 5, "messages": HI}, 404, "no-such-model"),
])
def test_messages_bad_input_gets_anthropic_errors(daemon, body, status, fragment):
    with daemon.http() as c:
        r = c.post("/v1/messages", json=body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and fragment in err["error"]["message"]
        assert err["error"]["type"] == {400: "invalid_request_error",
                                        404: "not_found_error"}[status]
        bad_json = c.post("/v1/messages", content=b"{not json",
                          headers={"Content-Type": "application/json"})
        assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"
    assert claude(daemon).messages.create(model=MODEL, max_tokens=2, messages=HI).content


@pytest.mark.parametrize("body, message", [
    ({"model": MODEL, "max_tokens": 0, "messages": HI},
     "max_tokens: Input should be greater than or equal to 1"),
    ({"model": MODEL, "max_tokens": "many", "messages": HI},
     "max_tokens: Input should be a valid integer"),
    ({"model": MODEL, "messages": HI}, "max_tokens: Field required"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"content": "x"}]},
     "messages.0.role: Field required"),
])
def test_anthropic_validation_errors_in_anthropics_words(daemon, body, message):
    """Anthropic's API words a field error as pydantic does (`loc: message`); so does mlxd,
    never the validator's own text."""
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(daemon).post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": message}}


def test_anthropic_model_list_shape(daemon, tiny_model):
    """`GET /v1/models` from an Anthropic client (it sends `anthropic-version`) is Anthropic's
    list; without the header it stays OpenAI's."""
    c = claude(daemon)
    page = c.models.list()
    assert [m.id for m in page.data] == [MODEL] and page.has_more is False
    assert page.first_id == page.last_id == MODEL
    m = page.data[0]
    assert m.type == "model" and m.display_name == MODEL and m.created_at.year >= 2024
    assert c.models.retrieve(MODEL).id == MODEL
    assert c.models.retrieve(str(tiny_model)).id == MODEL  # any name it answers to
    with pytest.raises(anthropic.NotFoundError) as e:
        c.models.retrieve("no-such-model")
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "error"
    with daemon.http() as h:
        raw = h.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
        assert set(raw) == {"data", "has_more", "first_id", "last_id"}
        assert set(raw["data"][0]) == {"type", "id", "display_name", "created_at"}
        assert h.get("/v1/models", params={"after_id": MODEL},
                     headers={"anthropic-version": "2023-06-01"}).json()["data"] == []
        assert h.get("/v1/models").json()["object"] == "list"


@pytest.mark.parametrize("words", [400, 60_000])
def test_an_over_long_prompt_gets_anthropics_prompt_is_too_long(daemon, words):
    """Claude Code compacts its context on Anthropic's own words for it; mlxd says them, with
    the numbers: counted by the engine (400 words), or bounded by the proxy from the length
    in characters before any tokenizing (60,000 words)."""
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(daemon).messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "lighthouse " * words}])
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" > 256 maximum")
    assert int(message.split(": ")[1].split(" ")[0]) > 256


# ---------------------------------------------------------------- Ollama

def test_ollama_chat_streaming_equals_non_streaming(daemon):
    c = olla(daemon)
    whole = c.chat(model=MODEL, messages=HI, options={"num_predict": 10}, stream=False)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 10
    assert whole.prompt_eval_count is not None and whole.prompt_eval_count > 5
    assert whole.message.role == "assistant"
    parts = list(c.chat(model=MODEL + ":latest", messages=HI, options={"num_predict": 10},
                        stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == 10 and parts[-1].done_reason == "length"
    assert all(p.message.content is not None for p in parts)
    assert "".join(p.message.content or "" for p in parts) == whole.message.content


def test_ollama_generate_options_and_raw(daemon):
    c = olla(daemon)
    a = c.generate(model=MODEL, prompt="Once upon a time", options={
        "num_predict": 12, "temperature": 0.8, "seed": 7})
    b = c.generate(model=MODEL, prompt="Once upon a time", options={
        "num_predict": 12, "temperature": 0.8, "seed": 7})
    assert a.response == b.response and a.eval_count == 12  # seeded sampling repeats
    text = c.generate(model=MODEL, prompt="Once upon a time", options={"num_predict": 24}).response
    assert text is not None
    stop = next(ch for ch in text[1:] if ch.isalnum())
    cut = c.generate(model=MODEL, prompt="Once upon a time",
                     options={"num_predict": 24, "stop": [stop]})
    assert cut.response == text[:text.index(stop)] and cut.done_reason == "stop"
    raw = c.generate(model=MODEL, prompt="Once upon a time", raw=True, options={"num_predict": 3})
    assert raw.done and raw.eval_count == 3
    assert raw.prompt_eval_count is not None and a.prompt_eval_count is not None
    assert raw.prompt_eval_count < a.prompt_eval_count  # no chat template around it
    loaded = c.generate(model=MODEL, prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_ollama_tags_show_ps_version(daemon, tiny_model):
    c = olla(daemon)
    names = [m.model for m in c.list().models]
    assert names == [MODEL]
    listed = c.list().models[0]
    assert listed.size is not None and listed.size > 0
    assert listed.details is not None and listed.details.family == "llama"
    shown = c.show(MODEL)
    assert shown.template is not None and "im_start" in shown.template
    assert shown.details is not None and shown.details.format == "mlx"
    assert shown.modelinfo is not None and shown.modelinfo["general.context_length"] == 256
    assert [m.model for m in c.ps().models] == [MODEL]
    with daemon.http() as h:
        assert h.get("/api/version").json()["version"]
        assert h.get("/").status_code == 200


def test_ollama_pull_of_a_present_model_succeeds_at_once(daemon):
    c = olla(daemon)
    assert c.pull(MODEL).status == "success"
    streamed = [p.status for p in c.pull(MODEL + ":latest", stream=True)]
    assert streamed[0] == "pulling manifest" and streamed[-1] == "success"
    with daemon.http() as h:
        assert h.post("/api/pull", json={"name": MODEL, "stream": False}).json() == \
            {"status": "success"}


def test_ollama_pull_of_an_unfetchable_model_says_why(daemon):
    """Not cached and the Hub unreachable (as here): a 404 in Ollama's words before any
    progress line, streamed or not."""
    c = olla(daemon)
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as e:
            got = c.pull("nobody/no-such-repo-xyz", stream=stream)
            list(got) if stream else got
        assert e.value.status_code == 404, e.value
        assert e.value.error.startswith("pull model manifest: nobody/no-such-repo-xyz: ")
        if "--isolate" in daemon.argv:  # a pool fetches on demand: the Hub was asked
            assert "could not be reached" in e.value.error or "OFFLINE" in e.value.error
        else:
            assert "does not exist" in e.value.error


def test_ollama_pull_fetches_with_progress_then_the_model_serves(tiny_model, tmp_path):
    """A repo id not in the cache is fetched from the Hub (a local stand-in here), file by
    file with Ollama's progress lines; then it is present (pulled again: success at once)
    and serves."""
    from conftest import start_daemon, stop_and_check
    from support.fake_hub import FakeHub
    repo = "someone/tiny-pulled"
    with FakeHub({repo: tiny_model}) as hub:
        d = start_daemon(tiny_model, isolate=True, env={
            "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_TELEMETRY": "1"})
        try:
            c = olla(d)
            lines = list(c.pull(repo, stream=True))
            sizes = {p.name: p.stat().st_size for p in tiny_model.iterdir() if p.is_file()}
            assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
            done = {p.status.removeprefix("pulling "): p.total for p in lines
                    if p.status and p.status.startswith("pulling ") and p.total is not None
                    and p.completed == p.total}
            assert done == sizes  # every file the load needs, whole
            assert f"GET /{repo}/resolve/main/model.safetensors" in hub.requests
            asked = len(hub.requests)
            assert c.pull(repo, stream=False).status == "success"
            assert len(hub.requests) == asked  # present now: nothing fetched, nothing asked
            r = c.chat(model=repo, messages=HI, options={"num_predict": 3}, stream=False)
            assert r.eval_count == 3 and r.load_duration and r.load_duration > 0
        finally:
            stop_and_check(d)


def _close(measured_ns: int, wall_s: float, what: str) -> None:
    """Within 10 %, or 100 ms for short spans: on a quiet machine the figures match the
    client's to a few ms, but with the other test worker busy the client's own reading of the
    first line lags (seen twice in full runs: 40 and 50 ms off spans of 0.28 and 0.42 s)."""
    assert abs(measured_ns / 1e9 - wall_s) <= max(0.1 * wall_s, 0.1), \
        (what, measured_ns / 1e9, wall_s)


def test_ollama_durations_agree_with_wall_times(daemon):
    """Ollama's durations are measured: `total_duration` is the request's wall time and
    `eval_duration` the time from the first token's line to the last one's (within 10 %);
    the parts add up to the whole; the counts are the tokens seen."""
    body = {"model": MODEL, "prompt": QUESTION, "options": {"num_predict": 120}}
    with daemon.http() as h:
        h.post("/api/generate", json={**body, "stream": False})  # warm: no first-call costs
        began = time.perf_counter()
        with h.stream("POST", "/api/generate", json=body) as r:
            lines = []
            for line in r.iter_lines():
                lines.append((time.perf_counter(), json.loads(line)))
        wall = time.perf_counter() - began
        began = time.perf_counter()
        chat = h.post("/api/chat", json={**body, "messages": HI, "stream": False}).json()
        chat_wall = time.perf_counter() - began
    final = lines[-1][1]
    tokens = [t for t, obj in lines if obj.get("response")]
    assert final["done"] and final["eval_count"] == 120 == chat["eval_count"]
    assert final["prompt_eval_count"] > 5 and final["load_duration"] == 0  # was loaded
    _close(final["total_duration"], wall, "total_duration")
    _close(final["eval_duration"], tokens[-1] - tokens[0], "eval_duration")
    _close(chat["total_duration"], chat_wall, "chat total_duration")
    for f in (final, chat):
        parts = f["load_duration"] + f["prompt_eval_duration"] + f["eval_duration"]
        assert 0 < f["prompt_eval_duration"] and 0.9 * f["total_duration"] <= parts \
            <= f["total_duration"], f


def test_ollama_load_duration_is_the_load_waited_for(daemon):
    if "--isolate" not in daemon.argv:
        pytest.skip("models are unloaded and loaded on demand only with --isolate")
    with daemon.http() as h:
        unloaded = h.post("/api/generate", json={"model": MODEL, "keep_alive": 0}).json()
        assert unloaded["done_reason"] == "unload"
        daemon.wait_until(lambda s: not s["pool"]["resident"], what="unloaded")
        began = time.perf_counter()
        r = h.post("/api/chat", json={"model": MODEL, "messages": HI, "stream": False,
                                      "options": {"num_predict": 4}}).json()
        wall = time.perf_counter() - began
    _close(r["total_duration"], wall, "total_duration")
    assert r["load_duration"] > 0.5 * r["total_duration"], r  # the load is most of it
    assert r["load_duration"] + r["prompt_eval_duration"] + r["eval_duration"] \
        <= r["total_duration"]


def test_ollama_digest_and_details_come_from_the_weights(daemon, tiny_model):
    import mlx.core as mx
    weights = sorted(tiny_model.glob("*.safetensors"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in weights)).hexdigest()
    params = 0
    for p in weights:
        arrays = mx.load(str(p))
        assert isinstance(arrays, dict)
        params += sum(a.size for a in arrays.values())
    with daemon.http() as h:
        listed = h.get("/api/tags").json()["models"][0]
        shown = h.post("/api/show", json={"model": MODEL}).json()
    assert listed["digest"] == digest == shown["digest"]
    for d in (listed["details"], shown["details"]):
        assert d["parameter_size"] == human_number(params) and d["parameter_size"][-1] in "KM"
        assert d["quantization_level"] == "F32" and d["family"] == "llama"
        assert d["format"] == "mlx"


async def test_same_name_other_bytes_other_digest(tmp_path):
    """A digest is of the bytes: two weight files of one name differ, and a file rewritten in
    place (same path, new size or mtime) is hashed again."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d, payload in ((a, b"first"), (b, b"second")):
        d.mkdir()
        (d / "model.safetensors").write_bytes(payload * 1000)
    digests = Digests()
    da, db = await digests.of(str(a)), await digests.of(str(b))
    assert da == hashlib.sha256(b"first" * 1000).hexdigest() and da != db
    assert await digests.of(str(a)) == da  # cached
    (a / "model.safetensors").write_bytes(b"third" * 2000)
    assert await digests.of(str(a)) == hashlib.sha256(b"third" * 2000).hexdigest()
    assert await digests.of(str(tmp_path / "none")) == ""
    (b / "model.safetensors").write_bytes(b"fourth" * 4_000_000)  # 24 MB: a while to hash
    assert await digests.of(str(b), wait=0) == ""  # listed at once, without its digest
    assert await digests.of(str(b)) == hashlib.sha256(b"fourth" * 4_000_000).hexdigest()


def test_parameter_size_unpacks_quantized_layers_at_their_own_bits(tmp_path):
    """A 4-bit model with an 8-bit embedding (as mlx-lm quantizes them): packed words count
    32 / bits parameters each, scales and biases none."""
    import mlx.core as mx
    words = {"lin.weight": mx.zeros((128, 64 * 4 // 32), dtype=mx.uint32),
             "lin.scales": mx.zeros((128, 2), dtype=mx.float16),
             "lin.biases": mx.zeros((128, 2), dtype=mx.float16),
             "emb.weight": mx.zeros((1000, 64 * 8 // 32), dtype=mx.uint32),
             "emb.scales": mx.zeros((1000, 2), dtype=mx.float16),
             "emb.biases": mx.zeros((1000, 2), dtype=mx.float16),
             "norm.weight": mx.zeros((64,), dtype=mx.float16)}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), words)
    cfg = {"model_type": "llama", "quantization": {"bits": 4, "group_size": 32,
                                                   "emb": {"bits": 8, "group_size": 32}}}
    d = ollama_details(str(tmp_path), cfg)
    assert d["parameter_size"] == human_number(128 * 64 + 1000 * 64 + 64) == "72K"
    assert d["quantization_level"] == "Q4" and d["family"] == "llama"


def test_human_number_is_ollamas():
    assert [human_number(n) for n in (8_000_000_000, 1_235_814_400, 134_515_008, 2_000_000,
                                      4_096, 12)] == ["8B", "1.2B", "134.52M", "2M", "4K", "12"]


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/api/chat", {"messages": HI}, 400, "model"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"temperature": "hot"}}, 400,
     "temperature"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"num_predict": 0}}, 400,
     "num_predict"),
    ("/api/chat", {"model": MODEL, "messages": HI, "format": 5}, 400, "format"),
    ("/api/chat", {"model": MODEL, "messages": HI, "format": {"type": "objectx"}}, 400,
     "format"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "role"),
    ("/api/chat", {"model": "no-such-model", "messages": HI}, 404, "no-such-model"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "images": ["AA=="]}, 400, "images"),
    ("/api/generate", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/api/show", {}, 400, "model"),
    ("/api/chat", {"model": MODEL, "messages": HI, "options": {"top_k": -1}}, 400,
     "invalid options.top_k: must be greater than or equal to 0"),
])
def test_ollama_bad_input_gets_ollama_errors(daemon, path, body, status, fragment):
    with daemon.http() as c:
        r = c.post(path, json=body)
        assert r.status_code == status, r.text
        assert set(r.json()) == {"error"} and fragment in r.json()["error"]
    assert olla(daemon).generate(model=MODEL, prompt="hi", options={"num_predict": 2}).done


THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'].split('</think>')[-1] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A model whose template opens a <think> block: its random output is all thinking."""
    from conftest import start_daemon, stop_and_check
    from support.random_model import write_random_model
    model = write_random_model(tmp_path_factory.mktemp("models") / "thinker", context=256,
                               chat_template=THINKING_TEMPLATE)
    d = start_daemon(model)
    yield d
    stop_and_check(d)


def test_reasoning_goes_apart_from_the_answer(thinker):
    o = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)
    r = o.chat.completions.create(model="thinker", max_tokens=12,
                                  messages=[{"role": "user", "content": QUESTION}])
    msg = r.choices[0].message
    reasoning = reasoning_of(msg)
    assert reasoning and msg.content == ""  # never closed </think>: all thinking
    streamed = "".join(reasoning_of(c.choices[0].delta) or ""
                       for c in o.chat.completions.create(
                           model="thinker", max_tokens=12, stream=True,
                           messages=[{"role": "user", "content": QUESTION}])
                       if c.choices)
    assert streamed == reasoning
    m = claude(thinker).messages.create(model="thinker", max_tokens=12, messages=HI)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert thinking_of(m.content[0]) == reasoning
    with claude(thinker).messages.stream(model="thinker", max_tokens=12, messages=HI) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert thinking_of(final.content[0]) == reasoning
    chat = olla(thinker).chat(model="thinker", messages=HI, options={"num_predict": 12})
    assert chat.message.thinking == reasoning and chat.message.content == ""
