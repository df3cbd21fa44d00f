"""The RAM tier: KV checkpoints keyed by exact token prefix, longest usable prefix match,
byte-capped, evicted as `keep_policy.py` decides (superseded entries at once; one-offs before
the entries of sessions, least recently used first in each). A hit lends the stored arrays
(MLX arrays are immutable, so new cache objects over the same buffers leave the donor intact);
nothing is deep-copied per hit, unlike mlx-lm's LRUPromptCache.

A model whose cache is append-only KV in every layer is served at any prefix an entry shares
with the prompt. A model with fixed-size state layers (sliding windows, recurrent states;
`codec.py`) is `exact`: an entry holds snapshots of those layers at some positions of its
tokens (`Entry.states`), and a hit is the longest of them the prompt starts with; the entry's
append-only layers are sliced to it.

The index (a radix tree of tokens) is guarded by a lock so that the I/O thread may ask how
much a prompt would hit while the MLX thread inserts and evicts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.kv.keep_policy import SUPERSEDE_SLACK, continues, supersedes


def kv_slice(x: Any, n: int) -> Any:
    """The first `n` tokens of one layer's keys or values: an array (1, kv_heads, T, dim) or,
    with --kv-bits, a triplet of them (packed, scales, biases; engine/kv/quant.py)."""
    if isinstance(x, tuple):
        return tuple(a[..., :n, :] for a in x)
    return x[..., :n, :]


# What the tiers hold of a row (made by `codec.py`; plain data here, so that this module and
# its users load without MLX or mlx-lm).

@dataclass(frozen=True)
class Ring:
    """A sliding-window layer at one position: its last min(position, window) tokens' keys and
    values, oldest first, each (1, kv_heads, tokens, head_dim)."""
    keys: Any
    values: Any


@dataclass(frozen=True)
class Arrays:
    """A recurrent layer's state arrays at one position, each (1, ...); None where the layer
    keeps none yet."""
    arrays: tuple[Any, ...]


State = Ring | Arrays


@dataclass
class Held:
    """A row's cache at token position `n`, as the tiers keep it: the append-only layers'
    (keys, values) of `n` tokens and the state layers' snapshots taken at exactly `n`."""
    n: int
    layers: list[tuple[Any, Any]]
    states: list[State] = field(default_factory=list)

    def arrays(self) -> list[Any]:
        out = [a for k, v in self.layers for x in (k, v)
               for a in (x if isinstance(x, tuple) else (x,))]
        return out + state_arrays(self.states)


def state_arrays(states: list[State]) -> list[Any]:
    out: list[Any] = []
    for s in states:
        if isinstance(s, Ring):
            out += [s.keys, s.values]
        else:
            out += [a for a in s.arrays if a is not None]
    return out


def state_nbytes(states: list[State]) -> int:
    return sum(a.nbytes for a in state_arrays(states))



@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    layers: list[tuple[Any, Any]]  # per append-only layer (keys, values), each (1, kv_heads,
    #                                  T, head_dim) or, quantized, a triplet (see kv_slice)
    nbytes: int
    persisted: bool = False  # every block of it is on SSD (or queued there)
    kept: bool = False  # a session's, evicted after the one-offs (keep_policy.py)
    # state layers' snapshots by the position they were taken at (models with such layers)
    states: dict[int, list[State]] = field(default_factory=dict)


@dataclass(eq=False)
class RestoredPrefix:
    """KV for a prompt's first `tokens` tokens, read from the SSD tier on an admission lane as
    host arrays (per append-only layer (keys, values), each (1, kv_heads, tokens, head_dim),
    and the state layers' snapshot at `tokens`); the MLX thread turns them into MLX arrays."""
    tokens: int
    layers: list[tuple[Any, Any]]
    dtype: str
    states: list[Any] = field(default_factory=list)


