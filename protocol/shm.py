"""POSIX shared memory for KV handoff: one owner creates and unlinks, others attach untracked.

Names are at most 30 characters (macOS allows 31 including the slash) and derived from the
run dir, engine id and epoch, so the supervisor can unlink a dead engine's segment by name and
a later start can remove leftovers listed in the run dir's manifest.
"""

from __future__ import annotations

import _posixshmem  # the same module multiprocessing.shared_memory uses
import hashlib
import os
import sys
import threading
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

MAX_NAME = 30
_patch_lock = threading.Lock()
MANIFEST = "shm.list"


def segment_name(run_dir: Path, engine_id: str, epoch: int) -> str:
    tag = hashlib.sha1(str(run_dir).encode()).hexdigest()[:4]
    name = f"mlxd{tag}{engine_id}.{epoch}"
    if len(name) > MAX_NAME:
        raise ValueError(f"shared-memory name {name!r} is longer than {MAX_NAME} characters")
    return name


def _open(name: str, create: bool, size: int = 0) -> shared_memory.SharedMemory:
    """Open without the resource tracker: on Python < 3.13 every segment is registered with a
    tracker process that unlinks it when this process exits (and would be one more process to
    outlive us); ownership is managed explicitly instead."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=create, size=size, track=False)
    with _patch_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda *a, **k: None
        try:
            return shared_memory.SharedMemory(name=name, create=create, size=size)
        finally:
            resource_tracker.register = register


def create(run_dir: Path, name: str, size: int) -> shared_memory.SharedMemory:
    fd = os.open(run_dir / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:  # recorded first: a crash cannot hide it
        f.write(name + "\n")
    unlink(name)  # a leftover of the same name from a dead daemon
    return _open(name, True, size)


def attach(name: str) -> shared_memory.SharedMemory:
    return _open(name, False)


def unlink(name: str) -> bool:
    """Remove a segment by name (existing mappings stay valid until closed)."""
    try:
        _posixshmem.shm_unlink("/" + name.lstrip("/"))
    except FileNotFoundError:
        return False
    return True


def remove_leftovers(run_dir: Path) -> int:
    """Unlink every segment a previous daemon with this run dir recorded."""
    path = run_dir / MANIFEST
    if not path.exists():
        return 0
    n = sum(unlink(name) for name in set(path.read_text().split()))
    path.unlink(missing_ok=True)
    return n


def exists(name: str) -> bool:
    if os.path.isdir("/dev/shm"):
        return os.path.exists(f"/dev/shm/{name}")
    try:
        attach(name).close()
        return True
    except FileNotFoundError:
        return False
