"""OpenAI's API: chat completions, completions, models (runs in the proxy)."""
