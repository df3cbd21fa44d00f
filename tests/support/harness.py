"""Start a real `mlxd serve` process for a test, and prove it left nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx
import psutil

from mlxd.protocol import shm

RUN_DIRS: list[Path] = []  # every run dir a Daemon of this test session used
# transformers' import index (engine/load/transformers_index.py), shared by the daemons of a
# test session whose cache dirs are their own (each would otherwise build it, 1.3 s an engine
# start here): a folder of the session's, linked into each such cache dir (conftest sets it).
SHARED_INDEX: list[Path] = []

# What a starting daemon logs, one line each: the proxy listening (`proxy#0 INFO listening on
# http://..., unix:...`, or `mlxd INFO ...` in one process), and an engine's model ready.
LISTENING = "listening on "
READY = " ready in "


TAG_ENV = "PYTEST_MLXD_RUN_DIR"  # every process of a test daemon inherits its run dir here


def leftovers() -> tuple[list[str], list[int], list[str]]:
    """Shared-memory segments, live processes and socket files of this session's daemons
    (found by their run dirs, so concurrent test sessions on one machine do not count)."""
    tags = {shm.segment_name(d, "", 0)[:8] for d in RUN_DIRS}
    segments = [n for n in os.listdir("/dev/shm") if n[:8] in tags] \
        if os.path.isdir("/dev/shm") else []
    dirs = {str(d) for d in RUN_DIRS}
    procs = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(TAG_ENV) in dirs:
                procs.append(p.info["pid"])
        except psutil.Error:
            continue
    sockets = [str(f) for d in RUN_DIRS if d.is_dir() for f in d.glob("*.sock")]
    return segments, procs, sockets


class Daemon:
    def __init__(self, model: str | None, *extra: str, isolate: bool = False,
                 cache_dir: Path | None = None, env: dict | None = None,
                 run_dir: Path | None = None, ready_marker: str = READY,
                 new_session: bool = False) -> None:
        # A short run dir: Unix socket paths are limited to ~104 bytes.
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))
        RUN_DIRS.append(self.run_dir)
        self.ready_marker = ready_marker
        self.new_session = new_session  # its own process group (a test signals the group)
        self._own_cache = cache_dir is None
        self.cache_dir = cache_dir or Path(tempfile.mkdtemp(prefix="mlxd-c-", dir="/tmp"))
        if self._own_cache and SHARED_INDEX:
            from mlxd.engine.load.transformers_index import INDEX_DIR
            (self.cache_dir / INDEX_DIR).symlink_to(SHARED_INDEX[0], target_is_directory=True)
        self.argv = [sys.executable, "-m", "mlxd.cli.main", "serve", "--port", "0",
                     "--run-dir", str(self.run_dir), "--cache-dir", str(self.cache_dir), *extra]
        if model is not None:
            self.argv.insert(4, model)
        if isolate:
            self.argv.append("--isolate")
        # Hermetic: no MLXD_* setting or config file of the developer's leaks in.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
        self.env = {**clean, "PYTHONUNBUFFERED": "1", "MLXD_CONFIG": os.devnull,
                    TAG_ENV: str(self.run_dir), **(env or {})}
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._proc: subprocess.Popen | None = None
        self.descendants: dict[int, psutil.Process] = {}

    # ------------------------------------------------------------------ lifecycle

    @property
    def proc(self) -> subprocess.Popen:
        """The `mlxd serve` process (the supervisor under --isolate), once started."""
        assert self._proc is not None, "the daemon was never started"
        return self._proc

    def start(self, timeout: float = 120.0) -> Daemon:
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env,
                                     start_new_session=self.new_session)
        threading.Thread(target=self._pump, daemon=True).start()
        self.wait_for_line(LISTENING, timeout)
        self.wait_for_line(self.ready_marker, timeout)
        self.listen = json.loads((self.run_dir / "listen.json").read_text())
        self.port = self.listen["port"]
        self.socket = self.listen["socket"]
        self.record_descendants()
        return self

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append("<EOF>")
            self._cond.notify_all()

    def wait_for_line(self, text: str, timeout: float = 60.0, start: int = 0) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if text in line:
                        return line
                    if line == "<EOF>":
                        raise AssertionError(f"daemon exited before {text!r}:\n" + self.log())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {text!r} within {timeout}s:\n" + self.log())
                self._cond.wait(left)

    def log(self) -> str:
        return "\n".join(self.lines[-80:])

    def record_descendants(self) -> None:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            self.descendants[p.pid] = p

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.record_descendants()
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("daemon did not stop in time:\n" + self.log()) from None
        finally:
            self._reap()
        return code

    def _reap(self) -> None:
        for p in self.descendants.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def assert_clean(self) -> None:
        """No child process, socket or run-dir file left behind."""
        alive = [p.pid for p in self.descendants.values() if p.is_running()
                 and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"children outlived the daemon: {alive}"
        left = [p.name for p in self.run_dir.iterdir()] if self.run_dir.exists() else []
        assert not left, f"left in the run dir: {left}"
        tag = shm.segment_name(self.run_dir, "", 0)[:8]  # "mlxd" + this run dir's hash
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(tag)] \
            if os.path.isdir("/dev/shm") else []
        assert not segments, f"shared-memory segments left: {segments}\n{self.log()}"

    def cleanup(self, keep_run_dir: bool = False) -> None:
        """Kill whatever is left. Unless the run dir is kept for a restart to find, the
        shared-memory segments its manifest lists go with it (a daemon killed with -9 cannot
        unlink its own)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._reap()
        if keep_run_dir:
            return
        shm.remove_leftovers(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._own_cache:
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    # ------------------------------------------------------------------ clients

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def unix_http(self) -> httpx.Client:
        return httpx.Client(base_url="http://localhost", timeout=60,
                            transport=httpx.HTTPTransport(uds=self.socket))

    def stats(self) -> dict:
        with self.http() as c:
            return c.get("/stats").json()

    def wait_until(self, predicate, timeout: float = 20.0, what: str = "condition") -> None:
        """Poll the daemon's own state until `predicate(stats)` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.stats()):
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {self.stats()}")


def engine_pid(d: Daemon) -> int:
    return d.stats()["engines"][0]["pid"]


def stream_chat(d: Daemon, body: dict, kill_after: int | None = None, kills: int = 1,
                before_kill: Callable[[dict], None] | None = None,
                on_chunk: Callable[[int], None] | None = None) -> tuple[str, dict]:
    """Stream a chat completion (usage included) and return (text, usage); with `kill_after`,
    SIGKILL the engine after every `kill_after` content chunks, `kills` times, first calling
    `before_kill(engine's /stats entry)` (to check what the engine was doing); `on_chunk(n)`
    after the n-th content chunk. An error event in the stream fails the test."""
    out: list[str] = []
    usage: dict | None = None
    chunks = killed = 0
    with d.http() as c, c.stream("POST", "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                if ch["delta"].get("content"):
                    out.append(ch["delta"]["content"])
                    chunks += 1
                    if on_chunk is not None:
                        on_chunk(chunks)
                    if kill_after and killed < kills and chunks % kill_after == 0:
                        engine = d.stats()["engines"][0]
                        if before_kill is not None:
                            before_kill(engine)
                        os.kill(engine["pid"], signal.SIGKILL)
                        killed += 1
    assert usage is not None, "the stream ended without its usage"
    return "".join(out), usage
