"""Images in, through a real daemon (--isolate): a random-weight LLaVA (written by the test as
a real model directory) served by a vision engine. Each dialect's image input (OpenAI
`image_url` data URLs, Anthropic base64 `image` blocks, Ollama `images` in /api/chat and
/api/generate) gives the text mlx-vlm's own generate gives for the same image and prompt
(greedy); the same image in the next turn is a cache hit covering it and a changed pixel is a
miss; bad images are 400s that leave the engine serving; a text model refuses images; a
kill -9 of the engine mid-stream resumes with identical text, and the restarted engine finds
an earlier image's KV on the SSD tier."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

import numpy as np
import pytest

from conftest import start_daemon, stop_and_check
from support.harness import engine_pid, stream_chat
from support.random_vlm import IMAGE_TOKEN, image_tokens, write_random_vlm
from support.vision_dialects import other_dialect_answers

MODEL = "tiny-llava"
QUESTION = "What is in this picture?"
TOKENS = 12
IMAGE_SIZE = 56
# Steps of 30 ms in the first two engine epochs: time to aim a kill mid-stream.
SLOW = {"MLXD_FAULTS": "engine.step=delay@1#<2"}


def picture(seed: int = 0, size: tuple[int, int] = (64, 48)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def png(pixels: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


IMAGE = picture()
IMAGE_B64 = b64(png(IMAGE))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return write_random_vlm(tmp_path_factory.mktemp("models") / MODEL, image_size=IMAGE_SIZE)


@pytest.fixture(scope="module")
def reference(vlm):
    """mlx-vlm's own load and generate (greedy), in this process, on the prompt the chat
    template makes of one user turn [image, question]. mlx-vlm's LlavaProcessor call fails
    on transformers 5 (it passes `padding` to the image processor), so the inputs are made
    the way that processor makes them: the marker expanded, the image processor's pixels."""
    import mlx.core as mx
    from mlx_vlm import load, stream_generate
    from PIL import Image
    model, loaded = load(str(vlm))
    processor: Any = loaded  # mlx-vlm's processor (a ProcessorMixin with a detokenizer)
    tok = processor.tokenizer
    n = image_tokens(IMAGE_SIZE)

    def generate(pixels: np.ndarray, max_tokens: int = TOKENS) -> str:
        prompt = tok.apply_chat_template([{"role": "user", "content": IMAGE_TOKEN + QUESTION}],
                                         tokenize=False, add_generation_prompt=True)
        ids = tok(prompt.replace(IMAGE_TOKEN, IMAGE_TOKEN * n))["input_ids"]
        values = processor.image_processor(images=[Image.fromarray(pixels)],
                                           return_tensors="np")["pixel_values"]
        out = [r.token for r in stream_generate(model, processor, prompt,
                                                input_ids=mx.array([ids]),
                                                pixel_values=mx.array(values),
                                                max_tokens=max_tokens, temperature=0.0)]
        out = out[:max_tokens]
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        if eos in out:
            out = out[:out.index(eos)]
        return tok.decode(out)
    return generate


@pytest.fixture(scope="module")
def daemon(vlm):
    d = start_daemon(vlm, "--restart-backoff", "0.1", "--model-pool", "2", isolate=True,
                     env=SLOW)
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


def test_each_dialect_gives_the_text_mlx_vlm_generates(daemon, reference):
    want = reference(IMAGE)
    code, got = chat(daemon, openai_body())
    assert code == 200, got
    assert got["choices"][0]["message"]["content"] == want
    assert got["usage"]["prompt_tokens"] > image_tokens(IMAGE_SIZE)
    assert other_dialect_answers(daemon, MODEL, IMAGE_B64, QUESTION, TOKENS) == [want] * 3
    assert reference(picture(1)) != want  # the image matters to the answer


