"""Qwen3-VL's DeepStack: its vision tower also gives features from a few of its blocks, which
the language model adds to its hidden states at the image's positions after each of its first
layers. mlxd keeps them in the `ImageTable` with the image's features and feeds each forward
pass those of the image tokens it holds, so an image whose positions are split over prefill
chunks, partly in a cached prefix, or in rows batched together, is answered as mlx-vlm answers
the whole prompt at once (the family tests in test_vision_families.py run the rest: every
dialect, the caches, resume). Random-weight Qwen3-VL and Qwen3-VL-MoE directories; no
download."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import start_daemon, stop_and_check
from support.harness import stream_chat
from support.random_qwen3_vl import write_random_qwen3_vl
from test_vision import b64, picture, png

QUESTION = "What is in this picture?"
TOKENS = 12
IMAGE_PAD = "<|image_pad|>"


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def qwen3(request, tmp_path_factory) -> Path:
    """A dense Qwen3-VL, or a Qwen3-VL-MoE (the same tower and DeepStack, experts in the
    language model's MLPs)."""
    return write_random_qwen3_vl(tmp_path_factory.mktemp("models") / f"tiny-{request.param}",
                                 experts=4 if request.param == "qwen3_vl_moe" else 0)


def _prompt(tok: Any, images: int) -> str:
    messages = [{"role": "user", "content": [*[{"type": "image"}] * images,
                                             {"type": "text", "text": QUESTION}]}]
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_deepstack_features_follow_each_passs_image_tokens(qwen3, monkeypatch):
    """The logits of rows fed to the model mlxd drives equal mlx-vlm's forward pass of the
    whole prompt, for two images of other sizes in one prompt, however the prompt is cut into
    passes (an image split over chunks, or its first positions in a cache filled earlier),
    and for two rows of other images in one pass; greedy decoding after a split prefill gives
    mlx-vlm's own generation. With the DeepStack features dropped, neither holds."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm import load, stream_generate
    from PIL import Image

    from mlxd.engine.kinds.vision.image_table import Fed
    from mlxd.engine.kinds.vision.model import load_vision
    from mlxd.protocol.messages import ImageInput, image_key
    model, tok, _, parts = load_vision(qwen3, "float32")
    positions, layout, grid_of = model.positions, parts.layout, parts.grid
    assert positions is not None and grid_of is not None and layout is not None
    vlm, processor = load(str(qwen3))
    sizes = [(64, 48), (100, 30)]

    def row_of(pictures: list[np.ndarray]) -> tuple[list[int], list[int], Any, Any]:
        """(mlxd's ids, the processor's ids, pixel values, grids) for a prompt of pictures."""
        prompt = _prompt(tok, len(pictures))
        pieces = prompt.split(IMAGE_PAD)
        text, values, grids = pieces[0], [], []
        for pixels, piece in zip(pictures, pieces[1:], strict=True):
            height, width = pixels.shape[:2]
            text += layout(width, height)[0] + piece
        real = list(tok.encode(text, add_special_tokens=False))
        ids = list(real)
        at = [k for k, t in enumerate(real) if t == parts.image_token_id]
        for pixels in pictures:
            height, width = pixels.shape[:2]
            raw = pixels.tobytes()
            image = ImageInput(width, height, raw, image_key(width, height, raw))
            grid = grid_of(width, height)
            n = grid[1] * grid[2]
            values.append(parts.images.preprocess(image))
            grids.append([grid[0], grid[1] * 2, grid[2] * 2])
            for k, v in zip(at[:n], parts.images.register(image, n, values[-1], grid),
                            strict=True):
                ids[k] = v
            at = at[n:]
        return ids, real, mx.array(np.concatenate(values)), mx.array(grids)

    def theirs(real: list[int], values: Any, grids: Any) -> np.ndarray:
        out = vlm(mx.array([real]), pixel_values=values, image_grid_thw=grids)
        return np.array(out.logits[:, -1])

    def ours(rows: list[list[int]], splits: list[int]) -> np.ndarray:
        cache = make_prompt_cache(model)
        fed: list[list[int]] = [[] for _ in rows]
        for a, b in zip([0, *splits], [*splits, len(rows[0])], strict=True):
            positions.set_row_tokens(fed, [len(r) for r in fed])
            for r, ids in zip(fed, rows, strict=True):
                r += ids[a:b]
            logits = model(mx.array([ids[a:b] for ids in rows]), cache=cache)
            positions.clear()
        return np.array(logits[:, -1])

    two = [picture(3, size=sizes[0]), picture(4, size=sizes[1])]
    ids, real, values, grids = row_of(two)
    at = [k for k, t in enumerate(real) if t == parts.image_token_id]
    assert len(at) == 20 + 24
    want = theirs(real, values, grids)
    # none; the first image cut; both cut (three passes); the second cut twice
    cuts: list[list[int]] = [[], [at[5]], [at[3], at[17], at[30]], [at[20] + 1, at[40]]]
    for splits in cuts:
        np.testing.assert_allclose(ours([ids], splits), want[:1], rtol=1e-4, atol=1e-4)

    # Two rows of other images (one size: one length) in each pass, cut mid-image.
    pair = [picture(5), picture(6)]
    rows = [row_of([p]) for p in pair]
    got = ours([r[0] for r in rows], [at[7]])
    for k, (_, real_k, values_k, grids_k) in enumerate(rows):
        np.testing.assert_allclose(got[k:k + 1], theirs(real_k, values_k, grids_k), rtol=1e-4,
                                   atol=1e-4)

    def greedy(row: list[int], split: int) -> list[int]:
        cache, fed = make_prompt_cache(model), list[int]()
        for a, b in ((0, split), (split, len(row))):
            positions.set_row_tokens([fed], [len(fed)])
            fed += row[a:b]
            logits = model(mx.array([row[a:b]]), cache=cache)
            positions.clear()
        out: list[int] = []
        for _ in range(TOKENS):
            out.append(int(np.array(mx.argmax(logits[0, -1]))))
            positions.set_row_tokens([fed], [len(fed)])
            fed.append(out[-1])
            logits = model(mx.array([[out[-1]]], dtype=mx.uint32), cache=cache)
            positions.clear()
        return out

    images = [Image.fromarray(p) for p in two]
    generated = [r.token for r in stream_generate(vlm, processor, _prompt(tok, 2), image=images,
                                                  max_tokens=TOKENS, temperature=0.0)][:TOKENS]
    assert greedy(ids, at[30]) == generated

    # Without DeepStack: the features of the main path alone
    feed = parts.images.feed

    def without(inputs: Any, embed_tokens: Any) -> Fed | None:
        fed = feed(inputs, embed_tokens)
        return Fed(fed.embeds) if fed is not None else None
    monkeypatch.setattr(parts.images, "feed", without)
    assert not np.allclose(ours([ids], [at[5]]), want[:1], rtol=1e-4, atol=1e-4)
    assert greedy(ids, at[30]) != generated


def test_an_image_split_over_prefill_chunks_by_a_decoding_row_answers_as_mlx_vlm(qwen3):
    """Through the daemon: while a text row decodes, a prompt prefills `--prefill-step`
    tokens a step (16 here), so an image's 20 or 24 positions fall in two or three chunks;
    the answers are mlx-vlm's (two images of other sizes, one request)."""
    from mlx_vlm import load, stream_generate
    from PIL import Image
    vlm, processor = load(str(qwen3))
    two = [picture(7), picture(8, size=(100, 30))]
    prompt = _prompt(processor.tokenizer, 2)
    tokens = [r.token for r in stream_generate(vlm, processor, prompt,
                                               image=[Image.fromarray(p) for p in two],
                                               max_tokens=TOKENS, temperature=0.0)][:TOKENS]
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = tokens[:tokens.index(eos)] if eos in tokens else tokens
    d = start_daemon(qwen3, "--prefill-step", "16", isolate=True,
                     env={"MLXD_FAULTS": "engine.step=delay@1"})
    try:
        from mlx_lm.utils import load_tokenizer
        detokenizer = load_tokenizer(qwen3).detokenizer
        for t in tokens:
            detokenizer.add_token(t)
        detokenizer.finalize()
        text = {"model": qwen3.name, "max_tokens": 200, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about Paris."}]}
        decoding: list[str] = []
        started = threading.Event()
        beside = threading.Thread(target=lambda: decoding.append(
            stream_chat(d, text, on_chunk=lambda _: started.set())[0]))
        beside.start()
        assert started.wait(120)
        body = {"model": qwen3.name, "max_tokens": TOKENS, "temperature": 0, "messages": [
            {"role": "user", "content": [
                *[{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                     + b64(png(p))}} for p in two],
                {"type": "text", "text": QUESTION}]}]}
        with d.http() as c:
            r = c.post("/v1/chat/completions", json=body)
        assert not decoding, "the text row had finished: no row decoded beside the prefill"
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == detokenizer.text
        beside.join()
    finally:
        stop_and_check(d)


def test_qwen3_vl_grid_is_transformers_processors_for_many_sizes(qwen3):
    """Qwen3-VL's image processor (transformers' Qwen2-VL one with 16-pixel patches and the
    pixel bounds of `size`) resizes to whole 32-pixel units: the grid mlxd lays an image out
    by, for sizes below, inside and above the bounds and of extreme aspect ratios, is the one
    transformers' processor gives (mlx-vlm's port is checked against it at load, by probes)."""
    import json

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from mlxd.engine.kinds.vision.model import load_vision
    _, _, _, parts = load_vision(qwen3, "float32")
    assert parts.grid is not None
    config = json.loads((qwen3 / "preprocessor_config.json").read_text())
    reference = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                         size=config["size"])
    sizes = [(1, 1), (17, 300), (32, 32), (64, 48), (100, 30), (129, 127), (160, 128),
             (191, 250), (400, 300), (1000, 7), (7, 1000), (1920, 1080)]
    grids = reference(images=[Image.new("RGB", s) for s in sizes],
                      return_tensors="np")["image_grid_thw"].tolist()
    for (width, height), (t, h, w) in zip(sizes, grids, strict=True):
        assert parts.grid(width, height) == (t, h // 2, w // 2), (width, height)
