"""Which tail blocks (a prompt's last, partial block) the SSD tier holds, in memory, so that
looking a prompt up costs the admission lane no file-system call for its tail (runs in the
engine, on the admission lanes and the storage thread).

A tail is found by the key each length of the prompt's rest would have: up to
`block_tokens - 1` names, each an `os.path.exists` (slower on a busy disk) when asked of the
disk. Every short conversation is a tail under the namespace's root, so a miss, the usual case
for a new chat, asks them all, and a burst of new chats queues on the disk for it (figures:
benchmarks/RESULTS.md, "KV cache tiers", and benchmarks/HISTORY.md section 18). The index
answers with set lookups.

It is filled by a scan of the namespace's folders at start (on a thread: until it ends, the
reader asks the disk) and by the engine's own writes as the storage worker confirms them. The
storage worker evicts blocks without telling the engine, so an entry may name a file that is
gone: the read finds out, and `discard` forgets it. Names no lookup meets again would
stay for good, so once the index holds far more tails than the disk holds blocks (the worker
reports its count with every answer) it is rebuilt by a new scan, on a thread. A block written
by another process after a scan is not seen until the next one (one engine writes a namespace
at a time).

The same index finds state snapshots (`snapshots(block_tokens)`: `.snp` files, at any length
up to a whole block, named by `snap_key` of the block key ending there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from mlxd.protocol.block_format import BLOCK_SUFFIX, SNAP_SUFFIX, parse_name, prefix_keys, snap_key

log = logging.getLogger("mlxd.engine")

# The index is rebuilt once it holds more than twice the disk's blocks plus this many tails.
STALE_SLACK = 10_000


class TailIndex:
    def __init__(self, block_tokens: int, suffix: str = BLOCK_SUFFIX, max_len: int = 0,
                 key_of: Callable[[bytes], bytes] | None = None) -> None:
        """Tails of `suffix` files of 1 .. `max_len` tokens (default: `block_tokens - 1`),
        whose file key is `key_of(block key)` (default: the block key)."""
        self.block_tokens = block_tokens
        self.suffix = suffix
        self.max_len = max_len or block_tokens - 1
        self.key_of = key_of
        self._lock = threading.Lock()
        self._tails: dict[bytes, dict[int, set[bytes]]] = {}  # parent -> length -> keys
        self.ready = threading.Event()  # set once the start-up scan has ended
        self.count = 0
        self.slack = STALE_SLACK
        self._meanwhile: list[tuple[bytes, int, bytes]] | None = None  # adds during a rebuild

    def add(self, parent: bytes, n_tokens: int, key: bytes) -> None:
        if not 0 < n_tokens <= self.max_len:
            return  # a full block: the chain walk asks the disk for those
        with self._lock:
            if self._meanwhile is not None:
                self._meanwhile.append((parent, n_tokens, key))
            keys = self._tails.setdefault(parent, {}).setdefault(n_tokens, set())
            if key not in keys:
                keys.add(key)
                self.count += 1

    def discard(self, parent: bytes, n_tokens: int, key: bytes) -> None:
        with self._lock:
            by_len = self._tails.get(parent)
            keys = by_len.get(n_tokens) if by_len else None
            if keys is None or key not in keys:
                return
            keys.discard(key)
            self.count -= 1
            if not keys:
                del by_len[n_tokens]  # type: ignore[union-attr]
                if not by_len:
                    del self._tails[parent]

    def best(self, parent: bytes, rest: list[int]) -> tuple[int, bytes] | None:
        """(length, key) of the longest indexed tail after `parent` that `rest` starts with."""
        with self._lock:
            by_len = self._tails.get(parent)
            longest = max((t for t in by_len if t <= len(rest)), default=0) if by_len else 0
        if not longest:
            return None
        keys = prefix_keys(parent, rest[:longest])
        key_of = self.key_of or (lambda k: k)
        with self._lock:
            by_len = self._tails.get(parent) or {}
            for t in sorted(by_len, reverse=True):
                if t <= longest and key_of(keys[t - 1]) in by_len[t]:
                    return t, keys[t - 1]
        return None

    def scan(self, ns_dir: Path) -> None:
        """Index every tail file under `ns_dir` (its two-hex-digit folders); sets `ready`."""
        try:
            with os.scandir(ns_dir) as folders:
                subdirs = [f.path for f in folders if len(f.name) == 2 and f.is_dir()]
            for folder in subdirs:
                for name in os.listdir(folder):
                    parsed = parse_name(name, (self.suffix,))
                    if parsed is None or not 0 < parsed[1] <= self.max_len:
                        continue
                    try:
                        self.add(bytes.fromhex(parsed[0]), parsed[1], bytes.fromhex(parsed[2]))
                    except ValueError:
                        continue  # not a block of ours
        except FileNotFoundError:
            pass  # nothing stored yet
        except OSError as e:  # an unreadable cache: the reader keeps asking the disk
            log.warning("indexing the SSD tier's tail blocks failed: %s", e)
            return
        self.ready.set()

    def rebuild_if_stale(self, ns_dir: Path, blocks_on_disk: int) -> threading.Thread | None:
        """Rescan on a thread when the index holds more than twice `blocks_on_disk` tails plus
        `slack` (evicted tails no lookup met); the thread, or None when nothing is done."""
        with self._lock:
            if self._meanwhile is not None or not self.ready.is_set() \
                    or self.count <= 2 * blocks_on_disk + self.slack:
                return None
            self._meanwhile = []
        t = threading.Thread(target=self._rebuild, args=(ns_dir,), name="engine-ssd-index",
                             daemon=True)
        t.start()
        return t

    def _rebuild(self, ns_dir: Path) -> None:
        fresh = TailIndex(self.block_tokens, self.suffix, self.max_len, self.key_of)
        fresh.scan(ns_dir)
        with self._lock:
            added, self._meanwhile = self._meanwhile or [], None
            if fresh.ready.is_set():  # else (an unreadable folder) the old index stays
                stale = self.count
                self._tails, self.count = fresh._tails, fresh.count
                log.info("SSD tail index rebuilt: %d tails, was %d", self.count, stale)
        for tail in added:  # written while the folders were being read
            self.add(*tail)

    def scan_in_background(self, ns_dir: Path) -> threading.Thread:
        t = threading.Thread(target=self.scan, args=(ns_dir,), name="engine-ssd-index",
                             daemon=True)
        t.start()
        return t


def snapshots(block_tokens: int) -> TailIndex:
    """An index of state snapshot files (a whole block's length included)."""
    return TailIndex(block_tokens, SNAP_SUFFIX, block_tokens, snap_key)
