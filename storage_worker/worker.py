"""The storage worker's loop: engines hand over blocks in shared-memory slots; the worker packs,
hashes (blake3), writes, fsyncs and renames them into place, then frees the slots. CPU only: it
never imports MLX. Serving never waits on it: when the disk is full, read-only or gone, it
answers failures (engines keep serving without the SSD tier) and recovers on its own.

Stopping: the supervisor's `Shutdown` comes once the engines have exited (they flush first),
so the worker answers what is still queued and exits. SIGTERM may come at the same moment as
the engines' own (a signal to the whole process group), while they still flush through it: the
worker then serves on until no engine is connected (a socket monitor counts them), for at most
`stop_grace` seconds."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

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
    DiskProbed,
    Heartbeat,
    Hello,
    ProbeDisk,
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
        self.stop_grace = launch.stop_grace
        self._stop_at: float | None = None  # when SIGTERM came
        self._engines = 0  # connections to our socket (only engines connect)

    def request_stop(self) -> None:
        """SIGTERM: finish the connected engines' writes, then exit (see the docstring)."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()

    def run(self, wakeup: socket.socket | None = None) -> int:
        """Serve until stopped; `wakeup`: a socket a signal writes to (signal.set_wakeup_fd),
        polled with the others so that SIGTERM is seen at once."""
        try:
            self.store.scan()
        except OSError as e:
            self.error = f"cannot read {self.store.root}: {e}"
            log.error("%s", self.error)
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 1000)
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        router.bind(self.storage_ep)
        make_private(self.storage_ep)
        ctl = None
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if wakeup is not None:
            poller.register(wakeup, zmq.POLLIN)
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
        stopping_logged = False
        try:
            while True:
                events = dict(poller.poll(500))
                if wakeup is not None and wakeup in events:
                    try:
                        wakeup.recv(64)
                    except BlockingIOError:
                        pass
                if monitor in events:
                    self._count_engines(monitor)
                if router in events:
                    self._serve_one(router, dec, enc)
                if self._stop_at is not None:
                    if not stopping_logged:
                        stopping_logged = True
                        log.info("SIGTERM: serving %d connected engines' writes before exiting",
                                 self._engines)
                    if self._engines <= 0 or time.monotonic() - self._stop_at > self.stop_grace:
                        if self._engines > 0:
                            log.warning("%d engines still connected after %g s; exiting",
                                        self._engines, self.stop_grace)
                        self._serve_queued(router, dec, enc)
                        return exit_codes.OK
                if ctl is not None:
                    if ctl in events and isinstance(ctl_dec.decode(ctl.recv()), Shutdown):
                        log.info("shutdown requested")
                        self._serve_queued(router, dec, enc)
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
            router.disable_monitor()
            monitor.close()
            router.close()
            if ctl is not None:
                ctl.close()
            for seg in self._segments.values():
                seg.close()

    def _serve_one(self, router: zmq.Socket, dec: Any, enc: Any) -> None:
        peer, data = router.recv_multipart()
        try:
            msg = dec.decode(data)
        except msgspec.DecodeError as e:
            log.warning("dropped an undecodable message: %s", e)
            return
        match msg:
            case StoreBlocks():
                router.send_multipart([peer, enc.encode(self._store(msg))])
            case TouchBlocks(names=names):
                self._touch(names)
            case ProbeDisk(nbytes=nbytes):
                router.send_multipart([peer, enc.encode(self._probe(nbytes))])

    def _probe(self, nbytes: int) -> DiskProbed:
        try:
            self.store.probe(nbytes)
        except (OSError, faults.FaultInjected) as e:
            code, error = refusal(e)
            return DiskProbed(code, error)
        if self.error_code == "gone":
            self.store.scan()  # the cache dir is back (remounted, recreated): index it again
        if self.error_code:
            log.info("SSD tier writable again (a probe)")
        self.error = self.error_code = None
        return DiskProbed()

    def _serve_queued(self, router: zmq.Socket, dec: Any, enc: Any) -> None:
        """Before exiting: what engines sent and we have not read yet is written too (their
        slots' bytes stay readable through our mapping after their segment is unlinked)."""
        while router.poll(0, zmq.POLLIN):
            self._serve_one(router, dec, enc)

    def _count_engines(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)["event"]
            self._engines += 1 if event == zmq.EVENT_ACCEPTED else -1

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
            try:
                # released on leaving, whatever happens: an exported view of the segment
                # would make closing it fail (BufferError)
                with seg.buf[b.slot * msg.slot_bytes: b.slot * msg.slot_bytes + size] as payload:
                    wrote = self._write_block(msg, b, ns_dir, payload)
            except (OSError, faults.FaultInjected) as e:
                # The disk refused: the rest of this message is not tried (it would be refused
                # alike); the engine backs off and probes later.
                done.failed = len(msg.blocks) - i
                done.error_code, done.error = refusal(e)
                break
            if wrote:
                done.written += 1
                done.bytes_written += wrote
            else:
                done.existed += 1
        if done.failed == 0:
            done.evicted = self.store.evict_to_cap()
        return self._finish(done)

    def _write_block(self, msg: StoreBlocks, b: Any, ns_dir: Path, payload: memoryview) -> int:
        n = len(b.tokens)
        digest = payload_hash(payload)
        key = snap_key(b.key) if b.snapshot else b.key
        header = pack_header(msg.layout, msg.namespace, b.parent, key, b.tokens, digest,
                             len(payload), b.tail, b.snapshot)
        path = Path(snap_file(str(ns_dir), b.parent, n, b.key)) if b.snapshot \
            else block_path(ns_dir, b.parent, n, b.key)
        return self.store.write(path, [header, payload])

    def _finish(self, done: StoreDone) -> StoreDone:
        if done.error_code and done.error_code != self.error_code:
            log.error("SSD tier cannot write (%s): %s", done.error_code, done.error)
        elif not done.error_code and self.error_code:
            log.info("SSD tier writable again")
        self.error, self.error_code = done.error, done.error_code
        done.disk_bytes = self.store.bytes
        done.disk_blocks = len(self.store.blocks)
        return done
