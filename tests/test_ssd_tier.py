"""The SSD tier through real processes: durability across kill -9, torn and corrupt files,
shared blocks stored once, the byte cap. A disk that fails: test_ssd_failing_disk.py."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil

from conftest import start_daemon
from conftest import stop_and_check as stop

BLOCK = 16
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 2}


def chat(d, user, max_tokens=8, system=SYSTEM):
    with d.http() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [system, {"role": "user", "content": user}], "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def blocks(root: Path) -> list[Path]:
    return sorted(root.rglob("*.blk"))


def cache(d) -> dict:
    return d.stats()["engines"][0]["cache"]


def flush(d) -> dict:
    with d.unix_http() as c:
        r = c.post("/admin/cache/flush")
    assert r.status_code == 200
    return r.json()


def serve(model, ssd: Path, *extra, run_dir=None, **kw):
    return start_daemon(model, "--ssd-cache", str(ssd), "--block-tokens", str(BLOCK),
                        "--restart-backoff", "0.1", *extra, isolate=True, run_dir=run_dir, **kw)




def test_flush_kill_9_everything_restart_and_hit_ssd(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    d = serve(tiny_model, ssd)
    try:
        first = chat(d, "Tell me about the sea and the lighthouse.")
        done = flush(d)
        assert done["failed"] == 0 and done["pending"] == 0
        assert len(blocks(ssd)) >= 3  # written behind as the request finished, durable now
        assert not list(ssd.rglob("*.tmp"))
        procs = [psutil.Process(d.proc.pid)] + psutil.Process(d.proc.pid).children(recursive=True)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=5)
        d.proc.wait()
    finally:
        d.cleanup(keep_run_dir=True)
    # As a service manager would: the same run dir, where the dead daemon's lock, sockets and
    # shared memory are found and removed (stop() checks that nothing is left).
    d2 = serve(tiny_model, ssd, run_dir=d.run_dir)
    try:
        again = chat(d2, "Tell me about the sea and the lighthouse.")
        prompt = again["usage"]["prompt_tokens"]
        # the whole prompt but the one token that is always fed: full blocks and the boundary
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
        assert text_of(again) == text_of(first)
        c = cache(d2)
        assert c["ssd_hits"] == 1 and c["prefilled_tokens"] == 1
    finally:
        stop(d2)


def test_storage_worker_killed_mid_write_leaves_no_torn_file(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    d = serve(tiny_model, ssd, env={"MLXD_FAULTS": "storage.write=kill@1#0"})
    try:
        chat(d, "Tell me about the sea.")
        d.wait_until(lambda s: any(c["role"] == "storage" and c["epoch"] == 1
                                   and c["state"] == "ready" for c in s["children"]),
                     what="the storage worker restarted")
        assert not list(ssd.rglob("*.tmp")), "the restarted worker left a temporary file"
        for path in blocks(ssd):  # whatever made it to a final name is complete
            assert path.stat().st_size > 100
        again = chat(d, "Tell me about the lighthouse.")  # the engine kept serving
        assert again["usage"]["completion_tokens"] == 8
        assert flush(d)["failed"] == 0
    finally:
        stop(d)


def test_flipped_and_truncated_blocks_are_misses_not_errors(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    d = serve(tiny_model, ssd)
    try:
        first = chat(d, "Numbers: 1 2 3, and then?")
        flush(d)
    finally:
        stop(d)
    files = blocks(ssd)
    assert len(files) >= 3
    full = sorted(files, key=lambda p: int(p.name.split("-")[1]), reverse=True)
    data = bytearray(full[1].read_bytes())
    data[-5] ^= 0xFF  # a flipped payload byte
    full[1].write_bytes(bytes(data))
    with open(full[2], "r+b") as f:  # a torn file
        f.truncate(100)
    d2 = serve(tiny_model, ssd)
    try:
        again = chat(d2, "Numbers: 1 2 3, and then?")
        assert text_of(again) == text_of(first)
        usage = again["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - BLOCK
        assert cache(d2)["ssd_bad_blocks"] >= 1  # found, logged, removed; then a miss
        assert chat(d2, "Numbers: 1 2 3, and then?")["choices"] == again["choices"]
    finally:
        stop(d2)


def test_shared_system_prompt_blocks_are_stored_once(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    system = {"role": "system", "content": "You are a careful assistant. " * 2}
    d = serve(tiny_model, ssd)
    try:
        a = chat(d, "First question about the sea?", system=system)
        flush(d)
        after_a = {p.name for p in blocks(ssd)}
        b = chat(d, "Second, about numbers?", system=system)
        flush(d)
        after_b = {p.name for p in blocks(ssd)}
    finally:
        stop(d)
    shared_tokens = min(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"])
    assert shared_tokens >= 3 * BLOCK
    full_a = {n for n in after_a if n.split("-")[1] == str(BLOCK)}
    # b added only its own blocks: the >= 3 full blocks of the shared system prompt exist once
    assert len(after_b) < len(after_a) + len(after_a) - 3 + 1
    assert len(full_a & after_b) >= 3
    keys = [n.split("-")[2] for n in after_b]
    assert len(keys) == len(set(keys))


def test_ssd_cap_evicts_and_holds(tiny_model, tmp_path):
    ssd = tmp_path / "kv"
    cap = 60_000  # bytes: a handful of tiny-model blocks
    d = serve(tiny_model, ssd, "--ssd-cache-max", str(cap / 2**30))
    try:
        for i in range(6):
            chat(d, f"Conversation {i} is about topic number {i * 7}.")
            flush(d)
            assert sum(p.stat().st_size for p in blocks(ssd)) <= cap
        assert cache(d)["ssd_evicted"] > 0
    finally:
        stop(d)
