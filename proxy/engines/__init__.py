"""Talking to engines (runs in the proxy): the engine channel, names to engines, the LRU model
pool, whether a model can load. Imports neither `proxy/core/` nor a dialect."""
