"""`POST /v1/rerank` (Jina, Cohere v1, vLLM, llama.cpp), `/v2/rerank` (Cohere v2) and `/rerank`:
one response every one of those clients reads: `results` best first, each `index`,
`relevance_score` and (unless `return_documents` is false) `document: {"text"}`; Jina's and
OpenAI-style `usage`, Cohere's `meta` (runs in the proxy)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core.embedding import embed
from mlxd.proxy.core.generation import new_request_id
from mlxd.proxy.dialects.rerank.schema import RerankRequest, rerank_job
from mlxd.proxy.state import STATE


async def rerank(request: web.Request) -> web.Response:
    job = rerank_job(decode_body(await request.read(), RerankRequest))
    got = await embed(request.app[STATE], job.request)
    scores = [row[0] for row in got.floats()]
    # a stable sort: equal scores keep the documents' order
    best = sorted(range(len(scores)), key=lambda i: -scores[i])[:job.top_n]
    results: list[dict[str, Any]] = []
    for i in best:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if job.return_documents:
            result["document"] = {"text": job.documents[i]}
        results.append(result)
    tokens = got.prompt_tokens
    return web.json_response({
        "id": new_request_id("rerank"), "model": got.model_id, "results": results,
        "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                 "tokens": {"input_tokens": tokens, "output_tokens": 0}},
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def add_routes(app: web.Application) -> None:
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        app.router.add_post(path, rerank)
