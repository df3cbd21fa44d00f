"""The proxy: the HTTP APIs (OpenAI, Anthropic, Ollama) in, engine requests out. It runs as its
own process under `--isolate` (`python -m mlxd.proxy`), else on the serving process's event loop."""
