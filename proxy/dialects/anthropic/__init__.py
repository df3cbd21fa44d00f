"""Anthropic's Messages API (runs in the proxy)."""
