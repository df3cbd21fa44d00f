"""The block directory on SSD: atomic, durable writes, an index rebuilt from file names at
start, and least-recently-used eviction under a byte cap. Runs in the storage worker only.

Durability: write `name.tmp`, fsync it, rename into place, fsync the directory. A crash at any
point leaves either no file or a complete one, plus perhaps a `.tmp` that the next start deletes.
Eviction removes leaves first (blocks no other block chains from), so a kept block's prefix is
always kept too; each block is one file, so a block shared by many conversations counts once.

A write the disk refuses is classified here (`refusal`), where the OSError is seen: the code
travels in `StoreDone.error_code` to the engine, which backs off, and on to `/admin/cache/flush`.
The root directory is never created here (the daemon creates it at start): a root that vanished
(an unmounted drive, a removed cache dir) is reported as "gone" instead of being silently
recreated on whatever disk now holds its parent.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mlxd.protocol import faults
from mlxd.protocol.block_format import parse_name

log = logging.getLogger("mlxd.storage")

# errno -> the code the engine and the API report for a refused write; anything else: io_error
_REFUSALS = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EROFS: "read_only",
             errno.EACCES: "permission_denied", errno.EPERM: "permission_denied",
             errno.ENOENT: "gone", errno.ENOTDIR: "gone"}
_WHAT = {"disk_full": "the disk is full", "read_only": "the file system is read-only",
         "permission_denied": "permission denied", "gone": "the cache directory is gone",
         "io_error": "I/O error"}


def refusal(e: BaseException) -> tuple[str, str]:
    """(code, message) for a failed block write: disk_full, read_only, permission_denied, gone
    (the cache dir was removed or is not a directory) or io_error."""
    code = _REFUSALS.get(getattr(e, "errno", None) or -1, "io_error")
    return code, f"{_WHAT[code]}: {e}"


@dataclass
class _Block:
    path: Path
    size: int
    used: float
    parent: str
    key: str


class BlockStore:
    def __init__(self, root: Path, cap_bytes: int) -> None:
        self.root = root
        self.cap_bytes = cap_bytes
        self.blocks: dict[str, _Block] = {}  # key hex -> block
        self.children: dict[str, int] = {}  # parent key hex -> blocks chaining from it
        self.bytes = 0
        self.evicted = 0

    # ------------------------------------------------------------------ start

    def scan(self) -> None:
        """Rebuild the index from the directory; delete leftover temporary files."""
        self.blocks.clear()
        self.children.clear()
        self.bytes = 0
        removed = 0
        if not self.root.exists():
            return
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                path = Path(dirpath) / name
                if name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                    removed += 1
                    continue
                parsed = parse_name(name)
                if parsed is None:
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                self._add(path, st.st_size, st.st_mtime, parsed[0], parsed[2])
        if removed:
            log.info("removed %d leftover temporary files", removed)
        log.info("SSD tier: %d blocks, %.1f MiB in %s", len(self.blocks), self.bytes / 2**20,
                 self.root)

    def _add(self, path: Path, size: int, used: float, parent: str, key: str) -> None:
        if key in self.blocks:
            return
        self.blocks[key] = _Block(path, size, used, parent, key)
        self.children[parent] = self.children.get(parent, 0) + 1
        self.bytes += size

    # ------------------------------------------------------------------ write

    def write(self, path: Path, parts: list[bytes | memoryview]) -> int:
        """Write one block durably; return bytes written (0 if it already existed)."""
        name = parse_name(path.name)
        assert name is not None, f"not a block file name: {path.name}"
        parent, _, key = name
        if key in self.blocks and path.exists():
            self.blocks[key].used = time.time()
            return 0
        self._make_dirs(path.parent)
        tmp = path.with_name(path.name + ".tmp")
        size = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for part in parts:  # views released even on an error: `part` may be shared memory
                with memoryview(part) as whole:
                    done = 0
                    while done < len(whole):
                        with whole[done:] as rest:
                            n = os.write(fd, rest)
                        done += n
                size += done
            faults.hit("storage.write")  # a kill here leaves only a .tmp
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            os.rename(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            # not durable: leave no file that a lookup would take for a durable block
            tmp.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            raise
        self._add(path, size, time.time(), parent, key)
        return size

    def probe(self, nbytes: int) -> None:
        """Raise the OSError a block write of `nbytes` would meet now (disk full, read-only,
        gone...); else return, having written and removed a temporary file of that size in the
        root (never created: a vanished root stays vanished)."""
        tmp = self.root / ".probe.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            zeros = bytes(min(nbytes, 1 << 20))
            left = nbytes
            while left > 0:
                left -= os.write(fd, zeros[:left])
            faults.hit("storage.write")
            os.fsync(fd)
        finally:
            os.close(fd)
            tmp.unlink(missing_ok=True)

    def _make_dirs(self, d: Path) -> None:
        """Create `d` and its parents below the root, never the root itself."""
        if d == self.root or d.is_dir():
            return
        self._make_dirs(d.parent)
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():  # a file where a directory belongs
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                         str(d)) from None

    def touch(self, key: str) -> None:
        b = self.blocks.get(key)
        if b is not None:
            b.used = time.time()

    # ------------------------------------------------------------------ cap

    def evict_to_cap(self) -> int:
        """Delete least recently used leaf blocks until under the cap."""
        if self.cap_bytes <= 0 or self.bytes <= self.cap_bytes:
            return 0
        n = 0
        while self.bytes > self.cap_bytes:
            leaves = [b for b in self.blocks.values() if not self.children.get(b.key)]
            if not leaves:
                break
            leaves.sort(key=lambda b: b.used)
            for b in leaves:
                if self.bytes <= self.cap_bytes:
                    break
                self._remove(b)
                n += 1
        self.evicted += n
        return n

    def _remove(self, b: _Block) -> None:
        try:
            b.path.unlink()
        except FileNotFoundError:
            pass
        del self.blocks[b.key]
        self.bytes -= b.size
        left = self.children.get(b.parent, 0) - 1
        if left > 0:
            self.children[b.parent] = left
        else:
            self.children.pop(b.parent, None)