def test_responses_input_image_gives_the_chat_answer(daemon, vlm):
    """The Responses API through the openai SDK (`client.responses.create`): an
    `input_image` part (a data URL, as the SDK sends it) answers as chat's `image_url` does;
    a `previous_response_id` turn sends the image again and hits the cache through it; bad
    images are 400s in the Responses API's error format."""
    import openai
    from tokenizers import Tokenizer
    api = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)

    def ask(url: str, **kw: Any) -> Any:
        return api.responses.create(model=MODEL, temperature=0, max_output_tokens=TOKENS,
                                    input=[{"role": "user", "content": [
                                        {"type": "input_image", "image_url": url,
                                         "detail": "auto"},
                                        {"type": "input_text", "text": QUESTION}]}], **kw)
    code, chat_answer = chat(daemon, openai_body(b64(png(picture(6)))))
    assert code == 200, chat_answer
    first = ask("data:image/png;base64," + b64(png(picture(6))))
    assert first.output_text == chat_answer["choices"][0]["message"]["content"]
    assert first.usage is not None
    assert first.usage.input_tokens == chat_answer["usage"]["prompt_tokens"]
    second = api.responses.create(model=MODEL, temperature=0, max_output_tokens=4,
                                  previous_response_id=first.id,
                                  input="And what colour is it?")
    before_image = len(Tokenizer.from_file(str(vlm / "tokenizer.json"))
                       .encode("<|im_start|>user\n").ids)
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= \
        before_image + image_tokens(IMAGE_SIZE), second.usage
    cases = {"invalid_image": "data:image/png;base64," + b64(b"GIF89a nothing of the sort"),
             "image_too_large": "data:image/png;base64," + b64(png_bomb())}
    for code_name, url in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            ask(url)
        assert e.value.code == code_name, e.value.body
        assert e.value.param == "input[0].content[0].image_url", e.value.body
    with daemon.http() as c:
        r = c.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-123"}]}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[0].content[0].file_id", r.text
    assert ask("data:image/png;base64," + b64(png(picture(6)))).output_text == \
        first.output_text  # and the engine serves on


def test_the_same_image_next_turn_is_a_cache_hit_and_a_changed_pixel_a_miss(daemon, vlm):
    from tokenizers import Tokenizer
    before_image = len(Tokenizer.from_file(str(vlm / "tokenizer.json"))
                       .encode("<|im_start|>user\n").ids)  # the template's turn header
    code, first = chat(daemon, openai_body())
    assert code == 200, first
    answer = first["choices"][0]["message"]["content"]
    history = [{"role": "assistant", "content": answer},
               {"role": "user", "content": "And what colour is it?"}]
    sent = daemon.stats()["proxy"]["images"]
    code, second = chat(daemon, openai_body(history=history))
    assert code == 200, second
    end_of_image = before_image + image_tokens(IMAGE_SIZE)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= end_of_image, second
    # the engine holds the image: it went by its content hash, without its pixels
    assert daemon.stats()["proxy"]["images"] == {
        "sent_by_hash": sent["sent_by_hash"] + 1, "sent_again_whole": sent["sent_again_whole"]}
    changed = IMAGE.copy()
    changed[10, 20, 1] ^= 1  # one pixel, one channel, one bit
    code, third = chat(daemon, openai_body(b64(png(changed)), history=history))
    assert code == 200, third
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] <= before_image, third


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims width x height pixels (10^10 here), with a few bytes of
    deflated data: decoding it would ask for 30 GB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 4096)) + chunk(b"IEND", b""))


