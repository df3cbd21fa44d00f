"""One embedding request, whatever the dialect (runs in the proxy): the engine of the named
model (an embedding model's, or a causal LM's), one `Embed` sent, its `Embeddings` awaited.
Embedding keeps no state, so a request whose engine dies is sent again to the restarted engine,
once (unless resume is off); a second death fails it. Dialects check their bodies first (bad
input never reaches the router) and render the result."""

from __future__ import annotations

import array
import base64
import json
import sys
import time
from dataclasses import dataclass, field

import msgspec

from mlxd.protocol.messages import Embed, Embeddings
from mlxd.protocol.models import local_model_dir, model_id
from mlxd.proxy.core.generation import RECONNECT_POLL, _delta_error, new_request_id
from mlxd.proxy.engines.client import EngineClient, EngineGone, EngineRecord, RequestStream
from mlxd.proxy.errors import APIError, bad_request, unavailable
from mlxd.proxy.state import ProxyState

MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit)


@dataclass(frozen=True, kw_only=True)
class EmbeddingRequest:
    """What to embed in no dialect's words: texts, or token ids, and how."""
    model: str | None
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    truncate: bool = False  # cut an input longer than the model takes (else a 400)
    dimensions: int = 0  # keep the first `dimensions` of each vector, renormalized (0: all)
    keep_alive: float | None = None
    query: str | None = None  # rerank: `texts` are documents scored against it

    def engine_message(self) -> Embed:
        return Embed(new_request_id("embd"), inputs=self.texts, input_token_ids=self.token_ids,
                     truncate=self.truncate, dimensions=self.dimensions, query=self.query)


@dataclass(frozen=True)
class EmbeddingResult:
    model_id: str
    # (inputs x dimensions) little-endian float32, a vector after another, as the engine sent
    # them (read without numpy: the proxy stays small, 14 MB less)
    vectors: bytes
    count: int
    dimensions: int
    prompt_tokens: int
    total_s: float  # from the request's arrival at the router to the vectors
    load_s: float  # of which waiting for the model to load

    def floats(self) -> list[list[float]]:
        values = array.array("f", self.vectors)
        if sys.byteorder != "little":
            values.byteswap()
        flat, d = values.tolist(), self.dimensions
        return [flat[i * d:(i + 1) * d] for i in range(self.count)]

    def base64(self) -> list[str]:
        """Each vector's little-endian float32 bytes in base64 (what the openai SDK asks for
        by default and decodes with numpy)."""
        row = 4 * self.dimensions
        return [base64.b64encode(self.vectors[i * row:(i + 1) * row]).decode()
                for i in range(self.count)]


async def embed(state: ProxyState, req: EmbeddingRequest) -> EmbeddingResult:
    router = state.router
    t0 = time.monotonic()
    if req.query is not None:
        check_may_rerank(router.lookup(req.model))
    engine = await router.acquire(req.model)
    t_loaded = time.monotonic()
    try:
        if req.query is not None:
            check_reranks(engine)
        got = await _run(state.client, engine, req.engine_message(), state.resume,
                         router.load_wait)
    finally:
        await router.release(engine, req.keep_alive)
    if len(got.vectors) != 4 * got.count * got.dimensions:
        raise ValueError(f"the engine sent {len(got.vectors)} bytes for {got.count} vectors of "
                         f"{got.dimensions} dimensions")
    return EmbeddingResult(engine.model_id, bytes(got.vectors), got.count, got.dimensions,
                           got.prompt_tokens,
                           time.monotonic() - t0, t_loaded - t0)


async def load_only(state: ProxyState, model: str | None, keep_alive: float | None) -> str:
    """An empty request loads the model (Ollama's way); its id."""
    engine = await state.router.acquire(model)
    await state.router.release(engine, keep_alive)
    return engine.model_id


async def _run(client: EngineClient, engine: EngineRecord, msg: Embed, resume: bool,
               load_wait: float) -> Embeddings:
    retried = False
    while True:
        stream = await _submit(client, engine, msg, load_wait)
        try:
            d = await stream.queue.get()
        finally:
            if not stream.finished:  # the client went away: the engine may drop it
                await client.abort(stream)
        if stream.embeddings is not None:
            return stream.embeddings
        if d.error_code == "engine_crashed" and resume and not retried \
                and await client.wait_serving(engine, stream.epoch, load_wait):
            retried = True
            msg = msgspec.structs.replace(msg, request_id=new_request_id("embd"))
            continue
        raise _delta_error(d)


async def _submit(client: EngineClient, engine: EngineRecord, msg: Embed,
                  load_wait: float) -> RequestStream:
    """Send; an engine not reachable yet (dying, or still connecting to a respawned proxy) is
    tried again as its state changes, for up to `load_wait`."""
    deadline = time.monotonic() + load_wait
    why = f"the engine serving {engine.model_id} is {engine.state}"
    while True:
        if engine.state == "ready":
            try:
                return await client.submit(engine, msg)
            except EngineGone as e:
                why = str(e)
        left = deadline - time.monotonic()
        if left <= 0 or engine.state == "failed" \
                or client.engines.get(engine.engine_id) is not engine:
            raise unavailable(why, "engine_unavailable")
        await client.wait_change(engine, min(left, RECONNECT_POLL))


def check_may_rerank(spec: str) -> None:
    """A local model directory whose config.json names no sequence-classification
    architecture cannot rerank: refused before it is loaded, so nothing is evicted for it."""
    path = local_model_dir(spec)
    try:
        config = json.loads((path / "config.json").read_text()) if path else None
    except (OSError, ValueError):
        return  # the load says what is wrong with it
    if isinstance(config, dict) and not any(
            str(a).endswith("ForSequenceClassification")
            for a in config.get("architectures") or []):
        raise _cannot_rerank(model_id(spec))


def check_reranks(engine: EngineRecord) -> None:
    """A rerank asked of an engine without a one-label classifier head (the model's
    capabilities, known once loaded) is a 400 here: the engine never sees it."""
    if "rerank" not in (engine.status.capabilities if engine.status else []):
        raise _cannot_rerank(engine.model_id)


def _cannot_rerank(model: str) -> APIError:
    return bad_request(f"{model} cannot rerank: it is not a cross-encoder (a "
                       "sequence-classification model with one label)",
                       code="model_not_supported", param="model")


def check_dimensions(dimensions: int | None) -> int:
    if dimensions is None:
        return 0
    if dimensions < 1:
        raise APIError(400, "`dimensions` must be at least 1", param="dimensions")
    return dimensions
