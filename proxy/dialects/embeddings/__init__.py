"""Embeddings in OpenAI's words (`/v1/embeddings`) and Ollama's (`/api/embed`,
`/api/embeddings`), over one neutral request (`proxy/core/embedding.py`); runs in the proxy."""
