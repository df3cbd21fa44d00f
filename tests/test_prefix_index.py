"""The RAM tier's index (engine/prefix_cache.py), without a model: longest usable prefix,
byte-capped LRU eviction and the radix tree's shape, against a brute-force reference under
random inserts, lookups and evictions."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

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
        self.evicted: list[tuple[int, ...]] = []

    def best(self, prompt: list[int]) -> int:
        limit = len(prompt) - 1
        best = 0
        for key in self.lru:
            n = 0
            while n < min(len(key), limit) and key[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    def insert(self, key: tuple[int, ...], nbytes: int) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)
            return
        self.lru[key] = nbytes
        while sum(self.lru.values()) > self.max_bytes and len(self.lru) > 1:
            self.evicted.append(self.lru.popitem(last=False)[0])


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
            assert node.entry is not None or len(node.children) >= 2, "an uncompressed node"
            assert id(node.any_entry) in below
            assert node.any_entry is not None and node.any_entry.tokens[:len(prefix)] == prefix
        return below

    walk(cache._root, (), True)
    assert seen == set(cache._lru)


@pytest.mark.parametrize("seed", range(6))
def test_the_index_answers_as_a_brute_force_search_does(seed):
    rng = random.Random(seed)
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
            entry = cache.insert(list(key), layers_for(key), nbytes)
            assert entry is not None and entry.tokens == key
            ref.insert(key, nbytes)
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
        assert evicted == ref.evicted
        assert list(cache._lru) == list(ref.lru)
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
