"""The SSD tier on a disk that refuses writes (issue 12, item 5): full, read-only, or the cache
directory removed. A flush answers at once with a typed failure (HTTP 507), serving goes on from
RAM, nothing spins while idle, and the tier recovers by itself once the disk takes writes again.

Real failing file systems where the sandbox allows mounting (a tiny tmpfs filled up, then
remounted read-only); otherwise those tests skip, and the removed-directory case (no privilege
needed) and the injected-errno case (`storage.write=errno:ENOSPC`) still run."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.engine.kv.ssd_health import Admit, Change, Refusal, WriteHealth
from mlxd.protocol import faults
from mlxd.storage_worker.block_store import BlockStore, refusal

BLOCK = 16
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 2}
PROMPT_FLUSH_S = 5.0  # a flush on a refusing disk answers well within this
STATUS_SETTLE_S = 1.0  # /stats engine figures are refreshed every 0.5 s
IDLE_WINDOW_S = 2.0


# ---------------------------------------------------------------- pure parts


def test_write_health_backs_off_and_one_probe_decides():
    h = WriteHealth(first=1.0, most=4.0)
    assert h.admit(0.0) is Admit.WRITE
    full = Refusal("disk_full", "the disk is full")
    assert h.answered([0, 1], full, now=10.0) is Change.DEGRADED
    assert h.answered([2], full, now=10.1) is None  # sent before the tier degraded: no news
    assert h.admit(10.5) is Admit.SKIP and h.refused(10.5)
    assert h.admit(11.0) is Admit.PROBE
    h.probing(3)
    assert h.admit(11.0) is Admit.SKIP and not h.refused(11.0)  # one probe at a time
    assert h.answered([3], full, now=11.0) is Change.STILL_DEGRADED
    assert h.retry_in(11.0) == 2.0
    h.probing(4)
    h.answered([4], full, now=13.0)
    h.probing(5)
    h.answered([5], full, now=17.0)
    assert h.retry_in(17.0) == 4.0  # capped
    h.retry_now(17.5)  # an explicit flush
    assert h.admit(17.5) is Admit.PROBE
    h.probing(6)
    assert h.answered([7], None, now=17.6) is None  # not the probe
    assert h.degraded
    assert h.answered([6], None, now=17.7) is Change.RECOVERED
    assert h.admit(17.7) is Admit.WRITE and h.retry_in(17.7) == 0.0
    assert h.answered([8], full, now=20.0) is Change.DEGRADED and h.retry_in(20.0) == 1.0


def test_a_tier_degraded_for_five_minutes_notices_the_recovered_disk_within_five_seconds():
    """Simulated time: a disk refusing every block probe and every disk probe for five minutes
    (the block backoff at its 60 s cap by then), then taking writes: the next disk probe, at
    most 5 s later, recovers the tier, and every block is written again."""
    h = WriteHealth()
    full = Refusal("disk_full", "the disk is full")
    now, slot = 0.0, 0
    h.answered([slot], full, now)
    while now < 300:  # blocks offered all the time; the storage thread's loop every 50 ms
        now += 0.05
        if h.admit(now) is Admit.PROBE:
            slot += 1
            h.probing(slot)
            assert h.answered([slot], full, now) is Change.STILL_DEGRADED
        if h.disk_probe_due(now):
            h.disk_probing()
            assert not h.disk_probe_due(now)  # one at a time
            assert h.disk_answered(full, now) is None
    assert h.backoff == 60.0  # a block is tried once a minute by now
    freed = now
    while not h.disk_probe_due(now):
        now += 0.05
    assert now - freed <= 5.0
    h.disk_probing()
    assert h.disk_answered(None, now) is Change.RECOVERED
    assert h.admit(now) is Admit.WRITE and not h.disk_probe_due(now + 10)


def test_a_flush_during_a_probe_from_before_the_recovery_probes_again_at_once():
    """The probe out when the flush asked was refused by the disk as it was: the flush's own
    probe goes at once instead of after the backoff."""
    h = WriteHealth(first=1.0, most=60.0)
    full = Refusal("disk_full", "the disk is full")
    h.answered([0], full, now=0.0)
    h.probing(1)
    h.retry_now(1.5)  # the flush, with the earlier probe still out
    assert h.answered([1], full, now=1.6) is Change.STILL_DEGRADED
    assert h.admit(1.6) is Admit.PROBE and not h.refused(1.6)
    h.probing(2)  # the flush's own probe: its refusal stands
    assert h.answered([2], full, now=1.7) is Change.STILL_DEGRADED
    assert h.refused(1.7) and h.retry_in(1.7) == 4.0


def test_write_errors_are_classified_and_a_vanished_root_is_not_recreated(tmp_path):
    for code, want in ((errno.ENOSPC, "disk_full"), (errno.EDQUOT, "disk_full"),
                       (errno.EROFS, "read_only"), (errno.EACCES, "permission_denied"),
                       (errno.EPERM, "permission_denied"), (errno.ENOENT, "gone"),
                       (errno.ENOTDIR, "gone"), (errno.EIO, "io_error")):
        assert refusal(OSError(code, os.strerror(code)))[0] == want
    assert refusal(faults.FaultInjected("x"))[0] == "io_error"

    root = tmp_path / "kv"
    root.mkdir()
    store = BlockStore(root, 0)
    name = "00" * 32 + "-16-" + "11" * 32 + ".blk"
    assert store.write(root / "ns" / "00" / name, [b"x" * 100]) == 100
    shutil.rmtree(root)
    with pytest.raises(OSError) as e:
        store.write(root / "ns" / "00" / name.replace("11", "22"), [b"x"])
    assert refusal(e.value)[0] == "gone"
    assert not root.exists()  # an unmounted drive's mount point is not filled behind its back
    root.mkdir()
    (root / "ns").write_text("a file where the namespace directory belongs")
    with pytest.raises(OSError) as e:
        store.write(root / "ns" / "00" / name.replace("11", "33"), [b"x"])
    assert refusal(e.value)[0] == "gone"


def test_the_disk_probe_leaves_nothing_and_never_recreates_a_vanished_root(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    store = BlockStore(root, 0)
    store.probe(3 << 20)  # more than one write's worth of zeros
    assert list(root.iterdir()) == []
    shutil.rmtree(root)
    with pytest.raises(OSError) as e:
        store.probe(4096)
    assert refusal(e.value)[0] == "gone" and not root.exists()


def test_errno_fault_action():
    faults.configure(0, "storage.write=errno:EROFS@2")
    try:
        faults.hit("storage.write")  # from the 2nd hit on
        for _ in range(2):
            with pytest.raises(OSError) as e:
                faults.hit("storage.write")
            assert e.value.errno == errno.EROFS
        with pytest.raises(ValueError):
            faults.configure(0, "storage.write=errno:ENOSUCHTHING")
    finally:
        faults.configure(None, "")


# ---------------------------------------------------------------- real daemons


def serve(model, ssd: Path, *extra, **kw):
    return start_daemon(model, "--ssd-cache", str(ssd), "--block-tokens", str(BLOCK),
                        "--kv-slots", "2", "--restart-backoff", "0.1", *extra, isolate=True, **kw)


def chat(d, user: str, max_tokens: int = 8) -> dict:
    with d.http() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [SYSTEM, {"role": "user", "content": user}], "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return r.json()


def flush(d) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    with d.unix_http() as c:
        r = c.post("/admin/cache/flush")
    return r.status_code, r.json(), time.monotonic() - t0


def cache(d) -> dict:
    return d.stats()["engines"][0]["cache"]


def assert_refused(d, code: str) -> dict:
    """A flush answers promptly: 507, not durable, the code and reason per engine."""
    status, body, took = flush(d)
    assert took < PROMPT_FLUSH_S, f"flush took {took:.1f} s"
    assert status == 507, body
    assert body["durable"] is False and body["error"]["code"] == code, body
    assert "not durable" in body["error"]["message"]
    (engine,) = body["engines"]
    assert engine["error_code"] == code and engine["error"], engine
    assert engine["unwritten"] > 0
    assert {"written", "failed", "pending"} <= body.keys()
    d.wait_until(lambda s: s["engines"][0]["cache"]["ssd_state"].startswith(f"degraded: {code}"),
                 what=f"/stats to say degraded: {code}")
    c = cache(d)
    assert c["ssd_error_code"] == code and "next try" in c["ssd_state"]
    return body


def assert_recovers(d) -> None:
    status, body, _ = flush(d)
    assert status == 200 and body["durable"] is True, body
    assert body["failed"] == 0 and body["pending"] == 0 and body["written"] > 0, body
    assert body["engines"][0]["error_code"] is None
    d.wait_until(lambda s: s["engines"][0]["cache"]["ssd_state"] == "ok",
                 what="the SSD tier to recover")


def assert_no_spin(d) -> None:
    """Idle on a refusing disk: no write is retried, the storage worker sleeps."""
    worker = next(c["pid"] for c in d.stats()["children"] if c["role"] == "storage")
    proc = psutil.Process(worker)
    time.sleep(STATUS_SETTLE_S)  # let /stats catch up with the last failures
    failures, cpu = cache(d)["ssd_write_failures"], sum(proc.cpu_times()[:2])
    time.sleep(IDLE_WINDOW_S)  # a measurement window: nothing should happen in it
    assert cache(d)["ssd_write_failures"] == failures
    assert sum(proc.cpu_times()[:2]) - cpu < 0.3


def blocks(root: Path) -> list[Path]:
    return sorted(root.rglob("*.blk"))


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs: a disk that really fills up and can really turn read-only."""
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs Linux")
    path = tmp_path / "kv"
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(path)], capture_output=True)
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(root: Path) -> Path:
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def test_full_then_read_only_disk(tiny_model, tmpfs):
    d = serve(tiny_model, tmpfs)
    try:
        filler = fill(tmpfs)
        for i in range(3):  # more blocks than the 2 slots: a flush needs several rounds
            chat(d, f"Question {i}: tell me about the sea and the lighthouse.")
        assert_refused(d, "disk_full")
        chat(d, "Still serving while the disk is full?")
        assert_no_spin(d)
        assert not blocks(tmpfs) and not list(tmpfs.rglob("*.tmp"))

        filler.unlink()  # space freed: the next flush probes, recovers and writes everything
        assert_recovers(d)
        assert len(blocks(tmpfs)) >= 6

        remount(tmpfs, "ro")
        chat(d, "A new conversation on a read-only disk.")
        assert_refused(d, "read_only")
        assert_no_spin(d)
        remount(tmpfs, "rw")
        assert_recovers(d)
        stop(d)
    finally:
        d.cleanup()


