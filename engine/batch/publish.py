"""What the runner hands to the KV tiers: a finished request's history and its prompt
boundary into the RAM tier (and from there to the SSD tier), a prompt a leader prefilled for
its followers, generation checkpoints (SSD only). On the MLX thread; the SSD tier's share is
queued during a step and handed over in one call once its tokens are out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxd.engine.kv import quant as kv_quant
from mlxd.engine.kv.prefix_cache import Entry, PrefixCache


class Publisher:
    def __init__(self, cache: PrefixCache,
                 persist: Callable[[list[Entry]], Any] | None) -> None:
        """`persist(entries)` queues KV entries' blocks for the SSD tier (None: no tier)."""
        self.cache = cache
        self.persist = persist
        self._pending: list[Entry] = []  # this step's new RAM entries, persisted at its end

    def history(self, tokens: list[int], cache: list[Any], prompt_len: int = 0) -> None:
        """A request's history into the RAM tier; to the SSD tier both the history and the
        prompt boundary (a tail block ending with the prompt), so that repeating the same
        prompt after a restart is served whole, not just its full blocks."""
        held = kv_quant.cache_layers(cache, len(tokens)) if tokens else None
        if held is None:
            return
        layers, n = held
        entry = self.cache.insert(list(tokens[:n]), layers, kv_quant.kv_nbytes(layers))
        if self.persist is None:
            return
        if entry is not None and not entry.persisted:
            self._pending.append(entry)
        # One token short of the prompt: a lookup uses at most len(prompt) - 1 tokens (one is
        # always fed), so this is the boundary the same prompt, repeated, can use whole.
        cut = prompt_len - 1
        if 0 < cut < n:
            boundary = [(kv_quant.kv_slice(k, cut), kv_quant.kv_slice(v, cut))
                        for k, v in layers]
            self._pending.append(Entry(tuple(tokens[:cut]), boundary, 0))

    def checkpoints(self, extracted: list[tuple[list[Any], list[int]]]) -> int:
        """--generation-checkpoint: running requests' boundaries (prompt and generated so
        far) go to the SSD tier only (not RAM: they are still live). Only blocks the disk
        lacks are copied. The checkpoints taken."""
        assert self.persist is not None  # without it the runner takes none
        entries = []
        for cache, tokens in extracted:
            held = kv_quant.cache_layers(cache, len(tokens))
            if held is None:
                continue
            layers, n = held
            entries.append(Entry(tuple(tokens[:n]), layers, 0))
        self.persist(entries)
        return len(entries)

    def hand_over(self) -> None:
        """The step's new RAM entries to the SSD tier in one call, after its tokens are out."""
        if self._pending:
            entries, self._pending = self._pending, []
            assert self.persist is not None
            self.persist(entries)
