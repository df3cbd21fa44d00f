"""The RAM tier: KV checkpoints keyed by exact token prefix, longest usable prefix match,
byte-capped LRU. A hit lends the stored arrays (MLX arrays are immutable, so new cache objects
over the same buffers leave the donor intact); nothing is deep-copied per hit, unlike mlx-lm's
LRUPromptCache.

The index (a token trie) is guarded by a lock so that the I/O thread may ask how much a prompt
would hit while the MLX thread inserts and evicts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def kv_slice(x: Any, n: int) -> Any:
    """The first `n` tokens of one layer's keys or values: an array (1, kv_heads, T, dim) or,
    with --kv-bits, a triplet of them (packed, scales, biases; engine/kv_quant.py)."""
    if isinstance(x, tuple):
        return tuple(a[..., :n, :] for a in x)
    return x[..., :n, :]


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    layers: list[tuple[Any, Any]]  # per layer (keys, values), each (1, kv_heads, T, head_dim)
    #                                  or, quantized, a triplet (see kv_slice)
    nbytes: int
    persisted: bool = False  # every block of it is on SSD (or queued there)


@dataclass(eq=False)
class RestoredPrefix:
    """KV for a prompt's first `tokens` tokens, read from the SSD tier on an admission lane as
    host arrays (per layer (keys, values), each (1, kv_heads, tokens, head_dim)); the MLX
    thread turns them into MLX arrays."""
    tokens: int
    layers: list[tuple[Any, Any]]
    dtype: str


class _Node:
    __slots__ = ("children", "entry", "any_entry")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None
        self.any_entry: Entry | None = None  # some entry in this subtree: trimmable to here


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int,
                 on_evict: Callable[[Entry], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.on_evict = on_evict  # called before an entry is dropped (persist it first)
        self._root = _Node()
        self._lru: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    # ------------------------------------------------------------------ lookup

    def _match(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """Longest usable prefix: at most len(prompt) - 1 tokens, so one is left to feed."""
        node = self._root
        best: Entry | None = None
        depth = 0
        limit = len(prompt) - 1
        while depth < limit:
            nxt = node.children.get(prompt[depth])
            if nxt is None:
                break
            node = nxt
            depth += 1
        if depth and node.any_entry is not None:
            best = node.any_entry
        return best, depth if best is not None else 0

    def peek(self, prompt: list[int]) -> int:
        """How many prompt tokens a lookup would serve now (no LRU update)."""
        with self._lock:
            return self._match(prompt)[1]

    def lookup(self, prompt: list[int]) -> tuple[list[tuple[Any, Any]], int] | None:
        """Views of the cached K/V for the longest usable prefix, and its length."""
        with self._lock:
            entry, n = self._match(prompt)
            if entry is None:
                self.stats.misses += 1
                return None
            self._lru.move_to_end(entry.tokens)
            self.stats.hits += 1
            if n == len(entry.tokens):
                return list(entry.layers), n
            return [(kv_slice(k, n), kv_slice(v, n)) for k, v in entry.layers], n

    # ------------------------------------------------------------------ insert / evict

    def insert(self, tokens: list[int], layers: list[tuple[Any, Any]], nbytes: int) -> Entry | None:
        if not tokens or nbytes > self.max_bytes:
            return None
        key = tuple(tokens)
        with self._lock:
            old = self._lru.get(key)
            if old is not None:
                self._lru.move_to_end(key)
                return old
            entry = Entry(key, layers, nbytes)
            node = self._root
            node.any_entry = entry
            for t in key:  # one node a token, made only where the path is new
                nxt = node.children.get(t)
                if nxt is None:
                    nxt = node.children[t] = _Node()
                node = nxt
                node.any_entry = entry
            node.entry = entry
            self._lru[key] = entry
            self.nbytes += nbytes
            victims = self._evict_beyond(keep=1)  # the entry just inserted stays
        self._evicted(victims)
        return entry

    def resize(self, max_bytes: int) -> None:
        """A new capacity (the engine's memory share changed): entries beyond it are evicted
        at once, least recently used first, each offered to `on_evict` as an insert's are."""
        with self._lock:
            self.max_bytes = max_bytes
            victims = self._evict_beyond(keep=0)
        self._evicted(victims)

    def _evict_beyond(self, keep: int) -> list[Entry]:
        """Under the lock: least recently used entries unlinked until the cache is within its
        capacity (at least `keep` entries stay)."""
        victims = []
        while self.nbytes > self.max_bytes and len(self._lru) > keep:
            _, victim = self._lru.popitem(last=False)
            self._unlink(victim)
            victims.append(victim)
        return victims

    def _evicted(self, victims: list[Entry]) -> None:
        """Outside the lock: each evicted entry counted and offered to `on_evict`."""
        for v in victims:
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(v)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._lru.values())

    def _unlink(self, entry: Entry) -> None:
        self.nbytes -= entry.nbytes
        path = [self._root]
        node = self._root
        for t in entry.tokens:
            node = node.children[t]
            path.append(node)
        node.entry = None
        for depth in range(len(path) - 1, -1, -1):
            n = path[depth]
            if n.any_entry is entry:
                n.any_entry = n.entry or next(
                    (c.any_entry for c in n.children.values() if c.any_entry is not None), None)
            if depth and n.any_entry is None and not n.children:
                del path[depth - 1].children[entry.tokens[depth - 1]]
