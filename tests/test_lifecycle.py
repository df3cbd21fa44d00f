"""Graceful lifecycle with real daemons: SIGTERM lets streams finish (or aborts them at the
shutdown timeout), /admin/drain, a second signal, sd_notify, and the client commands
(`mlxd status | models | flush | stop`) over the Unix socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import start_daemon

SLOW = {"MLXD_FAULTS": "engine.step=delay@1"}  # 50 ms per engine step: streams last seconds


class Stream(threading.Thread):
    """One streaming completion on its own thread; `started` is set at the first token."""

    def __init__(self, d, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.d, self.max_tokens = d, max_tokens
        self.started = threading.Event()
        self.events: list[dict | str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.d.http(timeout=120) as c, c.stream("POST", "/v1/completions", json={
                    "prompt": "The story goes", "max_tokens": self.max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as e:  # noqa: BLE001  every failure goes to the test, on its thread
            self.error = e
            self.started.set()

    @property
    def usage(self) -> dict | None:
        return next((e["usage"] for e in self.events if isinstance(e, dict) and e.get("usage")),
                    None)

    @property
    def finish(self) -> str | None:
        return next((c["finish_reason"] for e in self.events if isinstance(e, dict)
                     for c in e.get("choices", []) if c.get("finish_reason")), None)


def _notify_socket(tmp_path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify.sock"))
    s.settimeout(10)
    return s


def _messages(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out


@pytest.mark.parametrize("isolate", [False, True], ids=["inprocess", "isolate"])
def test_sigterm_lets_streams_finish_then_exits_0(tiny_model, tmp_path, isolate):
    notify = _notify_socket(tmp_path)
    d = start_daemon(tiny_model, "--shutdown-timeout", "60", isolate=isolate,
                     env={**SLOW, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    try:
        streams = [Stream(d, 40) for _ in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60) and s.error is None, s.error
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for_line("draining", 10)
        with d.http() as c:  # new work is refused while the old finishes
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert r.headers["Retry-After"]
        for s in streams:
            s.join(60)
            assert s.error is None, s.error
            assert s.events[-1] == "[DONE]" and s.finish == "length"
            assert s.usage is not None and s.usage["completion_tokens"] == 40
        assert d.proc.wait(60) == 0, d.log()
        sent = "\n".join(_messages(notify))
        assert "READY=1" in sent and "STOPPING=1" in sent
        d.assert_clean()
    finally:
        notify.close()
        d.cleanup()


def test_shutdown_timeout_aborts_what_is_left(tiny_model):
    d = start_daemon(tiny_model, "--shutdown-timeout", "1", isolate=True, env=SLOW)
    try:
        s = Stream(d, 200)  # 10 s of steps: cannot finish in 1 s
        s.start()
        assert s.started.wait(60)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        s.join(30)
        errors = [e["error"] for e in s.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == "shutdown", s.events[-3:]
        assert "[DONE]" not in s.events
        assert d.proc.wait(30) == 0, d.log()
        assert time.monotonic() - t0 < 15
        d.assert_clean()
    finally:
        d.cleanup()


def test_second_signal_exits_at_once(tiny_model):
    d = start_daemon(tiny_model, "--shutdown-timeout", "120", isolate=True, env=SLOW)
    try:
        s = Stream(d, 200)
        s.start()
        assert s.started.wait(60)
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for_line("stopping (signal)", 10)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(20)
        assert time.monotonic() - t0 < 10
        s.join(10)
        assert s.finish != "length"  # it was cut off, not finished
        d.assert_clean()
    finally:
        d.cleanup()


def _mlxd(*argv: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    return subprocess.run([sys.executable, "-m", "mlxd", *argv], capture_output=True, text=True,
                          env={**clean, "MLXD_CONFIG": os.devnull}, timeout=120)


def test_admin_drain_and_client_commands(tiny_model):
    d = start_daemon(tiny_model, isolate=True, env=SLOW)
    try:
        s = Stream(d, 30)
        s.start()
        assert s.started.wait(60)
        with d.unix_http() as u:
            r = u.post("/admin/drain", timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            # it answered only once the running stream was done
            assert not s.is_alive() and s.finish == "length"
            assert body["drained"] and body["in_flight_at_start"] == 1 and body["aborted"] == 0
            assert body["flushed"]["failed"] == 0
            with d.http() as c:
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
                h = c.get("/health")
                assert h.status_code == 503 and h.json()["status"] == "draining"
            assert u.post("/admin/undrain").json() == {"draining": False}
            with d.http() as c:
                assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}
                              ).status_code == 200

        sock = d.socket
        status = _mlxd("status", "--socket", sock)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert any(ln.split()[:3] == ["engine", d.stats()["engines"][0]["engine_id"], "ready"]
                   for ln in lines), status.stdout
        assert any(ln.startswith(tiny_model.name) and " ready " in ln for ln in lines)
        as_json = json.loads(_mlxd("status", "--socket", sock, "--json").stdout)
        assert as_json["proxy"]["in_flight"] == 0
        models = _mlxd("models", "--socket", sock)
        assert models.returncode == 0 and tiny_model.name in models.stdout
        flushed = _mlxd("flush", "--socket", sock)
        assert flushed.returncode == 0 and "0 failed" in flushed.stdout
        stop = _mlxd("stop", "--socket", sock)
        assert stop.returncode == 0, stop.stderr
        assert "stopped" in stop.stderr
        assert d.proc.wait(30) == 0  # it had exited by the time `mlxd stop` returned
        d.assert_clean()
        gone = _mlxd("status", "--socket", sock)
        assert gone.returncode == 3 and "no mlxd answers" in gone.stderr
    finally:
        d.cleanup()
