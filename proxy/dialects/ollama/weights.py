"""What Ollama's `/api/tags`, `/api/show` and `/api/ps` say of a model's weights (runs in the
proxy): `digest`, a sha256 over the bytes of its weight files, and `details` (parameter count,
quantization level, family, format) from its config.json and the safetensors headers.

Hashing gigabytes takes seconds to minutes, so a digest is computed once per file identity
(path, size, mtime_ns of every weight file: a file replaced under the same name is hashed
again), on a worker thread, with concurrent asks for the same identity sharing one run. A
listing waits for it at most DIGEST_WAIT_S: clients poll `/api/tags` with short timeouts
(Open WebUI's is seconds), so a model whose hash is still running is listed with an empty
digest, and with its digest once the run (which goes on) is done."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

READ_CHUNK = 4 << 20  # bytes per hash update (hashlib lets go of the GIL for large updates)
MAX_HEADER = 100 << 20  # a safetensors JSON header larger than this is not read
MAX_REMEMBERED = 64  # file identities whose digest is kept
DIGEST_WAIT_S = 3.0

Identity = tuple[tuple[str, int, int], ...]


def weight_files(model_dir: Path) -> list[Path]:
    """A model directory's weight files; none for a name that is no absolute path (a repo id
    not fetched yet is no directory, whatever the proxy's working directory holds)."""
    if not model_dir.is_absolute():
        return []
    return sorted(model_dir.glob("*.safetensors"))


def identity(model_dir: str) -> Identity:
    """The weight files as (path, size, mtime_ns); empty when there are none (blocking)."""
    out = []
    try:
        for p in weight_files(Path(model_dir).expanduser()):
            st = p.stat()
            out.append((str(p), st.st_size, st.st_mtime_ns))
    except OSError:
        return ()
    return tuple(out)


def sha256_of(ident: Identity) -> str:
    """sha256 over the weight files' bytes, in name order (blocking: a worker thread)."""
    h = hashlib.sha256()
    for path, _, _ in ident:
        with open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                h.update(chunk)
    return h.hexdigest()


class Digests:
    """Weight digests by file identity: computed once, off the event loop."""

    def __init__(self) -> None:
        self._done: OrderedDict[Identity, str] = OrderedDict()
        self._running: dict[Identity, asyncio.Future[str]] = {}

    async def of(self, model_dir: str, wait: float = DIGEST_WAIT_S) -> str:
        """The digest of the weights in `model_dir` ("" when it holds none, e.g. a repo id
        not fetched yet, or while it is being computed and `wait` seconds have passed)."""
        ident = await asyncio.to_thread(identity, model_dir)
        if not ident:
            return ""
        if ident in self._done:
            self._done.move_to_end(ident)
            return self._done[ident]
        fut = self._running.get(ident)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(sha256_of, ident))
            self._running[ident] = fut
            fut.add_done_callback(lambda f: self._finished(ident, f))
        try:
            digest = await asyncio.wait_for(asyncio.shield(fut), wait)
        except (OSError, TimeoutError):  # a file went away while it was read; still running
            return ""
        return digest

    def _finished(self, ident: Identity, fut: asyncio.Future[str]) -> None:
        """Keep a finished run's digest, whether or not anyone still waits for it."""
        self._running.pop(ident, None)
        if not fut.cancelled() and fut.exception() is None:
            self._done[ident] = fut.result()
            while len(self._done) > MAX_REMEMBERED:
                self._done.popitem(last=False)


DIGESTS = web.AppKey("ollama_digests", Digests)


@dataclass(frozen=True)
class Tensors:
    parameters: int  # quantized weights counted unpacked
    dtype: str  # the safetensors dtype holding most parameters ("F16", "BF16", ...)


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return {}
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            return {}
        head = json.loads(f.read(n))
    return head if isinstance(head, dict) else {}


def _bits(value: object) -> int | None:
    return value if isinstance(value, int) and 0 < value <= 32 else None


def tensors(model_dir: str, quant: dict) -> Tensors:
    """Parameters and dtype from the safetensors headers (blocking; reads headers only). An
    MLX-quantized weight (uint32 words beside `.scales`) holds 32 / bits parameters a word,
    `bits` being its layer's own (config.json's `quantization` may name layers: an 8-bit
    embedding beside 4-bit layers); its scales and biases are not parameters of the model."""
    default = _bits(quant.get("bits"))
    count = 0
    by_dtype: dict[str, int] = {}
    for path in weight_files(Path(model_dir).expanduser()):
        try:
            head = _header(path)
        except (OSError, ValueError):
            continue
        for name, t in head.items():
            if name == "__metadata__" or not isinstance(t, dict):
                continue
            shape, dtype = t.get("shape"), t.get("dtype")
            if not isinstance(shape, list) or not isinstance(dtype, str):
                continue
            n = math.prod(int(d) for d in shape if isinstance(d, int))
            stem = name.rsplit(".", 1)[0]
            layer = quant.get(stem)
            bits = _bits(layer.get("bits")) if isinstance(layer, dict) else default
            if bits is not None and f"{stem}.scales" in head:
                if dtype == "U32":  # packed words
                    count += n * 32 // bits
                if dtype == "U32" or name.endswith((".scales", ".biases")):
                    continue
            count += n
            by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return Tensors(count, max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "")


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it (`format.HumanNumber`): 8B, 1.2B, 134.52M."""
    for unit, size, places in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.{places}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def details(model_dir: str, cfg: dict) -> dict:
    """Ollama's `details` (blocking: reads the safetensors headers)."""
    family = cfg.get("model_type", "") if isinstance(cfg.get("model_type"), str) else ""
    quant = cfg.get("quantization") or cfg.get("quantization_config") or {}
    quant = quant if isinstance(quant, dict) else {}
    bits = _bits(quant.get("bits"))
    t = tensors(model_dir, quant)
    return {"parent_model": "", "format": "mlx", "family": family,
            "families": [family] if family else None,
            "parameter_size": human_number(t.parameters) if t.parameters else "",
            "quantization_level": f"Q{bits}" if bits else t.dtype}
