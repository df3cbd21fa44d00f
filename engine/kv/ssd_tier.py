"""The engine's side of the SSD tier.

- Write-behind: the MLX thread picks a new RAM entry's blocks that the disk lacks and a free
  slot of this engine's shared-memory arena for each (with none free the block is skipped,
  counted, rather than stall decoding); the storage thread copies each block's span of the
  entry's arrays into its slot, and a `StoreBlocks` message names the slots. No hashing of
  payloads, writing or fsync on the MLX thread, and no waiting. The storage thread reads the
  entry's own arrays and the MLX thread runs no kernel (with the hidden setting `ssd_staging`
  device, for comparisons, the MLX thread gathers the blocks into one staging array on the
  device first).
- A disk that refuses writes (full, read-only, gone) degrades the tier (`WriteHealth`): nothing
  is queued (blocks are counted as skipped) until a retry time with exponential backoff, then
  one probe block decides whether it recovers; meanwhile the storage thread asks the worker every
  5 s whether the disk could take a block (`ProbeDisk`), so a recovered disk is noticed within
  seconds, idle or not. A flush probes at once and answers promptly with the refusal's code
  instead of retrying until its deadline.
- The storage thread owns the DEALER to the storage worker: it sends, frees slots on
  `StoreDone`, and reclaims slots a dead worker never answered for.
- Restore: `ssd_restore.SsdReader` (`self.reader`), on the admission lanes; it finds tails
  through `self.tails` (`tail_index.TailIndex`), which the storage thread's confirmed
  writes keep current.
- State snapshots (sliding-window and recurrent layers, `codec.py`): an entry's snapshot at a
  position goes as one more "block" (`ssd_snapshots.py`), beside the append-only layers'
  blocks and the tail block ending there; the reader restores the newest snapshot the prompt
  reaches with the blocks before it.
- Wiring: `open_ssd_tier` derives the block layout and the namespace from the loaded model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from mlxd.engine.kv.prefix_cache import Entry
from mlxd.engine.kv.ssd_health import Admit, Change, Refusal, WriteHealth
from mlxd.engine.kv.ssd_restore import SsdReader
from mlxd.engine.kv.ssd_snapshots import fits, state_parts
from mlxd.engine.kv.tail_index import TailIndex, snapshots
from mlxd.protocol import codec, shm
from mlxd.protocol.block_format import (
    KvDtype,
    Layout,
    SnapLayout,
    block_file,
    block_spans,
    namespace_key,
    snap_file,
    snap_key,
)
from mlxd.protocol.messages import (
    BlockWrite,
    DiskProbed,
    EngineStats,
    ProbeDisk,
    StoreBlocks,
    StoreDone,
    TouchBlocks,
)
from mlxd.protocol.settings import EngineLaunch

log = logging.getLogger("mlxd.engine")

RECLAIM_AFTER = 30.0  # seconds a slot may wait for a StoreDone before a dead worker is assumed
# Entries left part-written for want of a free slot are tried again with later calls (at most
# this many, the oldest dropped first; at most every RETRY_EVERY seconds): a long prompt's
# blocks outnumber the slots, and a snapshot is of no use without every block before it.
RETRY_MAX = 64
RETRY_EVERY = 0.02


@dataclass
class SsdStats:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    blocks_queued: int = 0
    blocks_written: int = 0
    blocks_existed: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    skipped_no_slot: int = 0
    skipped_degraded: int = 0  # blocks not queued while the disk refused writes
    bad_blocks: int = 0
    disk_bytes: int = 0
    disk_blocks: int = 0
    evicted: int = 0
    error: str | None = None  # "<code>: <message>" while degraded


@dataclass
class FlushResult:
    written: int  # blocks written during the flush
    failed: int  # blocks the disk refused during the flush
    unwritten: int  # blocks of cached entries not on disk at the end
    error_code: str | None  # None: every cached entry is durable
    error: str | None


@dataclass
class _Block:
    slot: int
    parts: Any  # the entry's arrays in slot order (`_host_parts`); None once copied
    start: int  # the block's token span in them
    end: int
    write: BlockWrite
    staged: Any = None  # device staging: the call's staging array, this block's bytes at
    offset: int = 0  # `offset` (`parts` is then None)
    nbytes: int = 0
    whole: bool = False  # a snapshot: each of `parts` whole, one after the other


@dataclass
class _Pending:
    sent_at: float
    keys: list[bytes] = field(default_factory=list)
    tail: tuple[bytes, int, bytes] | None = None  # (parent, tokens, key) of a tail block
    snap: tuple[bytes, int, bytes] | None = None  # (parent, tokens, snap key) of a snapshot


def weights_digest(model_dir: Path) -> str:
    """Cheap identity of the weights: config plus every safetensors header and size."""
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.json")) + sorted(model_dir.glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(str(path.stat().st_size).encode())
        with open(path, "rb") as f:
            if path.suffix == ".safetensors":
                n = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(n, 1 << 24)))
            elif path.name == "config.json":
                h.update(f.read())
    return h.hexdigest()


class _ReclaimAll:
    pass


def stages_on_device(setting: str, device: Any) -> bool:
    """Whether the write-behind gathers blocks on the device before the host reads them.
    On CUDA a host read of an array moves its buffer to managed memory for good, and the
    entries persisted as a prompt's prefill ends are views of the row's live cache, which
    every later decode step reads on the device: host reads of them stalled one-row decode
    steps of an agent session (20-70 ms, several per turn) where gathering on the device did
    not (benchmarks/RESULTS.md, "SSD write-behind on CUDA"). On Apple silicon and the CPU
    backend memory is unified and a host read moves nothing: the arrays are read as they are.
    `setting`: the hidden setting `ssd_staging` (auto, views or device)."""
    if setting != "auto":
        return setting == "device"
    import mlx.core as mx
    try:
        return device == mx.gpu and bool(mx.cuda.is_available())
    except AttributeError:  # an MLX without its CUDA module
        return False


class SsdTier:
    def __init__(self, *, root: Path, layout: Layout, description: str, block_tokens: int,
                 run_dir: Path, engine_id: str, epoch: int, slots: int, verify: bool,
                 ctx: zmq.Context, endpoint: str, device_staging: bool = False,
                 snap_layout: SnapLayout | None = None) -> None:
        """`device_staging`: blocks are gathered on the device before the host reads them
        (`stages_on_device`: on CUDA); otherwise the storage thread reads the entries' arrays
        themselves."""
        self.layout = layout
        self.block_tokens = block_tokens
        self.namespace = namespace_key(description)
        self.ns_dir = root / self.namespace.hex()[:16]
        self.verify = verify
        self.engine_id, self.epoch = engine_id, epoch
        self.snap_layout = snap_layout  # None: a model without state layers
        self.slot_bytes = max(layout.payload_bytes(block_tokens),
                              snap_layout.max_bytes() if snap_layout else 0)
        self.segment = shm.segment_name(run_dir, engine_id, epoch)
        self._shm = shm.create(run_dir, self.segment, self.slot_bytes * slots)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self._free.put(i)
        self._pending: dict[int, _Pending] = {}
        self._queued_keys: set[bytes] = set()
        self._retry: list[Entry] = []  # part-written for want of a slot (RETRY_MAX)
        self._retry_at = 0.0
        self._out: queue.Queue[Any] = queue.Queue()
        self._idle = threading.Condition()  # guards _pending and health; notified on answers
        self.health = WriteHealth()
        self.stats = SsdStats()
        self._ctx = ctx
        self._endpoint = endpoint
        self._stop = threading.Event()
        self.device_staging = device_staging
        self.tails = TailIndex(block_tokens)
        self.tails.scan_in_background(self.ns_dir)
        self.snaps = snapshots(block_tokens) if snap_layout else None
        if self.snaps is not None:
            self.snaps.scan_in_background(self.ns_dir)
        self.reader = SsdReader(self.namespace, self.ns_dir, layout, block_tokens, verify,
                                self.stats, lambda names: self._out.put(
                                    TouchBlocks(self.namespace, names)), self.tails,
                                self.snaps, snap_layout)
        self._thread = threading.Thread(target=self._client_loop, name="engine-ssd", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._shm.close()
        shm.unlink(self.segment)

    # ------------------------------------------------------------------ keys

    def _blocks_of(self,
                   tokens: tuple[int, ...] | list[int]) -> list[tuple[int, int, bytes, bytes]]:
        """(start, end, parent, key) for every full block and the tail of `tokens`."""
        return block_spans(self.namespace, tokens, self.block_tokens)

    # ------------------------------------------------------------------ write-behind (MLX thread)

    def _missing(self, entry: Entry) -> list[tuple[int, int, bytes, bytes, int]]:
        """(start, end, parent, key, snapshot position or -1) of the entry's blocks and
        snapshots the disk lacks: the append-only layers' blocks of its tokens, and for each
        of its snapshots the snapshot and the tail block ending where it was taken."""
        # os.path.exists: False on any OSError (an unreadable folder: the write then fails in
        # the worker and the tier degrades), where Path.exists raises on some, on the MLX thread
        ns_dir = str(self.ns_dir)
        kv = self.layout.n_layers > 0
        out = [(s, e, p, k, -1) for s, e, p, k in (self._blocks_of(entry.tokens) if kv else [])
               if k not in self._queued_keys
               and not os.path.exists(block_file(ns_dir, p, e - s, k))]
        for pos in sorted(entry.states) if self.snap_layout else []:
            if not 0 < pos <= len(entry.tokens):
                continue
            s, e, p, k = self._blocks_of(entry.tokens[:pos])[-1]
            if kv and pos < len(entry.tokens) and e - s < self.block_tokens \
                    and k not in self._queued_keys \
                    and not os.path.exists(block_file(ns_dir, p, e - s, k)):
                out.append((s, e, p, k, -1))
            if snap_key(k) not in self._queued_keys \
                    and not os.path.exists(snap_file(ns_dir, p, e - s, k)):
                out.append((s, e, p, k, pos))
        return out

    def persist_all(self, entries: list[Entry]) -> int:
        """Queue the entries' missing blocks for the storage worker; return how many were
        queued. With unified memory (Apple silicon, the CPU backend) the MLX thread runs no
        kernel for it: it only makes sure the entries' arrays are evaluated (one
        `async_eval` for all, usually nothing left to do); the storage thread reads each
        block's span of them as host memory (no copy) and copies it into its shared-memory
        slot, so decoding never waits for a copy. On CUDA (`device_staging`) the MLX thread
        first gathers the blocks into one array on the device, which the storage thread
        reads, so that no host read touches a live cache (`stages_on_device`); there the
        gather costs kernels for every call, and on the CPU backend it would cost copies too
        (`benchmarks/ssd_persist.py`; figures: benchmarks/HISTORY.md sections 16 and 18).
        While the disk refuses writes, nothing is queued but one probe block per backoff."""
        import mlx.core as mx
        now = time.monotonic()
        if self._retry and now >= self._retry_at:
            entries, self._retry = self._retry + entries, []
            self._retry_at = now + RETRY_EVERY
        blocks: list[_Block] = []
        for entry in entries:
            skipped = self.stats.skipped_no_slot
            blocks += self._stage(entry)
            if self.stats.skipped_no_slot > skipped and entry not in self._retry:
                self._retry = [*self._retry[-(RETRY_MAX - 1):], entry]
        if not blocks:
            return 0
        try:
            plain = [b for b in blocks if not b.whole]
            if self.device_staging and plain:
                mx.async_eval(self._stage_on_device(plain))
            mx.async_eval(list({id(a): a for b in blocks if b.parts is not None
                                for a in b.parts}.values()))
        except Exception as e:  # e.g. no device memory left: these blocks fail, not the step
            log.exception("staging KV blocks for the SSD tier failed")
            for entry in entries:
                entry.persisted = False  # an eviction tries it again
            self._register(blocks)
            self._done(StoreDone([b.slot for b in blocks], failed=len(blocks),
                                 error=f"staging the blocks failed: {e}",
                                 error_code="copy_failed"))
            return 0
        self.stats.blocks_queued += len(blocks)
        self._register(blocks)
        self._out.put(blocks)
        return len(blocks)

    def _register(self, blocks: list[_Block]) -> None:
        with self._idle:
            for b in blocks:
                w = b.write
                key = snap_key(w.key) if w.snapshot else w.key
                self._pending[b.slot] = _Pending(
                    time.monotonic(), [key],
                    (w.parent, len(w.tokens), w.key) if w.tail and not w.snapshot else None,
                    (w.parent, len(w.tokens), key) if w.snapshot else None)

    def _stage(self, entry: Entry) -> list[_Block]:
        """The entry's missing blocks that get a slot now (marks it persisted if all do)."""
        todo = self._missing(entry)
        if not todo:
            entry.persisted = True
            return []
        with self._idle:
            admit = self.health.admit(time.monotonic())
        if admit is Admit.SKIP:
            self.stats.skipped_degraded += len(todo)
            entry.persisted = False
            return []
        chosen = todo if admit is Admit.WRITE else todo[:1]
        self.stats.skipped_degraded += len(todo) - len(chosen)
        blocks = []
        parts = self._host_parts(entry)
        for start, end, parent, key, pos in chosen:
            snap: list[Any] | None = None
            if pos >= 0:
                states = entry.states[pos]
                assert self.snap_layout is not None
                if not fits(states, self.snap_layout, pos):
                    log.warning("a snapshot at %d does not match the model's layout: not "
                                "stored", pos)
                    continue
                snap = state_parts(states)
            try:
                slot = self._free.get_nowait()
            except queue.Empty:
                self.stats.skipped_no_slot += 1
                continue
            write = BlockWrite(slot, parent, key, list(entry.tokens[start:end]),
                               tail=end - start < self.block_tokens)
            if snap is not None:
                write.snapshot, write.nbytes = True, sum(a.nbytes for a in snap)
                blocks.append(_Block(slot, snap, start, end, write, whole=True))
                self._queued_keys.add(snap_key(key))
                continue
            blocks.append(_Block(slot, parts, start, end, write))
            self._queued_keys.add(key)
        if admit is Admit.PROBE and blocks:
            with self._idle:
                self.health.probing(blocks[0].slot)
        entry.persisted = len(blocks) == len(todo)
        return blocks

    def _host_parts(self, entry: Entry) -> list[Any]:
        """The entry's arrays in the order a slot holds a block: per layer, keys then values,
        each (1, kv_heads, T, width); quantized, keys and values are triplets (packed, scales,
        biases; `Layout.parts`). bfloat16 is viewed as uint16 (numpy has no bfloat16)."""
        import mlx.core as mx
        arrays = [a for k, v in entry.layers
                  for a in ((*k, *v) if self.layout.kv_bits else (k, v))]
        return [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]

    def _stage_on_device(self, blocks: list[_Block]) -> Any:
        """One uint8 array holding every block's slot bytes, one block after the other, built
        by the device (each block's spans of its entry's arrays, in slot order); each block
        records where its bytes start. An entry whose arrays share shape and dtype (unquantized
        KV, keys and values alike) is stacked once, so a block costs three ops whatever the
        layer count; otherwise each array's span is taken on its own."""
        import mlx.core as mx
        pieces: list[Any] = []
        offset = 0
        by_entry: dict[int, list[_Block]] = {}
        for b in blocks:
            by_entry.setdefault(id(b.parts), []).append(b)
        for group in by_entry.values():
            parts = group[0].parts
            lo, hi = min(b.start for b in group), max(b.end for b in group)
            uniform = len({(a.shape, a.dtype) for a in parts}) == 1
            if uniform:
                if lo > 0 or hi < parts[0].shape[2]:  # only the blocks' span is copied
                    parts = [a[:, :, lo:hi, :] for a in parts]
                stacked = mx.concatenate(parts, axis=0)  # (arrays, kv_heads, T, width)
            for b in group:
                if uniform:
                    spans = [stacked[:, :, b.start - lo:b.end - lo, :]]
                else:
                    spans = [a[0, :, b.start:b.end, :] for a in parts]
                b.offset, b.nbytes = offset, 0
                for span in spans:
                    piece = mx.flatten(span).view(mx.uint8)
                    pieces.append(piece)
                    b.nbytes += piece.size
                offset += b.nbytes
                b.parts = None
        staged = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        for b in blocks:
            b.staged = staged
        return staged

    def _copy(self, blocks: list[_Block]) -> StoreBlocks:
        """Storage thread: each block's span of its entry's arrays (read as host memory once
        evaluated; each array once for all the blocks of its entry) into its slot, array after
        array, each (kv_heads, tokens, width) in C order."""
        host: dict[int, list[np.ndarray]] = {}
        for b in blocks:
            if b.staged is not None:  # device staging: the block's bytes, as they go
                staged = host.get(id(b.staged))
                if staged is None:
                    staged = host[id(b.staged)] = [np.asarray(b.staged)]
                np.ndarray((b.nbytes,), dtype=np.uint8, buffer=self._shm.buf,
                           offset=b.slot * self.slot_bytes)[...] = \
                    staged[0][b.offset:b.offset + b.nbytes]
                b.staged = None
                continue
            views = host.get(id(b.parts))
            if views is None:
                views = host[id(b.parts)] = [np.asarray(a) for a in b.parts]
            off = b.slot * self.slot_bytes
            if b.whole:  # a snapshot: its arrays whole
                for a in views:
                    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                    np.ndarray(flat.shape, dtype=np.uint8, buffer=self._shm.buf,
                               offset=off)[...] = flat
                    off += flat.nbytes
                b.parts = None
                continue
            for a in views:
                span = a[0, :, b.start:b.end, :]
                np.ndarray(span.shape, dtype=span.dtype, buffer=self._shm.buf,
                           offset=off)[...] = span
                off += span.nbytes
            b.parts = None  # the MLX arrays (and the cache they view) are released here
        return StoreBlocks(self.engine_id, self.epoch, self.segment, self.slot_bytes,
                           self.namespace, self.layout, [b.write for b in blocks])

    def flush(self, run_on_mlx: Callable[[Callable[[], int]], int | None],
              entries: Callable[[], list[Entry]], timeout: float) -> FlushResult:
        """Make every entry durable; answer once every queued write is durable, or the disk
        refused one (its code in the result), or `timeout` passed. Runs on a helper thread:
        only the copies run on the MLX thread (through `run_on_mlx`), in rounds as slots free
        up, so decoding never waits for the disk. A degraded tier is probed at once (an
        explicit flush does not wait out the backoff); a refusal ends the flush."""
        deadline = time.monotonic() + timeout
        w0, f0 = self.stats.blocks_written, self.stats.write_failures
        with self._idle:
            self.health.retry_now(time.monotonic())

        def copy_round() -> int:
            held = entries()
            self.persist_all(held)
            return sum(len(self._missing(entry)) for entry in held)

        missing: int | None = None
        while time.monotonic() < deadline:
            missing = run_on_mlx(copy_round)  # None: the MLX thread did not answer in time
            if not missing:
                break
            if not self._wait_for_progress(deadline) or self._refused():
                break
        with self._idle:
            while self._pending and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            refusal, pending = self.health.refusal, len(self._pending)
        written = self.stats.blocks_written - w0
        failed = self.stats.write_failures - f0
        # Durable: the last round queued every missing block and every answer came back; a
        # failure among the last answers leaves the tier degraded (an earlier one was followed
        # by a round that re-queued its blocks). Not "every block on disk now": the byte cap
        # may have evicted some meanwhile, by design.
        if missing == 0 and pending == 0 and (refusal is None or failed == 0):
            return FlushResult(written, failed, 0, None, None)
        # what is not on disk now (failed blocks included); informative only, see above
        left = run_on_mlx(lambda: sum(len(self._missing(e)) for e in entries())) or missing or 0
        if refusal is not None:
            return FlushResult(written, failed, left, refusal.code, refusal.message)
        return FlushResult(written, failed, left, "timeout",
                           f"the flush did not finish within {timeout:g} s "
                           f"({pending} writes still queued)")

    def _wait_for_progress(self, deadline: float) -> bool:
        """Until a slot is free and no probe awaits its answer; False at the deadline."""
        with self._idle:
            while (self._free.empty() or self.health.probe_slot is not None) \
                    and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
        return time.monotonic() < deadline

    def _refused(self) -> bool:
        with self._idle:
            return self.health.refused(time.monotonic())

    def fill_stats(self, out: EngineStats) -> None:
        """The tier's figures and health: `ssd_state` "ok" or "degraded" (then `ssd_reason`
        "<code>: <why>; ...", the code, seconds until writes are tried again)."""
        now = time.monotonic()
        with self._idle:
            refusal, retry_in = self.health.refusal, self.health.retry_in(now)
        st = self.stats
        out.ssd_state = "ok"
        if refusal is not None:
            when = f"next try in {retry_in:.1f} s" if retry_in > 0 \
                else "next try with the next write"
            out.ssd_state = "degraded"
            out.ssd_reason = f"{refusal.code}: {refusal.message}; writes paused, {when}"
            out.ssd_error_code, out.ssd_retry_in_s = refusal.code, round(retry_in, 1)
        out.ssd_hits, out.ssd_misses = st.hits, st.misses
        out.ssd_restored_tokens, out.ssd_blocks_queued = st.restored_tokens, st.blocks_queued
        out.ssd_blocks_written, out.ssd_blocks_existed = st.blocks_written, st.blocks_existed
        out.ssd_bytes_written, out.ssd_write_failures = st.bytes_written, st.write_failures
        out.ssd_skipped_no_slot, out.ssd_skipped_degraded = st.skipped_no_slot, st.skipped_degraded
        out.ssd_bad_blocks, out.ssd_evicted = st.bad_blocks, st.evicted
        out.ssd_bytes, out.ssd_blocks = st.disk_bytes, st.disk_blocks
        out.ssd_write_queue = self.queue_depth

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ storage thread

    def _client_loop(self) -> None:
        enc, dec = codec.to_storage(), codec.from_storage()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.connect(self._endpoint)
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        msg = self._out.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(msg, list):
                        try:
                            msg = self._copy(msg)
                        except Exception as e:  # a failed copy fails its blocks
                            log.exception("copying KV blocks to shared memory failed")
                            self._done(StoreDone([b.slot for b in msg], failed=len(msg),
                                                 error=f"copy failed: {e}",
                                                 error_code="copy_failed"))
                            continue
                    if isinstance(msg, _ReclaimAll):
                        with self._idle:
                            self.health.disk_probe_lost()
                        if self._pending:
                            self._done(StoreDone(list(self._pending), failed=len(self._pending),
                                                 error="the storage worker restarted before "
                                                 "answering", error_code="worker_gone"))
                        continue
                    try:
                        sock.send(enc.encode(msg))
                    except zmq.Again:
                        self._fail(msg, "the storage worker is not reachable")
                self._probe_disk(sock, enc)
                if sock.poll(50, zmq.POLLIN):
                    answer = dec.decode(sock.recv())
                    if isinstance(answer, DiskProbed):
                        self._disk_probed(answer)
                    else:
                        self._done(answer)
                self._reclaim()
        finally:
            sock.close()

    def _probe_disk(self, sock: zmq.Socket, enc: Any) -> None:
        with self._idle:
            if not self.health.disk_probe_due(time.monotonic()):
                return
            self.health.disk_probing()
        try:
            sock.send(enc.encode(ProbeDisk(self.slot_bytes)))
        except zmq.Again:
            with self._idle:
                self.health.disk_probe_lost()

    def _disk_probed(self, answer: DiskProbed) -> None:
        refusal = Refusal(answer.error_code, answer.error or "the disk refused") \
            if answer.error_code else None
        with self._idle:
            change = self.health.disk_answered(refusal, time.monotonic())
            self._idle.notify_all()
        if change is Change.RECOVERED:
            self.stats.error = None
            log.info("SSD tier writable again (a disk probe)")

    def _fail(self, msg: Any, error: str) -> None:
        if isinstance(msg, StoreBlocks):
            self._done(StoreDone([b.slot for b in msg.blocks], failed=len(msg.blocks),
                                 error=error, error_code="worker_gone"))

    def _done(self, done: StoreDone) -> None:
        s = self.stats
        s.blocks_written += done.written
        s.blocks_existed += done.existed
        s.bytes_written += done.bytes_written
        s.write_failures += done.failed
        s.evicted += done.evicted
        if done.disk_blocks or done.disk_bytes:
            s.disk_bytes, s.disk_blocks = done.disk_bytes, done.disk_blocks
            self.tails.rebuild_if_stale(self.ns_dir, done.disk_blocks)
        refusal = Refusal(done.error_code or "io_error", done.error or "the write failed") \
            if done.failed else None
        with self._idle:
            change = self.health.answered(done.slots, refusal, time.monotonic())
            current, backoff = self.health.refusal, self.health.backoff
            for slot in done.slots:
                p = self._pending.pop(slot, None)
                if p is not None:
                    self._queued_keys.difference_update(p.keys)
                    self._free.put(slot)
                    if p.tail is not None and not done.failed:  # on disk now (or already)
                        self.tails.add(*p.tail)
                    if p.snap is not None and self.snaps is not None and not done.failed:
                        self.snaps.add(*p.snap)
            self._idle.notify_all()
        s.error = f"{current.code}: {current.message}" if current else None
        if change is Change.DEGRADED and current:
            log.warning("SSD tier degraded (%s): %s; writes paused, next try in %g s",
                        current.code, current.message, backoff)
        elif change is Change.STILL_DEGRADED and current:
            log.info("SSD tier still refuses writes (%s); next try in %g s", current.code, backoff)
        elif change is Change.RECOVERED:
            log.info("SSD tier writable again")

    def worker_restarted(self) -> None:
        """The storage worker was replaced: what the dead one held will never be answered."""
        self._out.put(_ReclaimAll())

    def _reclaim(self) -> None:
        now = time.monotonic()
        stale = [slot for slot, p in list(self._pending.items()) if now - p.sent_at > RECLAIM_AFTER]
        if stale:
            log.warning("storage worker never answered for %d blocks; reclaiming their slots",
                        len(stale))
            self._done(StoreDone(stale, failed=len(stale), error="the storage worker died",
                                 error_code="worker_gone"))


