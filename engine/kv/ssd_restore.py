"""Reading the SSD tier back, on an admission lane (before a request reaches the MLX thread):
walk the prompt's chained keys while block files exist, then the best tail; read and verify
each file; decide whether that beats what the RAM tier holds. A bad file is a miss (logged and
removed), never an error; whatever else goes wrong with the disk is a miss too.

A model with state layers (`snap_layout`) is served only where a snapshot was taken: the
newest snapshot the prompt reaches, with the append-only layers' blocks before it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlxd.engine.kv.prefix_cache import RestoredPrefix
from mlxd.engine.kv.ssd_snapshots import parse_states
from mlxd.engine.kv.tail_index import TailIndex
from mlxd.protocol.block_format import (
    BadBlock,
    Layout,
    SnapLayout,
    block_file,
    block_name,
    block_path,
    block_spans,
    chain_keys,
    prefix_keys,
    read_block,
    snap_file,
    snap_key,
)

log = logging.getLogger("mlxd.engine")

RAW_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}

Found = list[tuple[bytes, int, bytes, list[int]]]  # (parent, n_tokens, key, tokens) per block
SCAN_WAIT = 5.0  # seconds a lookup waits for the snapshot index's start-up scan


class SsdReader:
    def __init__(self, namespace: bytes, ns_dir: Path, layout: Layout, block_tokens: int,
                 verify: bool, stats: Any, touch: Callable[[list[str]], None],
                 tails: TailIndex | None = None, snaps: TailIndex | None = None,
                 snap_layout: SnapLayout | None = None) -> None:
        self.namespace, self.ns_dir = namespace, ns_dir
        self.layout, self.block_tokens, self.verify = layout, block_tokens, verify
        self.stats = stats  # ssd_tier.SsdStats: hits, misses, restored_tokens, bad_blocks
        self.touch = touch  # the blocks just read are the most recently used
        self.tails = tails  # consulted once its start-up scan has ended (see tail_index.py)
        self.snaps, self.snap_layout = snaps, snap_layout  # state snapshots (None: no state)

    def better_than_ram(self, prompt: list[int], in_ram: int) -> RestoredPrefix | None:
        """KV for the prompt's longest prefix on SSD, if it beats the `in_ram` tokens the RAM
        tier would give; files are read only then."""
        try:
            on_ssd, found = self._walk(prompt)
            if on_ssd > in_ram:
                return self._read(found, in_ram, on_ssd if self.snap_layout else -1)
            if on_ssd == 0:
                self.stats.misses += 1
        except Exception as e:  # noqa: BLE001 - a disk problem is a miss, never an error
            log.warning("SSD lookup failed, serving without it: %s", e)
            self.stats.misses += 1
        return None

    def available(self, prompt: list[int]) -> int:
        """How many prompt tokens the SSD tier could serve (file existence only)."""
        return self._walk(prompt)[0]

    def _path(self, parent: bytes, n: int, key: bytes) -> Path:
        return block_path(self.ns_dir, parent, n, key)

    def _walk(self, prompt: list[int]) -> tuple[int, Found]:
        if self.snap_layout is not None:
            return self._walk_to_snapshot(prompt)
        usable = prompt[:len(prompt) - 1]  # one token is always fed
        found: Found = []
        parent = self.namespace
        B = self.block_tokens
        ns_dir = str(self.ns_dir)
        for i, key in enumerate(chain_keys(self.namespace, usable, B)):
            if not os.path.exists(block_file(ns_dir, parent, B, key)):
                break
            found.append((parent, B, key, usable[i * B:(i + 1) * B]))
            parent = key
        n = len(found) * B
        tail = self._best_tail(parent, usable[n:n + B - 1])
        if tail is not None:
            found.append(tail)
            n += tail[1]
        return n, found

    def _walk_to_snapshot(self, prompt: list[int]) -> tuple[int, Found]:
        """The newest snapshot the prompt reaches (found through the snapshot index) whose
        preceding blocks are on disk, and those blocks (the last ends at the snapshot)."""
        usable = prompt[:len(prompt) - 1]
        B = self.block_tokens
        assert self.snaps is not None
        if not usable or not self.snaps.ready.wait(SCAN_WAIT):
            return 0, []
        spans = block_spans(self.namespace, usable, B)
        kv = self.layout.n_layers > 0
        ns_dir = str(self.ns_dir)
        have = 0  # leading full blocks whose KV is on disk (all, with no append-only layers)
        for s, e, parent, key in spans:
            if e - s < B or (kv and not os.path.exists(block_file(ns_dir, parent, B, key))):
                break
            have += 1
        for i in range(min(have, len(spans) - 1), -1, -1):
            s, e, parent, _ = spans[i]
            best = self.snaps.best(parent, usable[s:e])
            if best is None:
                continue
            t, key = best
            found: Found = [(p, B, k, usable[a:b]) for a, b, p, k in spans[:i]]
            found.append((parent, t, key, usable[s:s + t]))
            return s + t, found
        return 0, []

    def _best_tail(self, parent: bytes,
                   rest: list[int]) -> tuple[bytes, int, bytes, list[int]] | None:
        """The longest tail block (a partial span) after `parent` that matches `rest`: the
        name each length would have is computed and looked up, longest first, in the tail
        index once its scan has ended, else on disk (at most `block_tokens - 1` lookups however
        many blocks the disk holds; listing the directory instead costs admission time that
        grows with every prompt stored: benchmarks/HISTORY.md section 16)."""
        if not rest:
            return None
        if self.tails is not None and self.tails.ready.is_set():
            best = self.tails.best(parent, rest)
            return None if best is None else (parent, best[0], best[1], rest[:best[0]])
        folder = self.ns_dir / parent.hex()[:2]
        if not folder.is_dir():
            return None
        keys = prefix_keys(parent, rest)
        base = str(folder) + os.sep
        for t in range(len(rest), 0, -1):
            key = keys[t - 1]
            if os.path.exists(base + block_name(parent, t, key)):
                return parent, t, key, rest[:t]
        return None

    def _read(self, found: Found, better_than: int, snapshot_at: int = -1
              ) -> RestoredPrefix | None:
        """Per-layer (k, v) host arrays (1, kv_heads, n, head_dim) for the verified blocks;
        quantized (--kv-bits), k and v are each a triplet (packed, scales, biases).
        `snapshot_at` >= 0: the state layers' snapshot taken where the last block ends, at
        that position, is read too, and every block must be (the state fits nothing else)."""
        states: list[Any] = []
        if snapshot_at >= 0:
            assert self.snap_layout is not None
            parent, t, key, tokens = found[-1]
            path = Path(snap_file(str(self.ns_dir), parent, t, key))
            try:
                payload = read_block(path, self.layout, self.namespace, parent, key, tokens,
                                     self.verify, self.snap_layout.payload_bytes(snapshot_at))
            except BadBlock as e:
                if e.missing:
                    assert self.snaps is not None
                    self.snaps.discard(parent, t, snap_key(key))
                else:
                    log.warning("SSD snapshot unusable, removed: %s", e)
                    self.stats.bad_blocks += 1
                    path.unlink(missing_ok=True)
                self.stats.misses += 1
                return None
            states = parse_states(payload, self.snap_layout, snapshot_at)
            if self.layout.n_layers == 0:  # no append-only layers: the snapshot is all
                self.stats.hits += 1
                self.stats.restored_tokens += snapshot_at
                self.touch([path.name])
                return RestoredPrefix(snapshot_at, [], self.layout.dtype, states)
            self.touch([path.name])
        lay = self.layout
        kinds = lay.parts()  # the arrays of one layer, in the order a block stores them
        parts: list[list[np.ndarray]] = [[] for _ in range(len(kinds) * lay.n_layers)]
        got = 0
        names = []
        for parent, t, key, tokens in found:
            path = self._path(parent, t, key)
            try:
                payload = read_block(path, lay, self.namespace, parent, key, tokens, self.verify)
            except BadBlock as e:
                if e.missing:  # evicted since it was found: what came before serves
                    if self.tails is not None:
                        self.tails.discard(parent, t, key)
                    break
                log.warning("SSD block unusable, removed: %s", e)
                self.stats.bad_blocks += 1
                path.unlink(missing_ok=True)
                break
            off = 0
            for i in range(lay.n_layers):
                for j, (dtype, width) in enumerate(kinds):
                    size = lay.kv_heads * t * width
                    arr = np.frombuffer(payload, dtype=dtype, count=size, offset=off)
                    parts[len(kinds) * i + j].append(arr.reshape(lay.kv_heads, t, width))
                    off += arr.nbytes
            got += t
            names.append(path.name)
        if got <= better_than or (snapshot_at >= 0 and got != snapshot_at):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.restored_tokens += got
        self.touch(names)
        arrays = [np.concatenate(p, axis=1)[None] for p in parts]
        if lay.kv_bits:
            layers: list[tuple[Any, Any]] = [(tuple(arrays[6 * i:6 * i + 3]),
                                              tuple(arrays[6 * i + 3:6 * i + 6]))
                                             for i in range(lay.n_layers)]
        else:
            layers = [(arrays[2 * i], arrays[2 * i + 1]) for i in range(lay.n_layers)]
        return RestoredPrefix(got, layers, lay.dtype, states)
