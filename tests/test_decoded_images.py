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

from mlxd.proxy.core import images
from mlxd.proxy.core.images import DecodedImages, ImageRef, decode_images
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
