"""The vision tower runs beside the decode steps, never inside one: with the tower made slow (a
fault point holds each image's encoding for seconds), a text row that is decoding keeps its
pace while an image's request is admitted, and the image's answer still comes. Were the tower
inside a step (as it was), the text row would wait the whole encoding between two tokens."""

from __future__ import annotations

import threading
import time

import pytest
from tokenizers import Tokenizer

from conftest import start_daemon, stop_and_check
from support.harness import stream_chat
from support.random_vlm import write_random_vlm
from test_vision import IMAGE_B64, MODEL, openai_body

TOWER_MS = 2500
TEXT_TOKENS = 120  # at 50 ms a step (the step fault), six seconds of decoding


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return write_random_vlm(tmp_path_factory.mktemp("models") / MODEL)


@pytest.fixture(scope="module")
def daemon(vlm):
    d = start_daemon(vlm, isolate=True, env={
        "MLXD_FAULTS": f"engine.vision.encode=delay:{TOWER_MS},engine.step=delay"})
    yield d
    stop_and_check(d)


def test_a_decoding_row_keeps_its_pace_while_an_image_is_encoded(daemon, vlm):
    word = Tokenizer.from_file(str(vlm / "tokenizer.json")).encode("hello").ids[0]
    text_body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                 "max_tokens": TEXT_TOKENS, "temperature": 0,
                 "logit_bias": {str(word): 100}}  # every step writes a token of text
    arrivals: list[float] = []
    decoding = threading.Event()

    def on_chunk(n: int) -> None:
        arrivals.append(time.monotonic())
        if n == 5:
            decoding.set()

    result: dict = {}

    def text_row() -> None:
        result["text"] = stream_chat(daemon, text_body, on_chunk=on_chunk)

    t = threading.Thread(target=text_row)
    t.start()
    try:
        assert decoding.wait(60), "the text row did not start decoding"
        sent = time.monotonic()
        with daemon.http() as c:
            r = c.post("/v1/chat/completions", json=openai_body(IMAGE_B64, max_tokens=4))
        answered = time.monotonic()
    finally:
        t.join(120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    # the slowed tower did run for this request (its time is inside the image's answer) ...
    assert answered - sent >= TOWER_MS / 1000
    _, usage = result["text"]
    assert usage["completion_tokens"] == TEXT_TOKENS
    during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)
              if b > sent and a < answered]
    assert arrivals[-1] > answered, "the text row ended before the image was answered"
    # ... and the text row went on decoding meanwhile: no gap came near the tower's time
    assert len(during) >= 10 and max(during) < TOWER_MS / 1000 / 2, during
