"""A vision model's rows without images speculate as a text model's do (prompt lookup), with
the tokens of plain decoding, in every family (the Qwen ones with their 3-D positions too);
rows whose prompt holds images never do (a verify pass would feed their features again).
Before, no row of a vision engine speculated, so a text chat with Gemma 3 (a vision model as
most of its conversions ship) lost what prompt lookup gives a text model."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.kinds.vision.model import load_vision
from support.random_qwen3_vl import write_random_qwen3_vl
from support.random_vlm import (
    write_random_gemma3,
    write_random_mistral3,
    write_random_qwen2_5_vl,
    write_random_smolvlm,
    write_random_vlm,
)
from test_speculative import CODE, drive, forced, greedy

WRITERS: dict[str, Callable[[Path], Path]] = {
    "llava": write_random_vlm, "gemma3": write_random_gemma3,
    "mistral3": write_random_mistral3, "smolvlm": write_random_smolvlm,
    "qwen2_5_vl": write_random_qwen2_5_vl, "qwen3_vl": write_random_qwen3_vl}


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_text_rows_of_a_vision_model_speculate_with_the_plain_tokens(tmp_path, family):
    model, tok, _, _ = load_vision(WRITERS[family](tmp_path / family), "float32")
    if model.positions is not None:  # as the vision engine does at load (Qwen's 3-D positions)
        from mlxd.engine.mlx_lm_internals import hook_row_tokens
        hook_row_tokens(lambda m: getattr(m, "positions", None))
    prompt = tok.encode(CODE)
    plain, _ = drive(model, None, [AddRequest("a", prompt, 60, greedy(), [])])
    spec = forced(4)
    got, _ = drive(model, spec, [AddRequest("a", prompt, 60, greedy(), [])])
    assert got == plain and len(plain["a"]) == 60
    assert spec.counters.steps > 0 and spec.counters.accepted > 0
    # two text rows decoding together speculate in one verify pass, each with its own tokens
    other = tok.encode(CODE.replace("hello", "goodbye"))
    rows = [AddRequest("r1", prompt, 40, greedy(), []), AddRequest("r2", other, 40, greedy(), [])]
    plain2, _ = drive(model, None, rows)
    spec = forced(4)
    got2, _ = drive(model, spec, [AddRequest("r1", prompt, 40, greedy(), []),
                                  AddRequest("r2", other, 40, greedy(), [])])
    assert got2 == plain2 and plain2["r1"] == plain["a"][:40]
    # (several rows verify together on plain KV layers only: not Gemma 3's sliding windows)
    assert (spec.counters.batched > 0) == (family != "gemma3")
    # a row that must not speculate (a prompt with images) decodes plain, alone or batched
    spec = forced(4)
    alone, _ = drive(model, spec, [AddRequest("b", prompt, 30, greedy(), [], speculate=False)])
    drive(model, spec, [AddRequest("c", prompt, 30, greedy(), []),
                        AddRequest("d", prompt, 30, greedy(), [], speculate=False)])
    assert spec.counters.steps == 0 and alone["b"] == plain["a"][:30]


def png_b64(color: tuple[int, int, int]) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def chat(d, content, max_tokens: int = 24) -> dict:
    with d.http() as c:
        r = c.post("/v1/chat/completions", json={
            "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_an_image_request_never_speculates_and_a_text_one_does(tmp_path, family):
    """Through a daemon (prompt lookup, the default): an image request decoding alone takes
    no speculative step; the same text without the image does."""
    d = start_daemon(WRITERS[family](tmp_path / family), isolate=True)
    try:
        answer = chat(d, [{"type": "text", "text": CODE}, {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + png_b64((9, 99, 199))}}], 48)
        prompt = answer["usage"]["prompt_tokens"]
        d.wait_until(lambda s: s["engines"][0]["cache"]["prompt_tokens"] >= prompt,
                     what="the engine's figures after the request")
        cache = d.stats()["engines"][0]["cache"]
        assert cache["spec_mode"] == "ngram" and cache["spec_steps"] == 0
        chat(d, CODE, 48)
        d.wait_until(lambda s: s["engines"][0]["cache"]["spec_steps"] > 0,
                     what="a text request's speculative steps")
    finally:
        stop(d)
