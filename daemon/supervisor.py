"""The supervisor of `mlxd serve --isolate`: the only parent. It spawns the proxy and the
engines with `python -m`, awaits each child's exit directly, restarts crashed children with
backoff, and stops them all on SIGINT/SIGTERM. It imports neither MLX nor aiohttp.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from mlxd.daemon.config import ServeConfig
from mlxd.daemon.paths import RunDirLock
from mlxd.daemon.restart_policy import RestartPolicy
from mlxd.protocol import codec, exit_codes
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.logs import setup_logging
from mlxd.protocol.messages import ChildFailed, Heartbeat, Hello, Ready, Shutdown
from mlxd.protocol.models import model_id

log = logging.getLogger("mlxd.supervisor")


@dataclass
class Child:
    role: str  # "proxy" | "engine"
    child_id: str
    argv: list[str]  # without the epoch
    epoch: int = 0
    state: str = "starting"  # starting | ready | backoff | failed | stopping
    proc: asyncio.subprocess.Process | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    reason: str = ""
    last_heartbeat: float = 0.0
    restarts: int = 0

    @property
    def identity(self) -> bytes:
        return f"{self.role}:{self.child_id}:{self.epoch}".encode()


class Supervisor:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.eps = Endpoints.ipc(cfg.run_dir)
        self.children: dict[str, Child] = {}
        self.stopping = False
        self.stop_event = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._ctl: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()

    def _child_specs(self) -> list[Child]:
        c = self.cfg
        py = [sys.executable, "-m"]
        common = ["--run-dir", str(c.run_dir), "--log-level", c.log_level]
        proxy = py + ["mlxd.proxy", *common, "--host", c.host, "--port", str(c.port),
                      "--temp", str(c.temp), "--top-p", str(c.top_p), "--top-k", str(c.top_k),
                      "--max-tokens", str(c.max_tokens), "--load-wait", str(c.load_wait),
                      "--max-body", str(c.max_body)]
        if c.socket is not None:
            proxy += ["--socket", str(c.socket)]
        for eid, spec in c.engines().items():
            proxy += ["--engine", f"{eid}={spec}"]
        children = [Child("proxy", "proxy", proxy)]
        for eid, spec in c.engines().items():
            children.append(Child("engine", eid, py + [
                "mlxd.engine", *common, "--engine-id", eid, "--model", spec,
                "--cache-dir", str(c.cache_dir), "--batch", str(c.batch),
                "--prefill-step", str(c.prefill_step), "--dtype", c.dtype]))
        return children

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        self._ctl = self._ctx.socket(zmq.ROUTER)
        self._ctl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._ctl.setsockopt(zmq.LINGER, 0)
        self._ctl.bind(self.eps.control)
        reader = asyncio.create_task(self._read_control())
        for child in self._child_specs():
            self.children[child.child_id] = child
            await self._spawn(child)
        await self.stop_event.wait()
        await self._stop_all()
        reader.cancel()
        self._ctl.close()
        self._ctx.term()
        return 0

    def _on_signal(self) -> None:
        if self.stopping:
            log.warning("second signal: killing children now")
            for child in self.children.values():
                if child.proc and child.proc.returncode is None:
                    child.proc.kill()
            return
        self.stopping = True
        self.stop_event.set()

    async def _spawn(self, child: Child) -> None:
        child.state = "starting"
        argv = child.argv + ["--epoch", str(child.epoch)]
        child.proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
        log.info("started %s %s (pid %d, epoch %d)", child.role, child.child_id,
                 child.proc.pid, child.epoch)
        task = asyncio.create_task(self._watch(child, child.proc))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self.stopping or child.proc is not proc:
            return
        what = f"signal {-code}" if code < 0 else f"code {code}"
        verdict, delay = child.policy.after_exit(code, time.monotonic())
        if verdict == "failed":
            child.state = "failed"
            if code != exit_codes.CONFIG_ERROR:
                child.reason = f"crashed {child.policy.loop_crashes} times in " \
                               f"{child.policy.loop_window:.0f} s (last: {what})"
            log.error("%s %s exited with %s and is marked failed: %s", child.role,
                      child.child_id, what, child.reason)
            return
        child.state = "backoff"
        log.warning("%s %s exited with %s; restarting in %.1f s", child.role, child.child_id,
                    what, delay)
        await asyncio.sleep(delay)  # the backoff itself, not a wait for an event
        if self.stopping:
            return
        child.epoch += 1
        child.restarts += 1
        await self._spawn(child)

    async def _read_control(self) -> None:
        dec = codec.to_supervisor()
        while True:
            identity, data = await self._ctl.recv_multipart()
            try:
                msg = dec.decode(data)
            except Exception:  # noqa: BLE001
                log.warning("dropped an undecodable control message from %r", identity)
                continue
            child = self.children.get(msg.child_id)
            if child is None or msg.epoch != child.epoch:
                continue  # from an earlier life of the child
            child.last_heartbeat = time.monotonic()
            if isinstance(msg, Ready):
                child.state = "ready"
                if child.role == "proxy":
                    print(f"mlxd: listening on {msg.detail}", file=sys.stderr, flush=True)
                else:
                    print(f"mlxd: model {model_id(self.cfg.engines()[child.child_id])} ready "
                          f"(engine pid {child.proc.pid if child.proc else '?'})",
                          file=sys.stderr, flush=True)
            elif isinstance(msg, ChildFailed):
                child.reason = msg.reason
                print(f"mlxd: {child.role} {child.child_id} failed: {msg.reason}",
                      file=sys.stderr, flush=True)
            elif isinstance(msg, (Hello, Heartbeat)):
                pass

    async def _stop_all(self) -> None:
        enc = codec.to_child()
        live = [c for c in self.children.values() if c.proc and c.proc.returncode is None]
        for child in live:
            child.state = "stopping"
            try:
                await self._ctl.send_multipart([child.identity, enc.encode(Shutdown("daemon stopping"))])
            except zmq.ZMQError:
                child.proc.terminate()
        waits = [c.proc.wait() for c in live]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), self.cfg.shutdown_timeout)
        except asyncio.TimeoutError:
            for child in live:
                if child.proc.returncode is None:
                    log.warning("%s %s did not stop in time; killing it", child.role, child.child_id)
                    child.proc.kill()
            await asyncio.gather(*(c.proc.wait() for c in live))


def run_supervisor(cfg: ServeConfig) -> int:
    setup_logging(cfg.log_level, "supervisor")
    lock = RunDirLock(cfg.run_dir)
    lock.acquire()
    try:
        code = asyncio.run(Supervisor(cfg).run())
    finally:
        lock.release()
    print("mlxd: stopped", file=sys.stderr, flush=True)
    return code
