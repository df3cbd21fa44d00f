"""Ollama's API (runs in the proxy)."""