def test_bad_images_are_400s_and_the_engine_keeps_serving(daemon, vlm, tiny_model):
    pid = engine_pid(daemon)
    from PIL import Image
    buf = io.BytesIO()  # a real image of 16.8 M pixels (over the 16.7 M limit), 1 bit deep
    Image.new("1", (4100, 4100)).save(buf, format="PNG")
    cases = {
        "invalid_image/bad base64": openai_body("not base64 at all!!"),
        "invalid_image/non-ASCII base64": openai_body("iVBORw0K\u00e9\U0001F600" * 1000),
        "invalid_image/not an image": openai_body(b64(b"GIF89a but then nothing of the sort")),
        "image_too_large/png bomb": openai_body(b64(png_bomb())),
        "image_too_large/oversized": openai_body(b64(buf.getvalue())),
        "too_many_images": {**openai_body(), "messages": [{"role": "user", "content": [
            *[{"type": "image_url", "image_url": {"url": "data:image/png;base64," + IMAGE_B64}}
              for _ in range(9)], {"type": "text", "text": QUESTION}]}]},
        "image_url_refused": {**openai_body(), "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}},
            {"type": "text", "text": QUESTION}]}]},
    }
    for name, body in cases.items():
        code, got = chat(daemon, body)
        assert code == 400, (name, got)
        assert got["error"]["code"] == name.split("/")[0] and got["error"]["message"], got
    with daemon.http() as c:
        r = c.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64(png_bomb())}}]}]})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        r = c.post("/api/chat", json={"model": MODEL, "stream": False, "messages": [
            {"role": "user", "content": "hi", "images": ["%%%"]}]})
        assert r.status_code == 400, r.text
    code, got = chat(daemon, {**openai_body(), "model": str(tiny_model)})
    assert code == 400 and "does not take images" in got["error"]["message"], got
    code, got = chat(daemon, openai_body())
    assert code == 200, got
    assert engine_pid(daemon) == pid  # the same engine process served throughout






def test_kill_9_mid_stream_resumes_with_identical_text_and_the_ssd_tier_knows_images(
        daemon, vlm, reference):
    body = openai_body(b64(png(picture(2))), max_tokens=24)
    want, _ = stream_chat(daemon, body)
    with daemon.unix_http() as u:  # what earlier tests cached is durable on SSD
        assert u.post("/admin/cache/flush").status_code == 200
    pid = engine_pid(daemon)
    text, usage = stream_chat(daemon, body, kill_after=6)
    assert text == want
    assert usage.get("resumes") == 1 and engine_pid(daemon) != pid, usage
    # The new engine's RAM tier is empty: the first test's image comes back from SSD blocks.
    from tokenizers import Tokenizer
    before_image = len(Tokenizer.from_file(str(vlm / "tokenizer.json"))
                       .encode("<|im_start|>user\n").ids)
    sent = daemon.stats()["proxy"]["images"]
    code, got = chat(daemon, openai_body())
    assert code == 200, got
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        before_image + image_tokens(IMAGE_SIZE), got
    assert got["choices"][0]["message"]["content"] == reference(IMAGE)
    # the new engine process was never sent that image: it went whole, not by its hash
    assert daemon.stats()["proxy"]["images"] == sent


def test_an_engine_that_does_not_hold_an_image_sent_by_hash_is_sent_it_whole(vlm, reference):
    """Every lookup of an image sent without its pixels fails (a fault point: a table that
    forgot it): the engine answers `image_unknown`, the proxy sends the request whole, and
    the client sees its answer and its cache hit as if nothing had happened."""
    d = start_daemon(vlm, isolate=True, env={"MLXD_FAULTS": "engine.vision.held=fail"})
    try:
        code, first = chat(d, openai_body(b64(png(picture(3)))))
        assert code == 200, first
        history = [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                   {"role": "user", "content": "And what colour is it?"}]
        code, second = chat(d, openai_body(b64(png(picture(3))), history=history))
        assert code == 200, second
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            image_tokens(IMAGE_SIZE), second
        assert d.stats()["proxy"]["images"] == {"sent_by_hash": 1, "sent_again_whole": 1}
        code, again = chat(d, openai_body())
        assert code == 200 and again["choices"][0]["message"]["content"] == reference(IMAGE)
    finally:
        stop_and_check(d)


