"""Issue 12, items 1, 8 and 9, with real daemons: a child's runaway stderr never wedges it, a
hung proxy is killed and restarted, SIGTERM stops the daemon whatever the proxy does, a taken
port is one line and a do-not-retry exit, and the client commands honour --run-dir."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from conftest import start_daemon, stop_and_check
from mlxd.protocol import exit_codes
from support.harness import LISTENING

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SPEW = {"MLXD_FAULTS": "proxy.heartbeat=spew@3#0"}  # the first proxy writes a 1 MiB line


def _env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    return {**clean, "PYTHONUNBUFFERED": "1", "MLXD_CONFIG": os.devnull}


def _mlxd(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxd", *argv], capture_output=True,
                          text=True, env=_env(), timeout=timeout)


def _processes_naming(path: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(path) in " ".join(p.info["cmdline"] or []) \
                    and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _chat_ok(d) -> None:
    with d.http(timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ item 1


def test_huge_stderr_line_is_drained_and_a_hung_proxy_is_restarted(tiny_model):
    d = start_daemon(tiny_model, "--restart-backoff", "0.1", "--hang-timeout", "2",
                     isolate=True, env=SPEW)
    try:
        cut = d.wait_for_line("bytes cut", timeout=30)
        assert " proxy#0 INFO spew xxx" in cut and cut.endswith("xxx end")  # as proxy's line
        assert len(cut) < 8192 + 128, len(cut)
        with d.http(timeout=10) as c:  # the proxy is not blocked in a write to its stderr
            assert c.get("/health").status_code in (200, 503)
        _chat_ok(d)

        pid = d.stats()["proxy"]["pid"]
        mark = len(d.lines)
        os.kill(pid, signal.SIGSTOP)  # a wedged event loop, as far as anyone can tell
        t0 = time.monotonic()
        d.wait_for_line(LISTENING, timeout=30, start=mark)
        assert time.monotonic() - t0 < 2 + 3 + 15  # hang timeout + kill grace + respawn
        assert any("proxy proxy is hung" in line for line in d.lines[mark:]), d.log()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        d.wait_until(lambda s: s["proxy"]["pid"] != pid
                     and s["engines"][0]["state"] == "ready", what="a new proxy")
        proxy = next(c for c in d.stats()["children"] if c["role"] == "proxy")
        assert proxy["restarts"] == 1 and proxy["last_exit"] in ("signal SIGABRT",
                                                                 "signal SIGKILL")
        _chat_ok(d)
    finally:
        stop_and_check(d)


def test_sigterm_stops_the_daemon_in_bounded_time_whatever_the_proxy_does(tiny_model):
    d = start_daemon(tiny_model, "--hang-timeout", "0", "--shutdown-timeout", "1",
                     isolate=True, env=SPEW)
    try:
        d.wait_for_line("bytes cut", timeout=30)
        os.kill(d.stats()["proxy"]["pid"], signal.SIGSTOP)  # ignores Shutdown, never exits
        t0 = time.monotonic()
        assert d.stop(timeout=40) == 0, d.log()
        assert time.monotonic() - t0 < 1 + 10 + 8  # its grace, then SIGKILL; the rest is quick
        assert any("did not stop in time; killing it" in line for line in d.lines)
        d.assert_clean()
    finally:
        d.cleanup()


# ------------------------------------------------------------------ item 8


@pytest.mark.parametrize("isolate", [False, True], ids=["inprocess", "isolate"])
def test_taken_port_is_one_line_and_a_do_not_retry_exit(tiny_model, isolate):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))
    cache_dir = Path(tempfile.mkdtemp(prefix="mlxd-c-", dir="/tmp"))
    try:
        r = _mlxd("serve", str(tiny_model), "--port", str(port), "--run-dir", str(run_dir),
                  "--cache-dir", str(cache_dir), "--restart-backoff", "0.1",
                  *(["--isolate"] if isolate else []))
        out = r.stdout + r.stderr
        assert r.returncode == exit_codes.CONFIG_ERROR, out
        assert "Traceback" not in out, out
        naming = [ln for ln in out.splitlines() if f"127.0.0.1:{port}" in ln]
        assert naming == [f"mlxd: cannot listen on http://127.0.0.1:{port}: "
                          f"address already in use"], out
        assert out.splitlines()[-1] == naming[0]
        assert list(run_dir.iterdir()) == [], list(run_dir.iterdir())
        assert _processes_naming(run_dir) == []
        assert out.count("started proxy") <= 1  # not a crash loop
    finally:
        taken.close()
        for p in _processes_naming(run_dir):
            p.kill()
        subprocess.run(["rm", "-rf", str(run_dir), str(cache_dir)])


def test_live_socket_at_the_socket_path_is_refused_not_stolen(tiny_model, tmp_path):
    sock_path = Path(tempfile.mkdtemp(prefix="mlxd-s-", dir="/tmp")) / "other.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(sock_path))
    other.listen()
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))
    try:
        r = _mlxd("serve", str(tiny_model), "--port", "0", "--socket", str(sock_path),
                  "--run-dir", str(run_dir), "--cache-dir", str(tmp_path), "--ssd-cache", "off")
        out = r.stdout + r.stderr
        assert r.returncode == exit_codes.CONFIG_ERROR, out
        assert out.splitlines()[-1] == (f"mlxd: cannot listen on unix:{sock_path}: another "
                                        f"process is serving on it"), out
        assert "Traceback" not in out
        assert sock_path.exists()  # the other daemon's socket is still there
        assert list(run_dir.iterdir()) == []
    finally:
        other.close()
        subprocess.run(["rm", "-rf", str(run_dir), str(sock_path.parent)])


# ------------------------------------------------------------------ item 9


def test_client_commands_honour_run_dir(tiny_model):
    a = start_daemon(tiny_model, "--ssd-cache", "off")
    try:
        b = start_daemon(tiny_model, "--ssd-cache", "off")
        try:
            status = _mlxd("status", "--run-dir", str(b.run_dir))
            assert status.returncode == 0, status.stderr
            assert f"proxy pid {b.proc.pid}," in status.stdout, status.stdout
            models = _mlxd("models", "--run-dir", str(b.run_dir))
            assert models.returncode == 0 and tiny_model.name in models.stdout

            stop = _mlxd("stop", "--run-dir", str(b.run_dir), "--timeout", "60")
            assert stop.returncode == 0, stop.stderr
            assert b.proc.wait(10) == 0  # b had exited when `mlxd stop` returned
            b.assert_clean()
            assert a.proc.poll() is None  # a is untouched
            with a.http() as c:
                assert c.get("/health").status_code == 200

            gone = _mlxd("status", "--run-dir", str(b.run_dir))
            assert gone.returncode == 3
            assert gone.stderr.strip() == f"mlxd: no mlxd is running with run dir {b.run_dir}"
            nowhere = _mlxd("stop", "--run-dir", "/nonexistent/mlxd")
            assert nowhere.returncode == 3 and nowhere.stderr.count("\n") == 1
        finally:
            b.cleanup()
    finally:
        stop_and_check(a)
