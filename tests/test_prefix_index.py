"""The RAM tier's index (engine/prefix_cache.py), without a model: longest usable prefix,
byte-capped eviction as keep_policy.py decides (superseded entries, one-offs before kept
entries) and the radix tree's shape, against a brute-force reference under random inserts,
lookups and evictions."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import cast

import numpy as np
import pytest

from mlxd.engine.kv.keep_policy import continues, supersedes
from mlxd.engine.kv.prefix_cache import Entry, PrefixCache, _Node, common_prefix


def layers_for(tokens: tuple[int, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Stand-in KV whose row t holds token t's id, so a slice shows which tokens it covers
    (numpy arrays take the same indexing as the MLX arrays the engine stores)."""
    k = np.array(tokens, dtype=np.int64).reshape(1, 1, len(tokens), 1)
    return [(k, -k)]


class Reference:
    """What the index must answer, the slow way."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lru: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.kept: set[tuple[int, ...]] = set()
        self.evicted: list[tuple[int, ...]] = []
        self.superseded: list[tuple[int, ...]] = []

    def best(self, prompt: list[int]) -> int:
        limit = len(prompt) - 1
        best = 0
        for key in self.lru:
            n = 0
            while n < min(len(key), limit) and key[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    def insert(self, key: tuple[int, ...], nbytes: int, kept: bool) -> bool:
        """Whether the entry is held after the insert."""
        if key in self.lru:
            self.lru.move_to_end(key)
        else:
            self.lru[key] = nbytes
        if kept:
            self.kept.add(key)
        for old in list(self.lru):
            if old != key and supersedes(len(key), len(old), common_prefix(old, key)):
                del self.lru[old]
                self.superseded.append(old)
                if old in self.kept:
                    self.kept.discard(old)
                    self.kept.add(key)
        while sum(self.lru.values()) > self.max_bytes:
            victim = next((k for k in self.lru if k not in self.kept), None)
            if victim is None:
                victim = next((k for k in self.lru if k != key), None)
            if victim is None:
                break
            del self.lru[victim]
            self.kept.discard(victim)
            self.evicted.append(victim)
        return key in self.lru


def check_shape(cache: PrefixCache) -> None:
    """Every entry reachable at its own tokens; every node's `any_entry` an entry of its
    subtree; no empty node; no node without an entry that has a single child."""
    seen: set[tuple[int, ...]] = set()

    def walk(node: _Node, prefix: tuple[int, ...], is_root: bool) -> set[int]:
        below: set[int] = set()
        if node.entry is not None:
            assert node.entry.tokens == prefix
            seen.add(prefix)
            below.add(id(node.entry))
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first
            below |= walk(child, prefix + child.edge, False)
        if not is_root:
            assert below, "a node with no entry below it"
            assert (node.entry is not None or node.marks
                    or len(node.children) >= 2), "an uncompressed node"
            assert id(node.any_entry) in below
            assert node.any_entry is not None and node.any_entry.tokens[:len(prefix)] == prefix
        return below

    walk(cache._root, (), True)
    assert seen == set(cache._lru)


@pytest.mark.parametrize("seed", range(8))
def test_the_index_answers_as_a_brute_force_search_does(seed, monkeypatch):
    rng = random.Random(seed)
    if seed % 2:  # a slack shorter than the keys: entries that leave a newer one's path stay
        monkeypatch.setattr("mlxd.engine.kv.keep_policy.SUPERSEDE_SLACK", 6)
        monkeypatch.setattr("mlxd.engine.kv.prefix_cache.SUPERSEDE_SLACK", 6)
    vocab = rng.choice([3, 8, 50])  # few distinct tokens: many shared and split paths
    cap = rng.choice([10**9, 400])
    evicted: list[tuple[int, ...]] = []
    cache = PrefixCache(cap, on_evict=lambda e: evicted.append(e.tokens))
    ref = Reference(cap)
    stored: list[tuple[int, ...]] = []
    for _ in range(600):
        op = rng.random()
        if op < 0.45 or not stored:
            base = list(rng.choice(stored)) if stored and rng.random() < 0.7 else []
            cut = rng.randrange(len(base) + 1)
            key = tuple(base[:cut] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))])
            if not key:
                continue
            nbytes = len(key)
            kept = rng.random() < 0.3
            entry = cache.insert(list(key), layers_for(key), nbytes, kept=kept)
            held = ref.insert(key, nbytes, kept)
            assert (entry is not None and entry.tokens == key) if held else entry is None
            stored.append(key)
        else:
            base = list(rng.choice(stored))
            prompt = base[:rng.randrange(len(base) + 1)] + [
                rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            want = ref.best(prompt)
            assert cache.peek(prompt) == want
            chosen = cache._match(prompt)[0]  # the entry a lookup lends (any that covers it)
            hit = cache.lookup(prompt)
            if want == 0:
                assert hit is None and chosen is None
            else:
                assert hit is not None and chosen is not None
                layers, n = hit.layers, hit.n
                assert n == want and chosen.tokens[:n] == tuple(prompt[:n])
                assert layers[0][0].reshape(-1).tolist() == prompt[:n]  # the prompt's KV
                assert (layers[0][1] == -layers[0][0]).all()
                ref.lru.move_to_end(chosen.tokens)
                if continues(n, len(prompt)):
                    ref.kept.add(chosen.tokens)
        assert evicted == ref.evicted
        assert list(cache._lru) == list(ref.lru)
        assert {k for k, e in cache._lru.items() if e.kept} == ref.kept
        assert cache.stats.superseded == len(ref.superseded)
        assert cache.nbytes == sum(ref.lru.values()) <= max(cap, max(ref.lru.values()))
    check_shape(cache)


def test_a_lookup_leaves_one_token_to_feed_and_trims_a_longer_entry():
    cache = PrefixCache(10**6)
    cache.insert([1, 2, 3, 4, 5, 6], layers_for((1, 2, 3, 4, 5, 6)), 6)
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is not None
    hit = cache.lookup([1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.n == 5
    assert hit.layers[0][0].reshape(-1).tolist() == [1, 2, 3, 4, 5]
    hit = cache.lookup([1, 2, 3, 9])
    assert hit is not None and hit.n == 3 and hit.layers[0][0].reshape(-1).tolist() == [1, 2, 3]
    assert cache.lookup([7, 1, 2]) is None and cache.lookup([1]) is None
    assert cache.stats.hits == 3 and cache.stats.misses == 2


def test_a_prefix_shorter_than_min_tokens_is_a_miss_that_touches_nothing():
    cache = PrefixCache(10**6)
    a = cache.insert([1, 2, 3, 4, 5, 6], layers_for((1, 2, 3, 4, 5, 6)), 6)
    cache.insert([8, 9, 10], layers_for((8, 9, 10)), 3)  # now the most recently used
    assert cache.lookup([1, 2, 3, 9], min_tokens=4) is None  # a 3-token prefix
    assert (cache.stats.hits, cache.stats.misses) == (0, 1)
    assert next(iter(cache._lru.values())) is a  # still the least recently used
    got = cache.lookup([1, 2, 3, 9], min_tokens=3)
    assert got is not None and got.n == 3 and cache.stats.hits == 1
    assert next(reversed(cache._lru.values())) is a  # a hit touches it


def test_evicting_a_branch_merges_the_path_back_into_one_node():
    cache = PrefixCache(10**6)
    long = tuple(range(1000))
    a = cache.insert(list(long), layers_for(long), 1)
    b = cache.insert([*long[:500], 7, 7], layers_for((*long[:500], 7, 7)), 1)
    assert a is not None and b is not None
    assert len(cache._root.children[0].edge) == 500  # split where b leaves a's path
    cache._unlink(b)
    del cache._lru[b.tokens]
    check_shape(cache)
    assert cache._root.children[0].edge == long and cache._root.children[0].entry is a
    assert cache.peek([*long[:500], 7, 7]) == 500  # a still serves the shared part


def test_an_entry_that_ends_inside_anothers_path_is_its_own_node():
    cache = PrefixCache(10**6)
    cache.insert([1, 2, 3, 4], layers_for((1, 2, 3, 4)), 1)
    short = cache.insert([1, 2], layers_for((1, 2)), 1)
    check_shape(cache)
    assert cache._root.children[1].entry is short
    assert isinstance(short, Entry)


def test_common_prefix_length():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randrange(0, 300)
        a = tuple(rng.randrange(3) for _ in range(n))
        b = a[:rng.randrange(n + 1)] + tuple(rng.randrange(3) for _ in range(rng.randrange(9)))
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b) == want == common_prefix(b, a)


def test_common_prefix_compares_each_token_a_few_times_not_once_per_halving():
    """A conversation's next turn leaves a long edge near its end: the search must not go
    back over the equal part at every halving (at 30k tokens that was some 6 ms per call,
    and a turn's insert makes a dozen calls: benchmarks/RESULTS.md, "Long agent sessions")."""
    compared = [0]

    class Token:
        def __init__(self, v: int) -> None:
            self.v = v

        def __eq__(self, other: object) -> bool:
            compared[0] += 1
            return isinstance(other, Token) and self.v == other.v

        __hash__ = None  # type: ignore[assignment]

    n = 8192
    for cut in (n - 10, n // 2 + 7, 3):
        a = tuple(Token(i) for i in range(n))
        b = tuple(Token(i) for i in range(cut)) + (Token(-1),) * (n - cut)
        compared[0] = 0
        # (tokens that count their comparisons stand in for ints: only == is used)
        assert common_prefix(cast(tuple[int, ...], a), cast(tuple[int, ...], b)) == cut
        assert compared[0] <= 4 * n  # the old search: 110,558 (13.5 n) at the first cut

# ---------------------------------------------------------------- keep policy, by example

def turn(tokens: tuple[int, ...], n: int, start: int) -> tuple[int, ...]:
    return tokens + tuple(range(start, start + n))


def test_a_sessions_next_turn_supersedes_its_previous_one_rerendered_ending_and_all():
    cache = PrefixCache(10**9)
    system = tuple(range(1000, 1400))
    first = turn(system, 300, 5000)  # the first turn's history: prompt and answer
    cache.insert(list(first), layers_for(first), len(first))
    # the client renders the answer back a little differently: the last 5 tokens differ
    second = turn(first[:-5], 900, 7000)
    got = cache.insert(list(second), layers_for(second), len(second))
    assert got is not None and list(cache._lru) == [second]
    assert cache.nbytes == len(second) and cache.stats.superseded == 1
    assert cache.stats.evictions == 0
    # another session's first turn shares only the system prompt: both stay
    other = turn(system, 300, 9000)
    cache.insert(list(other), layers_for(other), len(other))
    assert set(cache._lru) == {second, other}
    check_shape(cache)


def test_one_offs_are_evicted_before_a_sessions_entries():
    evicted: list[tuple[int, ...]] = []
    cache = PrefixCache(2500, on_evict=lambda e: evicted.append(e.tokens))
    a, b = tuple(range(0, 1000)), tuple(range(10000, 11000))
    cache.insert(list(a), layers_for(a), 1000, kept=True)
    cache.insert(list(b), layers_for(b), 1000)
    assert cache.lookup([*b, 1, 2]) is not None  # b serves a next turn: kept from now on
    one_off = tuple(range(20000, 20800))
    assert cache.insert(list(one_off), layers_for(one_off), 800) is None  # goes at once
    assert evicted == [one_off] and set(cache._lru) == {a, b}
    small = tuple(range(30000, 30400))  # room for it: it stays, a one-off among kept
    assert cache.insert(list(small), layers_for(small), 400) is not None
    c = tuple(range(40000, 41000))  # a session's: the one-off goes, then the oldest kept
    assert cache.insert(list(c), layers_for(c), 1000, kept=True) is not None
    assert evicted == [one_off, small, a] and list(cache._lru) == [b, c]


def test_a_short_hit_does_not_make_an_entry_a_sessions():
    cache = PrefixCache(10**9)
    a = tuple(range(0, 1000))
    entry = cache.insert(list(a), layers_for(a), 1000)
    assert entry is not None
    assert cache.lookup([*a[:20], 7, 7]) is not None and not entry.kept  # under CONTINUE_MIN
    assert cache.lookup([*a[:100], *range(50000, 50300)]) is not None and not entry.kept
    assert cache.lookup([*a[:600], *range(50000, 50300)]) is not None and entry.kept


def test_an_exact_cache_hands_the_superseded_entrys_snapshots_over():
    cache = PrefixCache(10**9, exact=True)
    first = tuple(range(0, 600))
    snap = np.zeros(4, dtype=np.float32)
    from mlxd.engine.kv.prefix_cache import Arrays
    cache.insert(list(first), layers_for(first), 600,
                 states={599: [Arrays((snap,))], 600: [Arrays((snap,))]},
                 state_bytes={599: 16, 600: 16})
    second = turn(first[:-2], 400, 8000)  # leaves `first` two tokens before its end
    cache.insert(list(second), layers_for(second), len(second),
                 states={len(second): [Arrays((snap,))]}, state_bytes={len(second): 16})
    assert list(cache._lru) == [second]
    (entry,) = cache._lru.values()
    assert sorted(entry.states) == [len(second)]  # 599 and 600 lie past the shared 598
    third = turn(second, 100, 9500)
    cache.insert(list(third), layers_for(third), len(third),
                 states={len(third): [Arrays((snap,))]}, state_bytes={len(third): 16})
    (entry,) = cache._lru.values()
    assert sorted(entry.states) == [len(second), len(third)]  # second ends on its path
    assert cache.nbytes == len(third) + 32
    hit = cache.lookup([*second, 1, 2, 3])
    assert hit is not None and hit.n == len(second) and hit.states
    check_shape(cache)