def test_an_image_registered_without_pixel_values_gets_them_if_its_features_are_needed():
    """Admission skips the image processor for an image a cache covers; should that cache
    entry be evicted before the prefill, the MLX thread computes them after all."""
    import mlx.core as mx

    from mlxd.engine.kinds.vision.image_table import VIRTUAL_BASE, ImageTable
    from mlxd.protocol.messages import ImageInput, image_key
    calls: list[str] = []

    def preprocess(img: ImageInput) -> np.ndarray:
        calls.append("preprocess")
        return np.full((1, 2), img.pixels[0], dtype=np.float32)

    def encode(values: np.ndarray, grid: Any) -> mx.array:
        calls.append("encode")
        return mx.array(values[0])[:, None] * mx.ones((2, 3))  # 2 tokens of hidden size 3

    pixels = bytes([7, 8, 9])
    img = ImageInput(1, 1, pixels, image_key(1, 1, pixels))
    table = ImageTable(encode, preprocess)
    ids = table.register(img, 2, None)
    assert all(i >= VIRTUAL_BASE for i in ids) and len(set(ids)) == 2 and not calls
    assert table.register(img, 2, None) == ids  # the same image: the same ids
    embed = mx.array([[5.0, 5.0, 5.0]] * 4)  # "token embeddings": every id gives 5s
    out = table.embed(mx.array([[1, ids[0], ids[1], 2]]),
                      lambda t: embed[mx.zeros(t.shape, dtype=mx.int32)])
    assert out is not None and calls == ["preprocess", "encode"]
    assert out.tolist() == [[[5.0] * 3, [7.0] * 3, [7.0] * 3, [5.0] * 3]]
    assert table.embed(mx.array([[1, 2]]), None) is None  # no image tokens: nothing to do
    assert table.embed(mx.array([[1]], dtype=mx.uint32), None) is None  # a sampled token


