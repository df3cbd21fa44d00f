"""Reranking (`/v1/rerank`, `/v2/rerank`, `/rerank`) in the shape Cohere's and Jina's clients
share, over the neutral embedding request (`proxy/core/embedding.py`); runs in the proxy."""