def _mlxd(*argv: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    return subprocess.run([sys.executable, "-m", "mlxd", *argv], capture_output=True, text=True,
                          env={**clean, "MLXD_CONFIG": os.devnull}, timeout=60)


def test_cache_dir_removed_while_running(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    d = serve(tiny_model, ssd)
    try:
        chat(d, "Warm up the cache.")
        assert_recovers(d)
        shutil.rmtree(ssd)
        chat(d, "Where did my cache directory go?")
        assert_refused(d, "gone")
        assert not ssd.exists()  # not recreated behind the owner's back
        out = _mlxd("flush", "--socket", d.socket)
        assert out.returncode == 1, out
        assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "flush failed (gone)" in out.stderr and "not durable" in out.stderr

        ssd.mkdir()  # the directory is back
        assert_recovers(d)
        assert blocks(ssd)
        stop(d)
    finally:
        d.cleanup()


def test_injected_enospc_flush_drain_and_shutdown_answer_promptly(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    d = serve(tiny_model, ssd, env={"MLXD_FAULTS": "storage.write=errno:ENOSPC"})
    try:
        for i in range(3):
            chat(d, f"Question {i}: is the disk full?")
        assert_refused(d, "disk_full")
        chat(d, "Still there?")
        assert_no_spin(d)
        assert not blocks(ssd) and not list(ssd.rglob("*.tmp"))
        with d.unix_http() as c:
            r = c.post("/admin/drain", json={"timeout": 5})
        assert r.status_code == 200, r.text
        flushed = r.json()["flushed"]
        assert flushed["durable"] is False and flushed["error"]["code"] == "disk_full"
        t0 = time.monotonic()
        stop(d)  # the shutdown flush ends at the first refusal, not after its 10 s bound
        assert time.monotonic() - t0 < 8.0
    finally:
        d.cleanup()


def test_a_full_disk_freed_is_written_again_within_seconds_without_a_flush(tiny_model, tmpfs):
    """A disk full for 16 s under traffic (the block backoff has grown to 16 s by then), then
    space freed: the idle tier notices within seconds, and the next request's blocks reach the
    disk within 10 s of the freeing, with no flush to prompt it."""
    d = serve(tiny_model, tmpfs)
    try:
        filler = fill(tmpfs)
        i = 0
        full_since = time.monotonic()
        while time.monotonic() - full_since < 16:  # blocks offered, probes refused
            chat(d, f"Question {i}: is the disk still full?")
            i += 1
        assert not blocks(tmpfs)
        filler.unlink()
        freed = time.monotonic()
        # idle: the disk probe notices (every 5 s; /stats is refreshed every 0.5 s)
        d.wait_until(lambda s: s["engines"][0]["cache"]["ssd_state"] == "ok", timeout=10,
                     what="the SSD tier to notice the freed disk")
        chat(d, f"Question {i}: and now?")
        while not blocks(tmpfs):
            assert time.monotonic() - freed < 10, f"nothing written 10 s after\n{d.log()}"
            chat(d, f"Question {i}: and now?")
            i += 1
        assert_recovers(d)
        stop(d)
    finally:
        d.cleanup()
