"""The images a vision engine knows, by the token ids that hold their place in prompts.

An image's place in a prompt is held by *image tokens*: ids above the vocabulary
(`VIRTUAL_BASE` and up), one per position the image takes, each derived from the blake3 of the
image's decoded pixels and the position (`image_token_ids`). The prompt's token ids therefore
name the image's content: the prefix cache's trie and the SSD tier's chained block keys, which
are built from token ids alone, hit on the same image and never on another one.

Each id maps to one (image, position) in the table, and 30 bits per id are few for that: a
screenshot takes ~1,400 positions, so two dozen such images in the table share some id with
a probability near one half (and one image's own positions repeat an id one time in a
thousand). So an image entering the table takes the first of a few salted derivations whose
ids are all distinct and unused (`ImageTable.ids_for`); salt 0, the plain derivation, in all
but those cases. A salted image's ids may differ after the table forgot it or after a restart:
then its cached prefix misses and is computed again, never a wrong hit. `VisionLM`
looks those ids up in its `ImageTable` and feeds the image's features in their place. The
vision tower and projector run at admission, on the admission lane's thread and its own MLX
stream, for images a cache did not cover (`ImageTable.encode_now`): their time is never inside
a step, so rows already decoding keep their pace while an image is admitted (what they share
is the device). Only an image whose cached prefix was evicted between admission and prefill
is encoded on the MLX thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from blake3 import blake3

from mlxd.protocol import faults
from mlxd.protocol.messages import ImageInput, image_key

VIRTUAL_BASE = 1 << 30  # image token ids: [VIRTUAL_BASE, 2 * VIRTUAL_BASE), within int32
IMAGE_TTL_S = 300.0  # an image registered this recently is never evicted from the table
IMAGE_TABLE_BYTES = 256 << 20  # beyond this, older images' pixels and features are dropped
ID_BYTES = 100  # what one id held in the table costs (its entry in the id map), counted


# derivations tried before an image is refused: one fails with odds of (its positions x the
# ids held) / 2^30, ~20 % for a screenshot beside a hundred others
MAX_SALTS = 64


def image_token_ids(key: bytes, n: int, salt: int = 0) -> list[int]:
    """The `n` ids an image with content hash `key` takes in a prompt, by derivation `salt`:
    position i's id is 30 bits of blake3(key[, salt], i) above VIRTUAL_BASE, so a sequence of
    them names the image (two images share one id by chance at 2^-30; a run of them, never in
    practice)."""
    seed = key if salt == 0 else key + b"/salt" + salt.to_bytes(2, "little")
    return [VIRTUAL_BASE | (int.from_bytes(blake3(seed + i.to_bytes(4, "little")).digest(4),
                                           "little") & (VIRTUAL_BASE - 1))
            for i in range(n)]


def pixels_key(width: int, height: int, pixels: bytes) -> bytes:
    """The content hash of a decoded RGB image (what the proxy computed and sent)."""
    return image_key(width, height, pixels)


# What the vision tower gives for an image: its features (tokens, hidden), or for a DeepStack
# family (Qwen3-VL) those and the features its language model adds to the hidden states of
# its first layers (levels, tokens, hidden)
Encoded = mx.array | tuple[mx.array, mx.array]


@dataclass
class _Image:
    image: ImageInput | None  # the decoded pixels, until encoded
    pixel_values: np.ndarray | None  # the processor's output, until encoded
    features: mx.array | None  # (tokens, hidden), once the vision tower ran
    ids: list[int]
    used: float
    nbytes: int
    grid: tuple[int, int, int] | None = None  # positional families: (frames, rows, columns)
    deepstack: mx.array | None = None  # DeepStack families: (levels, tokens, hidden)


@dataclass(frozen=True)
class Fed:
    """What one forward pass is fed for its image tokens."""
    embeds: mx.array  # (batch, length, hidden): image features in place of image token ids
    # DeepStack families: where the pass's image tokens are (batch, length), and their
    # DeepStack features (levels, image tokens in row-major order, hidden)
    mask: mx.array | None = None
    deepstack: mx.array | None = None


class ImageTable:
    """Image token id -> (image, position), and each image's pixels or features. Registered
    on an admission lane, read on the MLX thread (one lock). An image registered without
    pixel values (a cache covered it at admission) gets them on the MLX thread if a cache
    eviction in between makes its features needed after all."""

    def __init__(self, encode: Any, preprocess: Any,
                 max_bytes: int = IMAGE_TABLE_BYTES) -> None:
        # (pixel_values (numpy), grid or None) -> Encoded; MLX thread or an admission lane
        self._encode = encode
        self.preprocess = preprocess  # ImageInput -> pixel_values (numpy); the processor
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._images: OrderedDict[bytes, _Image] = OrderedDict()
        self._where: dict[int, tuple[bytes, int]] = {}
        self._bytes = 0
        self.encoded = 0  # images the vision tower ran for (a figure for tests and stats)

    def ids_for(self, image: ImageInput, n: int,
                grid: tuple[int, int, int] | None = None) -> list[int]:
        """The `n` token ids of `image` in prompts: those it has in the table, or, for an image
        new to it, the first derivation whose ids are distinct and no other image's. A new
        image's ids are held for it from now on, its pixels not yet: a request refused after
        its prompt was built keeps no pixels here (`register` adds them). `grid`: the image's
        merged-patch grid, for a family whose positions follow it."""
        plain = image_token_ids(image.key, n)  # outside the lock: the MLX thread feeds under it
        with self._lock:
            return self._entry(image.key, n, grid, plain).ids

    def register(self, image: ImageInput, n: int, pixel_values: np.ndarray | None,
                 grid: tuple[int, int, int] | None = None) -> list[int]:
        """The image's token ids (as `ids_for`), the image kept with them; `pixel_values`
        None: not computed (a cache covers it)."""
        plain = image_token_ids(image.key, n)
        with self._lock:
            img = self._entry(image.key, n, grid, plain)
            if img.features is None and img.image is None:
                img.image = image
                img.nbytes += len(image.pixels)
                self._bytes += len(image.pixels)
            if img.features is None and img.pixel_values is None and pixel_values is not None:
                img.pixel_values = pixel_values
                img.nbytes += pixel_values.nbytes
                self._bytes += pixel_values.nbytes
            self._evict()
            return img.ids

    @property
    def held_bytes(self) -> int:
        """What the table holds: pixels, pixel values, features, ids (a figure for tests)."""
        return self._bytes

    def _entry(self, key: bytes, n: int, grid: tuple[int, int, int] | None,
               plain: list[int]) -> _Image:
        """Under the lock: the image's entry, used now; a new one holds its ids alone.
        `plain`: its ids by the plain derivation."""
        img = self._images.get(key)
        if img is not None:
            img.used = time.monotonic()
            self._images.move_to_end(key)
            return img
        ids = self._free_ids(key, n, plain)
        for i, vid in enumerate(ids):
            self._where[vid] = (key, i)
        img = self._images[key] = _Image(None, None, None, ids, time.monotonic(),
                                         ID_BYTES * n, grid)
        self._bytes += img.nbytes
        self._evict()
        return img

    def _free_ids(self, key: bytes, n: int, plain: list[int]) -> list[int]:
        """Under the lock: the first derivation of `key`'s ids that are distinct and unused
        (`plain`, salt 0's, computed already)."""
        for salt in range(MAX_SALTS):
            ids = image_token_ids(key, n, salt) if salt else plain
            if len(set(ids)) == n and self._where.keys().isdisjoint(ids):
                return ids
        raise ValueError(f"no free image token ids for an image of {n} positions beside the "
                         f"{len(self._images)} images held; send it again later")

    def _evict(self) -> None:
        old = time.monotonic() - IMAGE_TTL_S
        while self._bytes > self._max_bytes and self._images:
            key, img = next(iter(self._images.items()))
            if img.used > old:
                return
            del self._images[key]
            self._bytes -= img.nbytes
            for vid in img.ids:
                self._where.pop(vid, None)

    def held(self, key: bytes) -> ImageInput | None:
        """An image the table holds (its entry used now): its pixels as registered, or, once
        its features replaced them, an image without pixels (nothing needs them then); None:
        not held, or only its ids (a request refused after its prompt was built)."""
        try:
            faults.hit("engine.vision.held")  # tests: `fail` is a table that forgot it
        except faults.FaultInjected:
            return None
        with self._lock:
            img = self._images.get(key)
            if img is None or (img.features is None and img.image is None):
                return None
            img.used = time.monotonic()
            self._images.move_to_end(key)
            return img.image if img.image is not None else ImageInput(0, 0, b"", key)

    def encoded_image(self, key: bytes) -> bool:
        """Whether the image's features are here already (an earlier request's admission ran
        its tower): its pixels need no preprocessing."""
        with self._lock:
            img = self._images.get(key)
            return img is not None and img.features is not None

    def encode_now(self, key: bytes) -> None:
        """On an admission lane: run the vision tower for a registered image whose features
        are not there yet, so that the MLX thread's prefill finds them ready. The tower then
        runs beside the decode steps (on the lane thread's own MLX stream), never inside one:
        running rows keep their pace while an image is admitted (issue 36). The table's lock
        is not held meanwhile; an image the MLX thread encoded first is left as it is."""
        with self._lock:
            img = self._images.get(key)
            if img is None or img.features is not None or img.pixel_values is None:
                return
            values, grid = img.pixel_values, img.grid
        encoded = self._tower(values, grid)
        with self._lock:
            if img.features is None and self._images.get(key) is img:
                self._set_features(img, encoded)

    def _tower(self, values: np.ndarray, grid: tuple[int, int, int] | None
               ) -> tuple[mx.array, mx.array | None]:
        faults.hit("engine.vision.encode")  # tests: `delay:MS` is a slow vision tower
        got = self._encode(values, grid)
        feats, deep = got if isinstance(got, tuple) else (got, None)
        mx.eval(feats, *([deep] if deep is not None else []))
        return feats, deep

    def _set_features(self, img: _Image, encoded: tuple[mx.array, mx.array | None]) -> None:
        feats, deep = encoded
        nbytes = feats.nbytes + (deep.nbytes if deep is not None else 0)
        self.encoded += 1
        self._bytes += nbytes - img.nbytes
        img.features, img.deepstack, img.pixel_values, img.image = feats, deep, None, None
        img.nbytes = nbytes

    def locate(self, token: int) -> tuple[int, tuple[int, int, int]] | None:
        """An image token's index in its image and the image's grid (`positions.Locate`);
        None for a text token. An image token of no known image, or of an image without a
        grid, is an error (the table keeps a running row's images: see IMAGE_TTL_S)."""
        if token < VIRTUAL_BASE:
            return None
        with self._lock:
            where = self._where.get(token)
            img = self._images.get(where[0]) if where is not None else None
            if where is None or img is None or img.grid is None:
                raise RuntimeError("an image token of a prompt names no known image")
            return where[1], img.grid

    def embed(self, inputs: mx.array, embed_tokens: Any) -> mx.array | None:
        """On the MLX thread: the input embeddings of `inputs` (batch, length) with image
        features in place of image token ids, or None when there are none."""
        fed = self.feed(inputs, embed_tokens)
        return fed.embeds if fed is not None else None

    def feed(self, inputs: mx.array, embed_tokens: Any) -> Fed | None:
        """On the MLX thread: what a forward pass over `inputs` (batch, length) is fed for its
        image tokens (`Fed`), or None when there are none. Sampled tokens (uint32, decode
        steps) are never image tokens and are not even looked at. Each image token takes the
        features of its image's position, whichever pass, chunk or cached prefix holds the
        image's other positions: so do its DeepStack features."""
        if inputs.dtype == mx.uint32:
            return None
        ids = np.array(inputs)
        virtual = ids >= VIRTUAL_BASE
        if not virtual.any():
            return None
        rows = np.zeros(ids.shape, dtype=np.int32)
        tables: list[mx.array] = []
        deeps: list[mx.array | None] = []
        offsets: dict[bytes, int] = {}
        total = 0
        with self._lock:
            for pos in zip(*np.nonzero(virtual), strict=True):
                where = self._where.get(int(ids[pos]))
                if where is None:
                    raise RuntimeError("an image token of a prompt names no known image")
                key, i = where
                if key not in offsets:
                    feats, deep = self._features(key)
                    offsets[key] = total
                    tables.append(feats)
                    deeps.append(deep)
                    total += feats.shape[0]
                rows[pos] = offsets[key] + i
        base = embed_tokens(mx.array(np.where(virtual, 0, ids)))
        table = mx.concatenate(tables) if len(tables) > 1 else tables[0]
        feats = table[mx.array(rows)].astype(base.dtype)
        mask = mx.array(virtual)
        embeds = mx.where(mask[..., None], feats, base)
        present = [d for d in deeps if d is not None]
        if not present:
            return Fed(embeds)
        if len(present) != len(deeps):
            raise RuntimeError("an image without DeepStack features in a DeepStack model")
        deep_table = mx.concatenate(present, axis=1) if len(present) > 1 else present[0]
        # row-major over (batch, length): the order the language model adds them in
        return Fed(embeds, mask, deep_table[:, mx.array(rows[virtual])].astype(base.dtype))

    def _features(self, key: bytes) -> tuple[mx.array, mx.array | None]:
        img = self._images[key]
        img.used = time.monotonic()
        if img.features is None:
            if img.pixel_values is None:  # a cache covered it at admission, not any more
                assert img.image is not None
                img.pixel_values = self.preprocess(img.image)
            self._set_features(img, self._tower(img.pixel_values, img.grid))
        assert img.features is not None
        return img.features, img.deepstack
