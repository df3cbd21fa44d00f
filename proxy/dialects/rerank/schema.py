"""The rerank request body as a msgspec Struct: Cohere's (v1 and v2) and Jina's are one shape
(`query`, `documents` as strings or `{"text": ...}` objects, `top_n`, `return_documents`), so
one Struct takes both. Every optional field takes an explicit null (runs in the proxy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from mlxd.proxy.bounds import Duration, ModelName, Seconds, SmallInt
from mlxd.proxy.core.embedding import EmbeddingRequest
from mlxd.proxy.core.validation import keep_alive_seconds
from mlxd.proxy.errors import bad_request

MAX_DOCUMENTS = 1000  # Cohere's and Voyage's limit for one request
MAX_TEXT_CHARS = 262_144  # far beyond a cross-encoder's context; documents are cut to fit it
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]


class RerankDocument(msgspec.Struct):
    """Cohere v1's and Jina's document object; other fields (a title...) are ignored."""
    text: Text


class RerankRequest(msgspec.Struct, kw_only=True):
    query: Text
    documents: Annotated[list[Text | RerankDocument], msgspec.Meta(max_length=MAX_DOCUMENTS)]
    model: ModelName | None = None
    top_n: SmallInt | None = None
    return_documents: bool | None = None  # Jina's default, true (Cohere v1's was false)
    keep_alive: Seconds | Duration | None = None  # mlxd's, as in the other endpoints


@dataclass(frozen=True)
class RerankJob:
    request: EmbeddingRequest
    documents: list[str]
    top_n: int  # results kept, best first
    return_documents: bool


def rerank_job(req: RerankRequest) -> RerankJob:
    keep_alive = keep_alive_seconds(req.keep_alive)
    if not req.documents:
        raise bad_request("`documents` must not be empty", param="documents")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request("`top_n` must be at least 1", param="top_n")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    top_n = len(docs) if req.top_n is None else min(req.top_n, len(docs))
    job = EmbeddingRequest(model=req.model, texts=docs, query=req.query, keep_alive=keep_alive)
    return RerankJob(job, docs, top_n, req.return_documents is not False)