def test_screenshot_sized_images_never_share_a_token_id_and_each_gets_its_own_features():
    """30 bits an image token: forty screenshot-sized images (1,400 positions each) held at
    once share ids under the plain derivation (checked here: the test would not test
    anything otherwise), which refused a request as "two images' token ids collide" on the
    H200 (issue 36's benchmark, four families of five). The table hands an image that meets
    another a salted derivation: every id in the table is distinct, the same image keeps its
    ids, and each position is fed its own image's features."""
    import mlx.core as mx

    from mlxd.engine.kinds.vision.image_table import ImageTable, image_token_ids
    from mlxd.protocol.messages import ImageInput, image_key
    n, count = 1400, 40

    def image(k: int) -> ImageInput:
        pixels = bytes([k % 256, k // 256, 7])
        return ImageInput(1, 1, pixels, image_key(1, 1, pixels))

    def encode(values: np.ndarray, grid: Any) -> mx.array:  # position i of image k: (k, i)
        return mx.stack([mx.full((n,), float(values[0, 0])), mx.arange(n, dtype=mx.float32)],
                        axis=1)

    images = [image(k) for k in range(count)]
    plain = [image_token_ids(img.key, n) for img in images]
    assert len({i for ids in plain for i in ids}) < count * n  # they do collide, plainly
    table = ImageTable(encode, lambda img: np.full((1, 1), img.pixels[0], np.float32))
    got = [table.ids_for(img, n) for img in images]
    assert len({i for ids in got for i in ids}) == count * n
    held = table.held_bytes  # ids alone so far: a request refused after its prompt was built
    table.register(images[1], n, None)  # (a cache covers it: no pixel values)
    assert table.held_bytes == held + len(images[1].pixels)  # keeps its image from now on
    assert sum(ids != p for ids, p in zip(got, plain, strict=True)) >= 1  # salted where met
    assert [table.ids_for(img, n) for img in images] == got  # the same image, the same ids
    for k in (0, count // 2, count - 1):
        table.register(images[k], n, np.full((1, 1), k, np.float32))
        fed = table.embed(mx.array([[5, *got[k][:8], *got[k][-8:], 6]]),
                          lambda t: mx.zeros((*t.shape, 2)))
        assert fed is not None
        assert fed[0, 1:-1].tolist() == [[k, i] for i in [*range(8), *range(n - 8, n)]]


def test_an_image_encoded_on_an_admission_lane_is_ready_for_the_mlx_thread():
    """The vision tower runs where the image is admitted (a lane thread, its own MLX stream);
    the MLX thread's prefill then uses those features as they are and never runs the tower."""
    import threading

    import mlx.core as mx

    from mlxd.engine.kinds.vision.image_table import ImageTable
    from mlxd.protocol.messages import ImageInput, image_key
    towers: list[str] = []

    def encode(values: np.ndarray, grid: Any) -> mx.array:
        towers.append(threading.current_thread().name)
        return mx.array(values[0])[:, None] * mx.ones((2, 3)) + 1

    pixels = bytes([4, 5, 6])
    img = ImageInput(1, 1, pixels, image_key(1, 1, pixels))
    table = ImageTable(encode, lambda _: pytest.fail("the pixels were preprocessed again"))
    ids: list[int] = []

    def admit() -> None:
        ids.extend(table.register(img, 2, np.full((1, 2), 4, dtype=np.float32)))
        assert not table.encoded_image(img.key)
        table.encode_now(img.key)
        assert table.encoded_image(img.key)  # a next request with it skips preprocessing
        table.encode_now(img.key)  # encoded once: a second call finds the features

    lane = threading.Thread(target=admit, name="lane")
    lane.start()
    lane.join()
    assert towers == ["lane"] and table.encoded == 1
    embed = mx.array([[0.0, 0.0, 0.0]] * 4)
    out = table.embed(mx.array([[1, ids[0], ids[1]]]),
                      lambda t: embed[mx.zeros(t.shape, dtype=mx.int32)])
    assert out is not None and out.tolist() == [[[0.0] * 3, [5.0] * 3, [5.0] * 3]]
    assert towers == ["lane"]  # the MLX thread (here, this one) did not run the tower


async def test_image_urls_are_fetched_only_when_allowed():
    """--allow-image-urls: the proxy fetches http(s) images (the same limits apply); without
    it a URL is refused unread. A local server stands in for the web."""
    import numpy as np
    from aiohttp import web
    from PIL import Image

    from mlxd.proxy.core.images import ImageRef, decode, decode_images
    from mlxd.proxy.errors import APIError
    data = png(IMAGE)
    noise = np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "PNG")
    big = buf.getvalue()  # about 780 kB: many reads of the response body
    hits: list[str] = []

    async def serve(request: web.Request) -> web.Response:
        hits.append(request.path)
        if request.path == "/big.png":
            return web.Response(body=big, content_type="image/png")
        if request.path != "/cat.png":
            raise web.HTTPNotFound()
        return web.Response(body=data, content_type="image/png")
    app = web.Application()
    app.router.add_get("/{name}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        url = f"http://127.0.0.1:{port}/cat.png"
        got = await decode_images([ImageRef(url, "x", url=True)], allow_urls=True)
        assert got == [decode(data, "x")] and hits == ["/cat.png"]
        got = await decode_images([ImageRef(url.replace("cat", "big"), "x", url=True)], True)
        assert got == [decode(big, "x")]
        hits.remove("/big.png")
        with pytest.raises(APIError) as e:
            await decode_images([ImageRef(url.replace("cat", "dog"), "x", url=True)], True)
        assert e.value.status == 400 and "404" in e.value.message
        with pytest.raises(APIError) as e:
            await decode_images([ImageRef(url, "x", url=True)], allow_urls=False)
        assert e.value.code == "image_url_refused" and len(hits) == 2  # never fetched
    finally:
        await runner.cleanup()
