"""What the runner hands to the KV tiers: a finished request's history and its prompt
boundary into the RAM tier (and from there to the SSD tier), a prompt a leader prefilled for
its followers, the state snapshots a prompt leaves on its way (models with fixed-size state
layers), generation checkpoints (SSD only). On the MLX thread; the SSD tier's share is
queued during a step and handed over in one call once its tokens are out.

Everything stored is evaluated when it is stored (`mx.async_eval`): what a tier holds is then
its own arrays, not a graph that keeps the batch it was cut from alive (`codec.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd.engine.kv.codec import CacheCodec, Held, State, kv_nbytes, kv_slice, nbytes, state_arrays
from mlxd.engine.kv.prefix_cache import Entry, PrefixCache


class Publisher:
    def __init__(self, cache: PrefixCache, codec: CacheCodec,
                 persist: Callable[[list[Entry]], Any] | None) -> None:
        """`persist(entries)` queues KV entries' blocks for the SSD tier (None: no tier)."""
        self.cache = cache
        self.codec = codec
        self.persist = persist
        self._pending: list[Entry] = []  # this step's new RAM entries, persisted at its end
        self._too_big = False  # the last `store` was refused for its size (not evicted)

    def history(self, tokens: list[int], cache: list[Any], prompt_len: int = 0,
                snaps: dict[int, list[State]] | None = None, kept: bool = False) -> None:
        """A request's history into the RAM tier, with the snapshots its row took on the way
        (`snaps`, by position), a session's entry if `kept` (`keep_policy.py`); to the SSD
        tier the history and the prompt boundary (a tail block ending with the prompt, or its
        snapshot), so that repeating the same prompt after a restart is served whole, not just
        its full blocks."""
        held = self.codec.take(cache, len(tokens)) if tokens else None
        if held is None:
            return
        n = held.n
        states: dict[int, list[State]] = {}
        if self.codec.has_state:
            states = {p: s for p, s in (snaps or {}).items() if 0 < p < n}
            states[n] = held.states
        entry = self.store(list(tokens[:n]), held.layers, states, kept)
        if self.persist is None:
            return
        if entry is not None and not entry.persisted:
            self._pending.append(entry)
        elif entry is None and states and (self._too_big or self.cache.on_evict is None):
            # too big for RAM: the SSD tier may still take it (a one-off evicted at once was
            # offered to the tier by the eviction already)
            self._pending.append(Entry(tuple(tokens[:n]), held.layers, 0, states=states))
        # One token short of the prompt: a lookup uses at most len(prompt) - 1 tokens (one is
        # always fed), so this is the boundary the same prompt, repeated, can use whole. (A
        # model with state layers has its snapshot there among `states`.)
        cut = prompt_len - 1
        if not self.codec.has_state and 0 < cut < n:
            boundary = [(kv_slice(k, cut), kv_slice(v, cut)) for k, v in held.layers]
            self._pending.append(Entry(tuple(tokens[:cut]), boundary, 0))

    def store(self, tokens: list[int], layers: list[tuple[Any, Any]],
              states: dict[int, list[State]], kept: bool = False) -> Entry | None:
        """Into the RAM tier, evaluated (the arrays a tier counts are the arrays it holds).
        None: not held (too big, or a one-off evicted at once: it went to the SSD tier)."""
        mx.async_eval([a for k, v in layers for x in (k, v)
                       for a in (x if isinstance(x, tuple) else (x,))]
                      + [a for s in states.values() for a in state_arrays(s)])
        kv, state_bytes = kv_nbytes(layers), {p: nbytes(state_arrays(s))
                                              for p, s in states.items()}
        self._too_big = kv + sum(state_bytes.values()) > self.cache.max_bytes
        return self.cache.insert(tokens, layers, kv, states, state_bytes, kept)

    def prompt_point(self, tokens: list[int], cache: list[Any]) -> Held | None:
        """A row stopped at a point of its prompt: the state layers' snapshot there (models
        with state layers), kept by the row until it ends; the SSD tier gets the point now
        (its KV and its snapshot), so that a restarted engine resumes from it."""
        held = self.codec.take(cache, len(tokens))
        if held is None or held.n != len(tokens):
            return None
        if held.states:
            mx.async_eval(state_arrays(held.states))
        if self.persist is not None:
            self._pending.append(Entry(tuple(tokens), held.layers, 0,
                                       states={held.n: held.states} if held.states else {}))
        return held

    def checkpoints(self, extracted: list[tuple[list[Any], list[int]]]) -> int:
        """--generation-checkpoint: running requests' boundaries (prompt and generated so
        far) go to the SSD tier only (not RAM: they are still live). Only blocks the disk
        lacks are copied. The checkpoints taken."""
        assert self.persist is not None  # without it the runner takes none
        entries = []
        for cache, tokens in extracted:
            held = self.codec.take(cache, len(tokens))
            if held is None:
                continue
            entries.append(Entry(tuple(tokens[:held.n]), held.layers, 0,
                                 states={held.n: held.states} if held.states else {}))
        self.persist(entries)
        return len(entries)

    def hand_over(self) -> None:
        """The step's new RAM entries to the SSD tier in one call, after its tokens are out
        (every step while the tier has entries to finish: `SsdTier.persist_all`)."""
        if self.persist is not None:
            entries, self._pending = self._pending, []
            self.persist(entries)


def shared_prefix(codec: CacheCodec, cache: list[Any], tokens: list[int],
                  snap: tuple[int, list[State]] | None) -> tuple[Held, list[int]] | None:
    """What a prefill group's members start from, out of the leader's cache at its prompt's
    end: its layers (and, with state layers, its snapshot one token short of the prompt,
    `snap`: the position a member, fed its last token, can use)."""
    if not codec.has_state:
        held = codec.take(cache, len(tokens))
        return None if held is None else (held, list(tokens[:held.n]))
    if snap is None:
        return None
    p, states = snap
    held = codec.take(cache, len(tokens), states=False)
    if held is None or held.n < p:
        return None
    return Held(p, [(kv_slice(k, p), kv_slice(v, p)) for k, v in held.layers], states), \
        list(tokens[:p])
