"""Images in requests (runs in the proxy): where each dialect's image comes from (`ImageRef`),
and `decode_images`, which turns them into decoded RGB pixels with their content hash
(`ImageInput`) before any engine is chosen, so a bad image is a 400 that never reaches one.

Limits, each a 400 naming the image: at most MAX_IMAGES a request, MAX_IMAGE_BYTES encoded,
MAX_IMAGE_PIXELS decoded (read from the header before anything is decompressed, so a small
file that claims a huge size, a decompression bomb, is refused unread), formats in FORMATS;
bad base64 and undecodable or truncated files are 400s too. http(s) URLs are refused unless
`--allow-image-urls`; then they are fetched with a timeout and the same byte limit. Decoding
runs on a worker thread, never on the event loop.

Chat clients send a conversation's every image again with every turn: an image whose encoded
bytes were decoded recently is taken from `DecodedImages` (keyed by a hash of what the request
carried: the base64 text, or a fetched file's bytes), not decoded again."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass

from mlxd.protocol.messages import ImageInput, image_key
from mlxd.proxy.errors import APIError, bad_request

MAX_IMAGES = 8
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
FETCH_TIMEOUT_S = 10.0
DECODED_KEEP_BYTES = 32 << 20  # pixels of recently decoded images kept (ten 1280x800 ones)


class DecodedImages:
    """Recently decoded images by the hash of their encoded form, least recently used out
    first, at most `max_bytes` of pixels. Only images that decoded are kept: a refused one is
    refused again, by `decode`. Shared by the proxy's decoding threads."""

    def __init__(self, max_bytes: int = DECODED_KEEP_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self._kept: OrderedDict[bytes, ImageInput] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(encoded: bytes | str) -> bytes:
        import blake3
        # any text a client sent hashes (non-ASCII base64 is refused later, by `_base64`,
        # as a 400)
        return blake3.blake3(encoded.encode("utf-8", "surrogatepass")
                             if isinstance(encoded, str) else encoded).digest()

    def get(self, key: bytes) -> ImageInput | None:
        with self._lock:
            image = self._kept.get(key)
            if image is not None:
                self._kept.move_to_end(key)
                self.hits += 1
            return image

    def put(self, key: bytes, image: ImageInput) -> None:
        size = len(image.pixels)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._kept:
                return
            self._kept[key] = image
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, old = self._kept.popitem(last=False)
                self.nbytes -= len(old.pixels)


DECODED = DecodedImages()


@dataclass(frozen=True)
class ImageRef:
    """An image as a request gave it: base64 data, or a URL; `where` names it in errors."""
    data: str
    where: str
    url: bool = False


def from_url(url: str, where: str) -> ImageRef:
    """OpenAI's `image_url.url`: a data URL (`data:image/png;base64,...`) or an http(s) URL."""
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise bad_request(f"{where}: a data URL must be base64 "
                              "(data:image/png;base64,...)", param=where)
        return ImageRef(data, where)
    if url.startswith(("http://", "https://")):
        return ImageRef(url, where, url=True)
    raise bad_request(f"{where}: an image URL must be a data URL or an http(s) URL",
                      param=where)


def check_image_count(refs: tuple[ImageRef, ...] | list[ImageRef]) -> None:
    if len(refs) > MAX_IMAGES:
        raise bad_request(f"{len(refs)} images in one request; at most {MAX_IMAGES} are "
                          "accepted", code="too_many_images")


async def decode_images(refs: list[ImageRef], allow_urls: bool) -> list[ImageInput]:
    check_image_count(refs)
    raws: list[bytes | None] = []  # fetched images' bytes; None: base64, decoded below
    for ref in refs:
        if ref.url:
            if not allow_urls:
                raise bad_request(f"{ref.where}: image URLs are not fetched (mlxd serves "
                                  "local clients and fetches nothing unless started with "
                                  "--allow-image-urls); send the image as a data URL",
                                  code="image_url_refused", param=ref.where)
            raws.append(await _fetch(ref))
        else:
            raws.append(None)
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise APIError(501, "images need Pillow in mlxd's environment: install mlxd's vision "
                       "extra (pip install -e '.[vision]' in mlxd's checkout)",
                       type="server_error", code="images_unavailable") from None
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, _decode_ref, ref, raw)
            for raw, ref in zip(raws, refs, strict=True)]


def _decode_ref(ref: ImageRef, raw: bytes | None,
                memo: DecodedImages | None = None) -> ImageInput:
    """On a worker thread: base64 (unless fetched), then the image; an image decoded
    recently from the same text or bytes is taken as it was."""
    memo = DECODED if memo is None else memo
    if raw is None and len(ref.data) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise _too_large(ref.where)  # before hashing a text this long
    key = memo.key(ref.data if raw is None else raw)
    if (image := memo.get(key)) is not None:
        return image
    image = decode(_base64(ref) if raw is None else raw, ref.where)
    memo.put(key, image)
    return image


def _base64(ref: ImageRef) -> bytes:
    if len(ref.data) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise _too_large(ref.where)
    try:
        return base64.b64decode(ref.data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"{ref.where}: the image is not valid base64 ({e})",
                          code="invalid_image", param=ref.where) from e


def _too_large(where: str) -> Exception:
    return bad_request(f"{where}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB",
                       code="image_too_large", param=where)


async def _fetch(ref: ImageRef) -> bytes:
    import aiohttp
    try:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(ref.data, allow_redirects=True) as resp:
            if resp.status != 200:
                raise bad_request(f"{ref.where}: fetching the image answered HTTP "
                                  f"{resp.status}", code="invalid_image", param=ref.where)
            data = bytearray()  # `read(n)` may stop short of n before the end: read to EOF
            async for chunk in resp.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise _too_large(ref.where)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise bad_request(f"{ref.where}: the image could not be fetched: "
                          f"{type(e).__name__}", code="invalid_image", param=ref.where) from e
    return bytes(data)


def decode(raw: bytes, where: str) -> ImageInput:
    """Encoded bytes -> RGB pixels and their hash (blocking: call it on a worker thread)."""
    from PIL import Image
    if len(raw) > MAX_IMAGE_BYTES:
        raise _too_large(where)
    try:
        with Image.open(io.BytesIO(raw)) as im:  # reads the header only
            if im.format not in FORMATS:
                raise bad_request(f"{where}: {im.format} images are not accepted (only "
                                  f"{', '.join(sorted(FORMATS))})", code="invalid_image",
                                  param=where)
            w, h = im.size
            if w < 1 or h < 1 or w * h > MAX_IMAGE_PIXELS:
                raise bad_request(f"{where}: the image is {w}x{h} pixels; at most "
                                  f"{MAX_IMAGE_PIXELS:,} pixels are accepted",
                                  code="image_too_large", param=where)
            rgb = im.convert("RGB")  # decodes (the first frame of an animation)
    except Image.DecompressionBombError as e:  # Pillow's own check, at open, of the header
        raise bad_request(f"{where}: the image claims more pixels than any accepted: {e}",
                          code="image_too_large", param=where) from e
    except Image.UnidentifiedImageError as e:  # its text names the BytesIO's repr
        raise bad_request(f"{where}: the data is not an image in any known format",
                          code="invalid_image", param=where) from e
    except (OSError, SyntaxError, ValueError) as e:
        raise bad_request(f"{where}: the image cannot be decoded ({str(e)[:200]})",
                          code="invalid_image", param=where) from e
    pixels = rgb.tobytes()
    return ImageInput(w, h, pixels, image_key(w, h, pixels))