class _Node:
    """A radix-tree node: `edge` is the run of tokens from its parent to it, so a path of
    thousands of tokens that no other entry shares is one node, matched by one slice
    comparison at C speed (a node per token makes the MLX thread's insert grow with every
    token of a long conversation: benchmarks/RESULTS.md, "KV cache tiers", and
    benchmarks/HISTORY.md section 17)."""
    __slots__ = ("edge", "children", "entry", "any_entry", "marks")

    def __init__(self, edge: tuple[int, ...], any_entry: Entry | None) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}  # by their edge's first token
        self.entry: Entry | None = None  # the entry whose tokens end exactly here
        self.any_entry = any_entry  # some entry in this subtree: trimmable to any depth in it
        self.marks: list[Entry] = []  # (exact caches) entries with a snapshot at this depth


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the common prefix of `a` and `b`: slices compared at C speed, doubling
    from the start, then halving (a mismatch early in a long run costs little). Each slice
    compared starts where the equal part known so far ends, so a mismatch near the end of
    long runs (a conversation's next turn) costs about one pass over them, not one per
    halving (which at 30k tokens was some 6 ms a call)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, 1  # a[:lo] == b[:lo]; a[:hi] != b[:hi] once found
    while hi < n and a[lo:hi] == b[lo:hi]:
        lo, hi = hi, hi * 2
    hi = min(hi, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    superseded: int = 0  # entries dropped for a newer one holding all but their last tokens


class PrefixCache:
    def __init__(self, max_bytes: int,
                 on_evict: Callable[[Entry], None] | None = None, exact: bool = False) -> None:
        """`exact`: hits only at the positions of entries' state snapshots (module doc)."""
        self.max_bytes = max_bytes
        self.exact = exact
        self.on_evict = on_evict  # called before an entry is dropped (persist it first)
        self._root = _Node((), None)
        self._lru: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.nbytes = 0
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the entries kept as sessions' (`keep_policy.py`)."""
        return sum(e.nbytes for e in list(self._lru.values()) if e.kept)

    @property
    def snapshots(self) -> int:
        """State snapshots held (exact caches), over all entries."""
        return sum(len(e.states) for e in list(self._lru.values()))

    # ------------------------------------------------------------------ lookup

    def _match(self, prompt: list[int] | tuple[int, ...]) -> tuple[Entry | None, int]:
        """Longest usable prefix: at most len(prompt) - 1 tokens, so one is left to feed."""
        key = tuple(prompt)
        limit = len(key) - 1
        node = self._root
        best: Entry | None = None
        depth = best_depth = 0
        while depth < limit:
            child = node.children.get(key[depth])
            if child is None:
                break
            edge = child.edge
            n = min(common_prefix(key[depth:depth + len(edge)], edge), limit - depth)
            depth += n
            if n < len(edge):
                if not self.exact:
                    best, best_depth = child.any_entry, depth
                break
            node = child
            if not self.exact:  # every entry below shares the tokens matched so far
                best, best_depth = child.any_entry, depth
            elif child.marks:
                best, best_depth = child.marks[-1], depth
        return (best, best_depth) if best is not None else (None, 0)

    def peek(self, prompt: list[int]) -> int:
        """How many prompt tokens a lookup would serve now (no LRU update)."""
        with self._lock:
            return self._match(prompt)[1]

    def lookup(self, prompt: list[int], min_tokens: int = 0) -> Held | None:
        """Views of the cached layers for the longest usable prefix (with the state layers'
        snapshot there); a prefix shorter than `min_tokens` is a miss (not counted as a hit,
        its entry not touched)."""
        with self._lock:
            entry, n = self._match(prompt)
            if entry is None or n < min_tokens:
                self.stats.misses += 1
                return None
            self._lru.move_to_end(entry.tokens)
            self.stats.hits += 1
            if continues(n, len(prompt)):
                entry.kept = True
            states = entry.states.get(n, []) if self.exact else []
            if n == len(entry.tokens):
                return Held(n, list(entry.layers), states)
            return Held(n, [(kv_slice(k, n), kv_slice(v, n)) for k, v in entry.layers], states)

    # ------------------------------------------------------------------ insert / evict

    def insert(self, tokens: list[int], layers: list[tuple[Any, Any]], nbytes: int,
               states: dict[int, list[State]] | None = None,
               state_bytes: dict[int, int] | None = None, kept: bool = False) -> Entry | None:
        """`nbytes`: the append-only layers' bytes; (exact caches) `states` by position, each
        of `state_bytes[position]` bytes. An entry already held for the same tokens takes the
        snapshots it lacks. `kept`: made by a request that continued earlier work
        (`keep_policy.continues`). Entries it supersedes are dropped, their snapshots at the
        tokens it shares with them taken over, and their class too."""
        if not tokens:
            return None
        states, state_bytes = states or {}, state_bytes or {}
        if self.exact and not states:
            return None  # no position a hit could use
        if nbytes + sum(state_bytes.values()) > self.max_bytes:
            return None
        key = tuple(tokens)
        with self._lock:
            old = self._lru.get(key)
            if old is not None:
                self._lru.move_to_end(key)
                new = {p: s for p, s in states.items() if p not in old.states}
                if new:
                    old.states.update(new)
                    added = sum(state_bytes.get(p, 0) for p in new)
                    old.nbytes += added
                    self.nbytes += added
                    old.persisted = False
                    for p in new:
                        self._ensure(key[:p], old).marks.append(old)
                entry = old
            else:
                entry = Entry(key, layers, nbytes + sum(state_bytes.values()),
                              states=dict(states))
                self._link(entry)
                self._lru[key] = entry
                self.nbytes += entry.nbytes
            entry.kept = entry.kept or kept
            for old in self._superseded_by(entry):
                self._take_over(entry, old)
            victims = self._evict_beyond(entry)
        self._evicted(victims)
        return entry if entry.tokens in self._lru else None

    def resize(self, max_bytes: int) -> None:
        """A new capacity (the engine's memory share changed): entries beyond it are evicted
        at once, least recently used first, each offered to `on_evict` as an insert's are."""
        with self._lock:
            self.max_bytes = max_bytes
            victims = self._evict_beyond(None)
        self._evicted(victims)

    def _evict_beyond(self, new: Entry | None) -> list[Entry]:
        """Under the lock: entries unlinked until the cache is within its capacity, one-offs
        first, then kept ones, least recently used first in each. An entry `new` (just
        inserted) goes only as a one-off: a kept one stays even if it alone fills the cache."""
        victims = []
        while self.nbytes > self.max_bytes and self._lru:
            victim = next((e for e in self._lru.values() if not e.kept), None)
            if victim is None:
                victim = next((e for e in self._lru.values() if e is not new), None)
            if victim is None:
                break
            del self._lru[victim.tokens]
            self._unlink(victim)
            victims.append(victim)
        return victims

    def _superseded_by(self, entry: Entry) -> list[Entry]:
        """Under the lock: the entries `entry` supersedes (`keep_policy.supersedes`): those
        ending on its path, and those leaving it at most SUPERSEDE_SLACK tokens before their
        end."""
        found: list[Entry] = []
        key = entry.tokens

        def below(node: _Node, depth: int, common: int) -> None:
            if depth - common > SUPERSEDE_SLACK:
                return
            if node.entry is not None and supersedes(len(key), depth, common):
                found.append(node.entry)
            for child in node.children.values():
                below(child, depth + len(child.edge), common)

        node, depth = self._root, 0
        while depth < len(key):
            child = node.children[key[depth]]
            for first, side in node.children.items():
                if first != key[depth]:
                    below(side, depth + len(side.edge), depth)
            node, depth = child, depth + len(child.edge)
            if node.entry is not None and node.entry is not entry:
                found.append(node.entry)  # ends on the path: a prefix of it
        return found

    def _take_over(self, entry: Entry, old: Entry) -> None:
        """Under the lock: `old` dropped for `entry`, which takes its snapshots at the tokens
        the two share (positions `entry` lacks) and its class."""
        common = common_prefix(old.tokens, entry.tokens)
        moved = {p: s for p, s in old.states.items() if p <= common and p not in entry.states}
        moved_bytes = sum(state_nbytes(s) for s in moved.values())
        del self._lru[old.tokens]
        self._unlink(old)
        self.stats.superseded += 1
        if moved:
            entry.states.update(moved)
            entry.nbytes += moved_bytes
            self.nbytes += moved_bytes
            entry.persisted = False
            for p in moved:
                self._ensure(entry.tokens[:p], entry).marks.append(entry)
        entry.kept = entry.kept or old.kept

    def _evicted(self, victims: list[Entry]) -> None:
        """Outside the lock: each evicted entry counted and offered to `on_evict`."""
        for v in victims:
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(v)

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._lru.values())

    def _link(self, entry: Entry) -> None:
        """Under the lock: the entry's path made (an edge split where it leaves one, and at
        each of its snapshots), the entry recorded as one to trim for every node on it."""
        self._ensure(entry.tokens, entry).entry = entry
        for p in sorted(entry.states):
            self._ensure(entry.tokens[:p], entry).marks.append(entry)

    def _ensure(self, key: tuple[int, ...], entry: Entry) -> _Node:
        """Under the lock: the node at the end of `key` (made, splitting an edge, if needed);
        `entry`, whose tokens start with `key`, recorded as one to trim on the way."""
        node = self._root
        node.any_entry = entry
        depth = 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = node.children[key[depth]] = _Node(key[depth:], entry)
                node, depth = child, len(key)
                break
            edge = child.edge
            n = common_prefix(key[depth:depth + len(edge)], edge)
            if n < len(edge):  # the key leaves (or ends inside) this edge: split it there
                head = _Node(edge[:n], child.any_entry)
                child.edge = edge[n:]
                head.children[child.edge[0]] = child
                node.children[key[depth]] = child = head
            child.any_entry = entry
            node, depth = child, depth + n
        return node

    def _unlink(self, entry: Entry) -> None:
        """Under the lock: the entry's node cleared, emptied nodes removed, and a node left
        with no entry and one child merged with it (the tree stays compressed)."""
        self.nbytes -= entry.nbytes
        key = entry.tokens
        path = [self._root]
        node = self._root
        depth = 0
        while depth < len(key):
            node = node.children[key[depth]]
            path.append(node)
            depth += len(node.edge)
        node.entry = None
        for n in path:  # its snapshots' marks lie on its path
            if entry in n.marks:
                n.marks = [m for m in n.marks if m is not entry]
        for i in range(len(path) - 1, -1, -1):
            n = path[i]
            if n.any_entry is entry:
                n.any_entry = n.entry or next(
                    (c.any_entry for c in n.children.values() if c.any_entry is not None), None)
            if i == 0 or n.entry is not None or n.marks:
                continue
            if not n.children:
                del path[i - 1].children[n.edge[0]]
            elif len(n.children) == 1:
                (only,) = n.children.values()
                n.edge += only.edge
                n.children, n.entry, n.any_entry = only.children, only.entry, only.any_entry
                n.marks = only.marks
