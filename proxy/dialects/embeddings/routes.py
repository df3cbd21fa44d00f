"""`POST /v1/embeddings` (OpenAI), `/api/embed` and `/api/embeddings` (Ollama): bodies checked,
one neutral embedding run, the vectors in each API's shape (runs in the proxy)."""

from __future__ import annotations

from aiohttp import web

from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core.embedding import embed, load_only
from mlxd.proxy.dialects.embeddings.schema import (
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OpenAIEmbeddingRequest,
    ollama_embed_request,
    ollama_embeddings_request,
    openai_request,
)
from mlxd.proxy.state import STATE


async def openai_embeddings(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), OpenAIEmbeddingRequest)
    job = openai_request(req)
    got = await embed(request.app[STATE], job)
    vectors = got.base64() if req.encoding_format == "base64" else got.floats()
    return web.json_response({
        "object": "list", "model": got.model_id,
        "data": [{"object": "embedding", "index": i, "embedding": v}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": got.prompt_tokens, "total_tokens": got.prompt_tokens}})


async def ollama_embed(request: web.Request) -> web.Response:
    job = ollama_embed_request(decode_body(await request.read(), OllamaEmbedRequest))
    state = request.app[STATE]
    if not job.texts:  # Ollama: an empty input loads the model
        model = await load_only(state, job.model, job.keep_alive)
        return web.json_response({"model": model, "embeddings": []})
    got = await embed(state, job)
    return web.json_response({
        "model": got.model_id, "embeddings": got.floats(),
        "total_duration": int(got.total_s * 1e9), "load_duration": int(got.load_s * 1e9),
        "prompt_eval_count": got.prompt_tokens})


async def ollama_embeddings(request: web.Request) -> web.Response:
    job = ollama_embeddings_request(decode_body(await request.read(), OllamaEmbeddingsRequest))
    state = request.app[STATE]
    if not job.texts:  # Ollama: an empty prompt loads the model
        await load_only(state, job.model, job.keep_alive)
        return web.json_response({"embedding": []})
    got = await embed(state, job)
    return web.json_response({"embedding": got.floats()[0]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/api/embed", ollama_embed)
    app.router.add_post("/api/embeddings", ollama_embeddings)
