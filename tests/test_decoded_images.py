"""The proxy's recently decoded images (proxy/core/images.py `DecodedImages`): chat clients send
every image of a conversation again each turn; an image whose encoded form was decoded recently
is not decoded again, a changed one is, a refused one is refused again, and the pixels kept
stay within their byte bound."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mlxd.protocol.messages import ImageInput
from mlxd.proxy.core import images
from mlxd.proxy.core.images import DecodedImages, ImageRef, decode_images
from mlxd.proxy.engines.sent_images import SentImages
from mlxd.proxy.errors import APIError


def _png_b64(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def opens(monkeypatch) -> list[int]:
    """Counts Pillow's opens of an image (each a decode), with a fresh memo."""
    count: list[int] = []
    real = Image.open

    def counted(*a, **k):
        count.append(1)
        return real(*a, **k)
    monkeypatch.setattr(Image, "open", counted)
    monkeypatch.setattr(images, "DECODED", DecodedImages())
    return count


async def test_an_image_sent_again_is_not_decoded_again(opens):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    data = _png_b64(pixels)
    first = await decode_images([ImageRef(data, "a")], allow_urls=False)
    again = await decode_images([ImageRef(data, "a"), ImageRef(data, "b")], allow_urls=False)
    assert len(opens) == 1 and images.DECODED.hits == 2
    assert again == [first[0], first[0]] and first[0].pixels == pixels.tobytes()
    changed = pixels.copy()
    changed[5, 7, 1] ^= 1  # one pixel: another image, decoded, another key
    other = await decode_images([ImageRef(_png_b64(changed), "c")], allow_urls=False)
    assert len(opens) == 2 and other[0].key != first[0].key


async def test_a_refused_image_is_refused_every_time(opens):
    bad = base64.b64encode(b"not an image at all").decode()
    for _ in range(2):
        with pytest.raises(APIError) as e:
            await decode_images([ImageRef(bad, "x")], allow_urls=False)
        assert e.value.status == 400 and e.value.code == "invalid_image"
    assert len(opens) == 2 and images.DECODED.nbytes == 0
    for text in ("iVBORw0K\u00e9" * 100, "\ud800lone surrogate"):  # hashed, then a 400
        with pytest.raises(APIError) as e:
            await decode_images([ImageRef(text, "x")], allow_urls=False)
        assert e.value.status == 400 and e.value.code == "invalid_image"


def test_the_pixels_kept_stay_within_their_bound():
    rng = np.random.default_rng(1)
    size = 32 * 32 * 3
    memo = DecodedImages(max_bytes=2 * size)
    refs = [ImageRef(_png_b64(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)), f"i{n}")
            for n in range(3)]
    got = [images._decode_ref(r, None, memo) for r in refs]
    assert memo.nbytes == 2 * size and len(memo._kept) == 2
    assert memo.get(memo.key(refs[0].data)) is None  # the least recently used went first
    assert memo.get(memo.key(refs[2].data)) is got[2]
    big = DecodedImages(max_bytes=size - 1)  # an image larger than the bound is not kept
    images._decode_ref(refs[0], None, big)
    assert big.nbytes == 0


def _image(key: int) -> ImageInput:
    return ImageInput(2, 1, bytes([key]) * 6, bytes([key]) * 32)


def test_an_engine_process_holding_an_image_is_sent_it_by_hash_until_it_may_have_forgotten():
    """`SentImages`: an image an engine process admitted goes to that process again without
    its pixels for `keep_s`; never to another process of the engine (a restart holds none),
    never after `keep_s`, never once the engine said it did not hold one of them."""
    sent = SentImages(keep_s=100.0, keep=2)
    a, b, c = _image(1), _image(2), _image(3)
    assert sent.slim("e", 0, [a], now=0.0) is None  # nothing sent yet
    sent.sent("e", 0, [a, b], now=10.0)
    slim = sent.slim("e", 0, [a, c], now=50.0)
    assert slim is not None and [i.pixels for i in slim] == [b"", c.pixels]
    assert [i.key for i in slim] == [a.key, c.key] and slim[0].width == a.width
    assert sent.slim("e", 1, [a], now=50.0) is None  # the engine's next process
    assert sent.slim("f", 0, [a], now=50.0) is None  # another engine
    assert sent.slim("e", 0, [a], now=111.0) is None  # it may have forgotten it by now
    sent.sent("e", 0, [c], now=60.0)  # at most `keep` remembered: a, the oldest, goes
    assert sent.slim("e", 0, [a], now=61.0) is None
    assert sent.slim("e", 0, [b], now=61.0) is not None
    sent.sent("e", 1, [a], now=70.0)  # a restarted process: the older one's are dropped
    assert sent.slim("e", 0, [b], now=71.0) is None
    assert sent.by_hash == 2 and sent.again == 0
    slim = sent.slim("e", 1, [a], now=72.0)
    assert slim is not None
    sent.forget("e", 1, slim)
    assert sent.slim("e", 1, [a], now=73.0) is None
    assert (sent.by_hash, sent.again) == (3, 1)
