"""Embedding request bodies (OpenAI's and Ollama's) as msgspec Structs, and their translation
into the neutral `EmbeddingRequest` (runs in the proxy). Every optional field takes an explicit
null, meaning what leaving it out means."""

from __future__ import annotations

from typing import Literal

import msgspec

from mlxd.proxy.bounds import Duration, Ident, ModelName, Seconds, SmallInt, TokenId
from mlxd.proxy.core.embedding import MAX_INPUTS, EmbeddingRequest, check_dimensions
from mlxd.proxy.core.validation import keep_alive_seconds
from mlxd.proxy.errors import bad_request


class OpenAIEmbeddingRequest(msgspec.Struct, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    input: str | list[str | TokenId | list[TokenId]]
    model: ModelName | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: SmallInt | None = None
    user: Ident | None = None
    keep_alive: Seconds | Duration | None = None  # mlxd's, as in the other endpoints


class OllamaEmbedRequest(msgspec.Struct, kw_only=True):
    """`/api/embed`."""
    model: ModelName
    input: str | list[str] | None = None
    truncate: bool | None = None  # Ollama's default: true
    dimensions: SmallInt | None = None
    options: dict | None = None  # Ollama's runner options: ignored, as for generation
    keep_alive: Seconds | Duration | None = None


class OllamaEmbeddingsRequest(msgspec.Struct, kw_only=True):
    """`/api/embeddings` (Ollama's older endpoint: one prompt)."""
    model: ModelName
    prompt: str | None = None
    options: dict | None = None
    keep_alive: Seconds | Duration | None = None


def openai_request(req: OpenAIEmbeddingRequest) -> EmbeddingRequest:
    """OpenAI's `input`: every string non-empty, token ids all of one shape."""
    keep_alive = keep_alive_seconds(req.keep_alive)
    dimensions = check_dimensions(req.dimensions)
    raw = [req.input] if isinstance(req.input, str) else req.input
    if not raw:
        raise bad_request("`input` must not be empty", param="input")
    texts: list[str] = []
    ids: list[list[int]] = []
    if all(isinstance(x, int) for x in raw):
        ids = [[x for x in raw if isinstance(x, int)]]
    elif all(isinstance(x, list) for x in raw):
        ids = [x for x in raw if isinstance(x, list)]
    elif all(isinstance(x, str) for x in raw):
        texts = [x for x in raw if isinstance(x, str)]
    else:
        raise bad_request("`input` must be a string, a list of strings, a list of token ids "
                          "or a list of lists of token ids", param="input")
    _check_inputs(texts or ids)
    return EmbeddingRequest(model=req.model, texts=texts, token_ids=ids, dimensions=dimensions,
                            keep_alive=keep_alive)


def ollama_embed_request(req: OllamaEmbedRequest) -> EmbeddingRequest:
    """`/api/embed`: Ollama truncates long inputs unless `truncate` is false."""
    keep_alive = keep_alive_seconds(req.keep_alive)
    dimensions = check_dimensions(req.dimensions)
    texts = [req.input] if isinstance(req.input, str) else list(req.input or [])
    if texts:
        _check_inputs(texts)
    return EmbeddingRequest(model=req.model, texts=texts, truncate=req.truncate is not False,
                            dimensions=dimensions, keep_alive=keep_alive)


def ollama_embeddings_request(req: OllamaEmbeddingsRequest) -> EmbeddingRequest:
    keep_alive = keep_alive_seconds(req.keep_alive)
    texts = [req.prompt] if req.prompt else []
    return EmbeddingRequest(model=req.model, texts=texts, truncate=True, keep_alive=keep_alive)


def _check_inputs(inputs: list[str] | list[list[int]]) -> None:
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"`input` holds {len(inputs)} inputs; at most {MAX_INPUTS} are "
                          "accepted in one request", param="input")
    for i, x in enumerate(inputs):
        if not x:
            raise bad_request(f"input[{i}] is empty", param="input")
