"""Putting a lone row back after a verify pass that fed more tokens than were accepted, for
layers that cannot be trimmed: a sliding window that has wrapped (`BatchRotatingKVCache`) and
recurrent states (`ArraysCache`) hold no earlier position to cut back to. Their state is saved
before the verify pass (a few array references: the pass builds new arrays rather than
writing the old ones, and the small ones are copied), restored after it, and the accepted
tokens are fed again, so the row is exactly where as many plain steps would have left it.
That costs a second forward pass over the accepted tokens whenever a draft is rejected; the
speculation policy times it with the step, so drafting stops where it does not pay. Plain KV
layers are trimmed as before (and fed the accepted tokens again with the rest)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache

from mlxd.engine.mlx_lm_internals import device_async_eval, restore_states, save_states

SPECULABLE = (BatchKVCache, BatchRotatingKVCache, ArraysCache)


def speculable(cache: list[Any]) -> bool:
    """Whether every layer of a row's batch cache can be trimmed or rewound."""
    return all(type(c) in SPECULABLE for c in cache)


def needs_rewind(cache: list[Any]) -> bool:
    return any(type(c) is not BatchKVCache for c in cache)


class Rewind:
    """Saved before a verify pass feeding `fed`; calling it with `kept` leaves the row as if
    only `fed[:kept]` had been fed."""

    def __init__(self, model: Any, cache: list[Any], fed: list[int]) -> None:
        self.model, self.cache, self.fed = model, cache, fed
        self.saved = save_states(cache)

    def __call__(self, kept: int) -> None:
        restore_states(self.cache, self.saved)
        for c in self.cache:
            if type(c) is BatchKVCache:
                c.trim(len(self.fed))
        if kept:
            self.model(mx.array([self.fed[:kept]], dtype=mx.uint32), cache=self.cache)
            device_async_eval([c.state for c in self.cache])
