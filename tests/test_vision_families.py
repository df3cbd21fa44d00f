"""Vision families beyond LLaVA, through a real daemon (--isolate), each a random-weight model
directory the test writes: Gemma 3 (a SigLIP tower, pooled to a few soft tokens wrapped in
`<start_of_image>`/`<end_of_image>` by its processor, a language model of sliding-window and
global layers). Each dialect's greedy answer equals mlx-vlm's own generation for the same
image and prompt (mlx-vlm's processor and `stream_generate`); the same image in the next turn
is a cache hit covering it and a changed pixel a miss; bad images are 400s that leave the
engine serving; a kill -9 of the engine mid-stream resumes with identical text.

The prompts are longer than the sliding window (16 tokens): the window's layers are mlx-lm's
rotating caches, whose snapshots the prefix cache restores."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import start_daemon, stop_and_check
from support.harness import engine_pid, stream_chat
from support.random_vlm import GEMMA_IMAGE, write_random_gemma3
from test_vision import b64, picture, png, png_bomb

MODEL = "tiny-gemma3"
QUESTION = "What is in this picture?"
TOKENS = 12
IMAGE_TOKENS = 16  # soft tokens per image: the tower's 4 x 4 patches, unpooled
SLOW = {"MLXD_FAULTS": "engine.step=delay@1#<2"}  # time to aim a kill mid-stream

IMAGE = picture()
IMAGE_B64 = b64(png(IMAGE))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return write_random_gemma3(tmp_path_factory.mktemp("models") / MODEL, image_size=56,
                               image_tokens=IMAGE_TOKENS, sliding_window=16)


@pytest.fixture(scope="module")
def reference(gemma3):
    """mlx-vlm's own load, processor and greedy `stream_generate` on the prompt the chat
    template makes of the user turns [image, question] (+ history)."""
    from mlx_vlm import load, stream_generate
    from PIL import Image
    model, loaded = load(str(gemma3))
    processor: Any = loaded
    tok = processor.tokenizer
    eos = tok.convert_tokens_to_ids("<end_of_turn>")

    def generate(pixels: np.ndarray, max_tokens: int = TOKENS,
                 history: list | None = None) -> tuple[str, list[int]]:
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": QUESTION}]},
                    *(history or [])]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = [r.token for r in stream_generate(model, processor, prompt,
                                                image=[Image.fromarray(pixels)],
                                                max_tokens=max_tokens, temperature=0.0)]
        out = out[:max_tokens]
        if eos in out:
            out = out[:out.index(eos)]
        ids = processor(images=[Image.fromarray(pixels)], text=[prompt])["input_ids"]
        return tok.decode(out), np.array(ids)[0].tolist()
    return generate


@pytest.fixture(scope="module")
def daemon(gemma3):
    d = start_daemon(gemma3, "--restart-backoff", "0.1", isolate=True, env=SLOW)
    yield d
    stop_and_check(d)


def openai_body(image_b64: str = IMAGE_B64, history: list | None = None, **kw) -> dict:
    turn = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image_b64}},
        {"type": "text", "text": QUESTION}]}
    return {"model": MODEL, "messages": [turn, *(history or [])], "max_tokens": TOKENS,
            "temperature": 0, **kw}


def chat(d, body: dict) -> tuple[int, dict]:
    with d.http() as c:
        r = c.post("/v1/chat/completions", json=body)
        return r.status_code, r.json()


def test_gemma3_each_dialect_gives_the_text_mlx_vlm_generates(daemon, reference, gemma3):
    want, ids = reference(IMAGE)
    from tokenizers import Tokenizer
    image_id = Tokenizer.from_file(str(gemma3 / "tokenizer.json")).token_to_id(GEMMA_IMAGE)
    assert ids.count(image_id) == IMAGE_TOKENS and len(ids) > 32  # twice the window
    code, got = chat(daemon, openai_body())
    assert code == 200, got
    assert got["choices"][0]["message"]["content"] == want
    assert got["usage"]["prompt_tokens"] == len(ids)  # the processor's expansion, exactly
    with daemon.http() as c:
        r = c.post("/v1/messages", json={
            "model": MODEL, "max_tokens": TOKENS, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": IMAGE_B64}},
                    {"type": "text", "text": QUESTION}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == want
        r = c.post("/api/chat", json={
            "model": MODEL, "stream": False, "options": {"temperature": 0,
                                                         "num_predict": TOKENS},
            "messages": [{"role": "user", "content": QUESTION, "images": [IMAGE_B64]}]})
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"] == want
        r = c.post("/api/show", json={"model": MODEL})
        assert "vision" in r.json()["capabilities"], r.text
    other, _ = reference(picture(1))
    assert other != want  # the image matters to the answer
    code, got = chat(daemon, openai_body(b64(png(picture(1)))))
    assert code == 200 and got["choices"][0]["message"]["content"] == other, got
    # A text-only request to the vision model is served as a text model's.
    code, got = chat(daemon, {"model": MODEL, "max_tokens": 4, "temperature": 0,
                              "messages": [{"role": "user", "content": QUESTION}]})
    assert code == 200 and got["usage"]["completion_tokens"] == 4, got


def test_gemma3_the_same_image_next_turn_is_a_cache_hit_and_a_changed_pixel_a_miss(
        daemon, reference, gemma3):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(gemma3 / "tokenizer.json"))
    code, first = chat(daemon, openai_body())
    assert code == 200, first
    answer = first["choices"][0]["message"]["content"]
    history = [{"role": "assistant", "content": answer},
               {"role": "user", "content": "And what colour is it?"}]
    code, second = chat(daemon, openai_body(history=history))
    assert code == 200, second
    want, ids = reference(IMAGE, history=history)
    assert second["choices"][0]["message"]["content"] == want  # restored state answers alike
    end_of_image = len(ids) - ids[::-1].index(tok.token_to_id(GEMMA_IMAGE))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= end_of_image, second
    before_image = ids.index(tok.token_to_id(GEMMA_IMAGE))
    changed = IMAGE.copy()
    changed[10, 20, 1] ^= 1  # one pixel, one channel, one bit
    code, third = chat(daemon, openai_body(b64(png(changed)), history=history))
    assert code == 200, third
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] <= before_image, third


def test_gemma3_bad_images_are_400s_and_the_engine_keeps_serving(daemon):
    pid = engine_pid(daemon)
    cases = {
        "invalid_image/bad base64": openai_body("not base64 at all!!"),
        "invalid_image/not an image": openai_body(b64(b"GIF89a but then nothing of the sort")),
        "image_too_large/png bomb": openai_body(b64(png_bomb())),
    }
    for name, body in cases.items():
        code, got = chat(daemon, body)
        assert code == 400, (name, got)
        assert got["error"]["code"] == name.split("/")[0], got
    # A literal image marker in the text makes more markers than images: a 400 from the engine.
    body = openai_body()
    body["messages"][0]["content"][1]["text"] = "<start_of_image>" + QUESTION
    code, got = chat(daemon, body)
    assert code == 400 and "image markers" in got["error"]["message"], got
    code, got = chat(daemon, openai_body())
    assert code == 200, got
    assert engine_pid(daemon) == pid  # the same engine process served throughout


def test_gemma3_kill_9_mid_stream_resumes_with_identical_text(daemon):
    body = openai_body(b64(png(picture(2))), max_tokens=24)
    want, _ = stream_chat(daemon, body)
    pid = engine_pid(daemon)
    text, usage = stream_chat(daemon, body, kill_after=6)
    assert text == want
    assert usage.get("resumes") == 1 and engine_pid(daemon) != pid, usage


def test_gemma3_loads_with_its_image_text_and_sliding_window_caches(gemma3):
    """What the engine makes of the directory: the processor's image text (soft tokens wrapped
    in newlines and markers), and mlx-lm's rotating caches for the sliding-window layers (so
    that a row's memory is bounded by the window, and the caches' tiers snapshot them)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from mlxd.engine.kinds.vision.model import load_vision
    model, _, _, parts = load_vision(gemma3, "float32")
    assert parts.image_token == "<start_of_image>" and parts.tokens_per_image == IMAGE_TOKENS
    assert parts.layout is not None and parts.layout(640, 480) == (
        "\n\n<start_of_image>" + GEMMA_IMAGE * IMAGE_TOKENS + "<end_of_image>\n\n",
        IMAGE_TOKENS)
    caches = make_prompt_cache(model)
    assert [type(c) for c in caches] == [RotatingKVCache, KVCache]
    assert caches[0].max_size == 16