def open_ssd_tier(launch: EngineLaunch, model: Any, ctx: zmq.Context, endpoint: str,
                  kind_part: str = "") -> SsdTier | None:
    """The SSD tier for a loaded model, or None (off, a cache mlx-lm cannot slice into blocks,
    or no shared memory). The namespace names everything a block's bytes depend on;
    `kind_part` is what the engine's kind adds (an adapter set, a shard)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.kv.codec import CacheCodec
    from mlxd.engine.kv.quant import config_of
    from mlxd.engine.kv.ssd_snapshots import snap_layout
    from mlxd.engine.load.loader import resolve_model_dir
    from mlxd.protocol.models import model_id
    if launch.ssd_root is None or not endpoint:
        return None
    probe = make_prompt_cache(model)
    cache_codec = CacheCodec(probe)
    if not cache_codec.supported:
        log.info("no SSD tier: mlxd cannot hold this model's cache class %s",
                 cache_codec.unsupported)
        return None
    model(mx.array([[0]]), cache=probe)
    leaves = cache_codec.leaves(probe)
    kv = [leaves[i] for i in cache_codec.appends]
    quant = config_of(model)  # --kv-bits: blocks hold the quantized triplets as they are
    bits, group = quant if quant is not None else (0, 0)
    kv_dtypes: dict[Any, KvDtype] = {mx.float32: "float32", mx.float16: "float16",
                                    mx.bfloat16: "bfloat16"}
    shapes: set[tuple[int, int, int, KvDtype | None]] = set()
    for c in kv:  # (packed, scales, biases): the head size is the scales' times group
        k, v = (c.keys[1], c.values[1]) if quant is not None else (c.keys, c.values)
        shapes.add((k.shape[1], k.shape[3] * (group or 1), v.shape[3] * (group or 1),
                    kv_dtypes.get(k.dtype)))
    if len(shapes) > 1 or None in {sh[3] for sh in shapes}:
        log.info("no SSD tier: this model's KV layers differ in shape or dtype (%s)", shapes)
        return None
    heads, kd, vd, found = shapes.pop() if shapes else (0, 0, 0, "float32")
    dtype: KvDtype = found or "float32"
    layout = Layout(len(kv), heads, kd, vd, dtype, bits, group)
    snaps = snap_layout(cache_codec, probe)
    block_tokens = launch.settings.block_tokens
    digest = weights_digest(resolve_model_dir(launch.model, Path(launch.cache_dir)))
    mlx_version = mx.__version__  # type: ignore[attr-defined]  # missing from mlx's stubs
    description = (f"v1|{model_id(launch.model)}|{digest}|{dtype}|{block_tokens}|"
                   f"mlx {mlx_version}|{layout}")
    if quant is not None:  # also in the layout above; named here too, plainly
        description += f"|kv {bits} bits, group {group}"
    if snaps is not None:  # a model with state layers: its snapshots' layout too
        description += f"|states {cache_codec.describe()}|{snaps}"
    description += kind_part
    try:
        return SsdTier(root=Path(launch.ssd_root), layout=layout, description=description,
                       block_tokens=block_tokens, run_dir=Path(launch.run_dir),
                       engine_id=launch.engine_id, epoch=launch.epoch,
                       slots=launch.settings.kv_slots, verify=launch.settings.ssd_cache_verify,
                       ctx=ctx, endpoint=endpoint,
                       device_staging=stages_on_device(launch.tuning.ssd_staging,
                                                       mx.default_device()),
                       snap_layout=snaps)
    except OSError as e:
        log.error("no SSD tier: cannot create shared memory: %s", e)
        return None
