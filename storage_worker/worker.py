"""The storage worker's loop: engines hand over blocks in shared-memory slots; the worker packs,
hashes (blake3), writes, fsyncs and renames them into place, then frees the slots. CPU only: it
never imports MLX. Serving never waits on it: when the disk is full, read-only or gone, it
answers failures (engines keep serving without the SSD tier) and recovers on its own."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from mlxd.protocol import codec, exit_codes, faults, shm
from mlxd.protocol.addresses import Endpoints, identity, make_private
from mlxd.protocol.block_format import (
    block_path,
    pack_header,
    parse_name,
    payload_hash,
    snap_file,
    snap_key,
)
from mlxd.protocol.messages import (
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    StoreBlocks,
    StoreDone,
    TouchBlocks,
)
from mlxd.protocol.settings import StorageLaunch
from mlxd.storage_worker.block_store import BlockStore, refusal

log = logging.getLogger("mlxd.storage")


class StorageWorker:
    def __init__(self, launch: StorageLaunch, ctx: zmq.Context, endpoints: Endpoints) -> None:
        self.store = BlockStore(Path(launch.root), int(launch.settings.ssd_cache_max * 2**30))
        self.ctx = ctx
        self.storage_ep = endpoints.storage
        self.control_ep = endpoints.control if launch.supervised else None
        self.epoch = launch.epoch
        self.error: str | None = None
        self.error_code: str | None = None  # the last write's refusal (block_store.refusal)
        self._segments: dict[str, Any] = {}  # name -> attached SharedMemory
        self._latest: dict[str, tuple[int, str]] = {}  # engine id -> (epoch, segment)

    def run(self) -> int:
        try:
            self.store.scan()
        except OSError as e:
            self.error = f"cannot read {self.store.root}: {e}"
            log.error("%s", self.error)
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        router.bind(self.storage_ep)
        make_private(self.storage_ep)
        ctl = None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        sup = codec.to_supervisor()
        parent = os.getppid()
        if self.control_ep:
            ctl = self.ctx.socket(zmq.DEALER)
            ctl.setsockopt(zmq.IDENTITY, identity("storage", "storage", self.epoch))
            ctl.setsockopt(zmq.LINGER, 1000)
            ctl.connect(self.control_ep)
            ctl.send(sup.encode(Hello("storage", "storage", self.epoch, os.getpid())))
            ctl.send(sup.encode(Ready("storage", self.epoch, str(self.store.root))))
            poller.register(ctl, zmq.POLLIN)
        dec = codec.to_storage()
        enc = codec.from_storage()
        ctl_dec = codec.to_child()
        next_beat = 0.0
        try:
            while True:
                events = dict(poller.poll(500))
                if router in events:
                    peer, data = router.recv_multipart()
                    try:
                        msg = dec.decode(data)
                    except msgspec.DecodeError as e:
                        log.warning("dropped an undecodable message: %s", e)
                        continue
                    match msg:
                        case StoreBlocks():
                            router.send_multipart([peer, enc.encode(self._store(msg))])
                        case TouchBlocks(names=names):
                            self._touch(names)
                if ctl is not None:
                    if ctl in events and isinstance(ctl_dec.decode(ctl.recv()), Shutdown):
                        log.info("shutdown requested")
                        return exit_codes.OK
                    now = time.monotonic()
                    if now >= next_beat:
                        next_beat = now + 0.5
                        ctl.send(sup.encode(Heartbeat("storage", self.epoch)))
                        if os.getppid() != parent:
                            log.error("supervisor is gone; exiting")
                            return exit_codes.PARENT_GONE
                elif os.getppid() != parent:
                    return exit_codes.PARENT_GONE
        finally:
            router.close()
            if ctl is not None:
                ctl.close()
            for seg in self._segments.values():
                seg.close()

    def _touch(self, names: list[str]) -> None:
        for name in names:
            parsed = parse_name(name)
            if parsed:
                self.store.touch(parsed[2])

    def _segment(self, msg: StoreBlocks) -> Any:
        seg = self._segments.get(msg.segment)
        if seg is None:
            old = self._latest.get(msg.engine_id)
            if old is not None and old[0] < msg.epoch and old[1] in self._segments:
                self._segments.pop(old[1]).close()  # a dead epoch's segment: let it go
            seg = shm.attach(msg.segment)
            self._segments[msg.segment] = seg
            self._latest[msg.engine_id] = (msg.epoch, msg.segment)
        return seg

    def _store(self, msg: StoreBlocks) -> StoreDone:
        done = StoreDone(slots=[b.slot for b in msg.blocks])
        layout = msg.layout
        ns_dir = self.store.root / msg.namespace.hex()[:16]
        try:
            seg = self._segment(msg)
        except (FileNotFoundError, OSError) as e:
            done.failed = len(msg.blocks)
            done.error = f"shared memory {msg.segment} is gone: {e}"
            done.error_code = "shm_gone"
            return self._finish(done)
        if self.error_code == "gone" and self.store.root.is_dir():
            self.store.scan()  # the cache dir is back (remounted, recreated): index it again
        for i, b in enumerate(msg.blocks):
            n = len(b.tokens)
            size = b.nbytes if b.snapshot else layout.payload_bytes(n)
            if not 0 < size <= msg.slot_bytes:  # an engine's bug: never read past a slot
                log.error("dropped a block of %d bytes for slots of %d", size, msg.slot_bytes)
                continue
            payload = seg.buf[b.slot * msg.slot_bytes: b.slot * msg.slot_bytes + size]
            try:
                digest = payload_hash(payload)
                key = snap_key(b.key) if b.snapshot else b.key
                header = pack_header(layout, msg.namespace, b.parent, key, b.tokens, digest,
                                     size, b.tail, b.snapshot)
                path = Path(snap_file(str(ns_dir), b.parent, n, b.key)) if b.snapshot \
                    else block_path(ns_dir, b.parent, n, b.key)
                wrote = self.store.write(path, [header, payload])
            except (OSError, faults.FaultInjected) as e:
                # The disk refused: the rest of this message is not tried (it would be refused
                # alike); the engine backs off and probes later.
                done.failed = len(msg.blocks) - i
                done.error_code, done.error = refusal(e)
                break
            else:
                if wrote:
                    done.written += 1
                    done.bytes_written += wrote
                else:
                    done.existed += 1
            finally:
                payload.release()
        if done.failed == 0:
            done.evicted = self.store.evict_to_cap()
        return self._finish(done)

    def _finish(self, done: StoreDone) -> StoreDone:
        if done.error_code and done.error_code != self.error_code:
            log.error("SSD tier cannot write (%s): %s", done.error_code, done.error)
        elif not done.error_code and self.error_code:
            log.info("SSD tier writable again")
        self.error, self.error_code = done.error, done.error_code
        done.disk_bytes = self.store.bytes
        done.disk_blocks = len(self.store.blocks)
        return done
