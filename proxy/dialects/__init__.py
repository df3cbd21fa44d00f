"""The API dialects the proxy speaks, one package each: OpenAI, Anthropic, Ollama."""
