"""The supervisor of `mlxd serve --isolate`: the only parent. It spawns the proxy and the
engines with `python -m`, awaits each child's exit directly, restarts crashed children with
backoff, kills hung engines and a hung proxy, and stops everything on SIGINT/SIGTERM in
bounded time. It holds the listening sockets for the daemon's life and hands them to each proxy
it spawns, so a proxy's death never refuses a connection. It imports neither MLX nor aiohttp.
Which engines exist is the proxy's call (it routes and evicts); how they live and die is the
supervisor's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Coroutine
from typing import Any

import psutil
import zmq
import zmq.asyncio

from mlxd.daemon import health_probe
from mlxd.daemon.children import Child, describe_exit, is_error_line
from mlxd.daemon.config import ServeConfig
from mlxd.daemon.launch import (
    command,
    engine_launch,
    proxy_launch,
    stop_grace,
    storage_launch,
    with_lifeline,
    write_launch,
)
from mlxd.daemon.memory_share import engines_of, rebalance
from mlxd.daemon.paths import RunDirLock, private_dirs
from mlxd.daemon.restart_policy import RestartPolicy
from mlxd.daemon.sd_notify import Notifier
from mlxd.daemon.stderr_pump import drain
from mlxd.daemon.watchdog import HangWatchdog, probe_timing
from mlxd.protocol import codec, exit_codes, shm
from mlxd.protocol.addresses import Endpoints, make_private
from mlxd.protocol.lifeline import Lifeline
from mlxd.protocol.listen_address import ListenError, Listeners, listen_on
from mlxd.protocol.logs import ChildLines, Console, process_name, render, setup_logging, shorten
from mlxd.protocol.messages import (
    ChildFailed,
    ChildStates,
    Heartbeat,
    Hello,
    Ready,
    ResetChild,
    Role,
    SetMemoryShare,
    Shutdown,
    StartEngine,
    StopDaemon,
    StopEngine,
    ToChild,
)
from mlxd.protocol.models import model_id
from mlxd.protocol.signals import ignore_from_now

log = logging.getLogger("mlxd.supervisor")

REASON_CAP = 1000  # characters of a child's failure reason kept and shown
EXIT_WAIT = 5.0  # seconds to reap a SIGKILLed child before giving up on it


def unclean_stop(code: int) -> bool:
    """Whether a child told to stop ended in a way worth a warning: a crash (SIGABRT, SIGSEGV,
    ... or an unexpected code). Not: a clean exit, a model that could not load (reported as it
    failed), the stop signals themselves (a SIGTERM or SIGINT to the whole process group can
    reach a child before its handler is set or after it hands the signal back), or the
    SIGKILL the supervisor sends past a child's grace (reported as it is sent)."""
    return code not in (exit_codes.OK, exit_codes.CONFIG_ERROR, -signal.SIGKILL,
                        -signal.SIGTERM, -signal.SIGINT)


class Supervisor:
    def __init__(self, cfg: ServeConfig, console: Console) -> None:
        self.cfg = cfg
        self.console = console  # our stderr: our own records and every child's lines
        self.eps = Endpoints.ipc(cfg.run_dir)
        self.children: dict[str, Child] = {}
        self.lifeline = Lifeline()
        self.stopping = False
        self.stop_event = asyncio.Event()
        self.exit_code = exit_codes.OK
        self.watchdog = HangWatchdog(cfg.daemon.hang_timeout)
        self._ctx = zmq.asyncio.Context()
        self._ctl: zmq.asyncio.Socket  # the control ROUTER, bound by run()
        self._tasks: set[asyncio.Task] = set()
        self._enc = codec.to_child()
        self._last_epoch: dict[str, int] = {}  # of engines that were unloaded
        self.notifier = Notifier()
        self.listeners: Listeners | None = None

    # ------------------------------------------------------------------ launch

    def _child(self, role: Role, child_id: str, model: str) -> Child:
        return Child(role, child_id, model, command(role),
                     policy=RestartPolicy(base_delay=self.cfg.daemon.restart_backoff,
                                          breaker=role == "engine"))

    def _listen_fds(self) -> list[int]:
        """The held listening sockets' descriptors (none once the stop closed them)."""
        if self.listeners is None:
            return []
        return [fd for s in self.listeners.sockets() if (fd := s.fileno()) >= 0]

    def _launch(self, child: Child) -> bytes:
        """What the child reads on its stdin, for its current epoch."""
        fd = self.lifeline.read_fd
        if child.role == "engine":  # its share: set by _rebalance as it was spawned
            return codec.encode_launch(with_lifeline(
                engine_launch(self.cfg, child.child_id, child.model, child.epoch, child.share),
                fd))
        if child.role == "proxy":
            return codec.encode_launch(with_lifeline(
                proxy_launch(self.cfg, child.epoch, self._listen_fds()), fd))
        return codec.encode_launch(with_lifeline(
            storage_launch(self.cfg, child.epoch, supervised=True), fd))

    async def _rebalance(self) -> None:
        """Every engine's part of the machine's memory, recomputed from the engines that hold
        one (daemon/memory_share.py); each running engine whose part changed is told. Called
        before an engine is spawned (the others shrink before it starts), and when one is
        gone for good (the others grow once its process has exited)."""
        engines = [c for c in self.children.values() if c.role == "engine"]
        told = {c.child_id: c.share.fraction for c in engines
                if c.alive and c.share is not None}
        before = {c.child_id: c.share.fraction if c.share else None for c in engines}
        given, changed = rebalance(self.cfg.proxy.model_pool, engines_of(engines), told)
        for c in engines:
            if c.child_id in given:
                c.share = given[c.child_id]
        moved = [eid for eid, share in given.items() if (was := before[eid]) is None
                 or abs(was - share.fraction) > 1e-9]
        if moved and (self.cfg.proxy.model_pool > 1 or len(given) > 1):
            log.info("memory shares (--model-pool %d): %s", self.cfg.proxy.model_pool,
                     ", ".join(f"{model_id(c.model)} {100 * given[c.child_id].fraction:.0f}%"
                               for c in engines if c.child_id in given))
        for c in engines:
            if c.child_id in changed and c.share is not None:
                await self._send(c, SetMemoryShare(c.child_id, c.epoch, c.share))

    # ------------------------------------------------------------------ main loop

    async def run(self) -> int:
        try:  # held for the daemon's life: a respawned proxy inherits them (no refusals)
            self.listeners = listen_on(self.cfg.proxy.host, self.cfg.proxy.port,
                                       self.cfg.socket)
        except ListenError as e:
            self.console.verdict("supervisor", str(e))
            return exit_codes.CONFIG_ERROR
        try:
            return await self._run()
        finally:
            self._release_listeners()

    def _release_listeners(self) -> None:
        """Closed when the daemon stops: the proxy's own copies serve its drain, then no one
        accepts. The Unix socket's file goes with them."""
        if self.listeners is None:
            return
        self.listeners.close()
        self.listeners = None
        if self.cfg.socket is not None:
            self.cfg.socket.unlink(missing_ok=True)

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        self._ctl = self._ctx.socket(zmq.ROUTER)
        self._ctl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._ctl.setsockopt(zmq.LINGER, 0)
        self._ctl.bind(self.eps.control)
        make_private(self.eps.control)
        self._spawn_task(self._read_control())
        self._spawn_task(self._watch_hangs())
        if probes_proxy(self.cfg):
            self._spawn_task(self._probe_proxy())
        self._spawn_task(self.notifier.watchdog_loop())
        shm.remove_leftovers(self.cfg.run_dir)
        if self.cfg.ssd_cache is not None:
            self.children["storage"] = self._child("storage", "storage", "")
        self.children["proxy"] = self._child("proxy", "proxy", "")
        for eid, spec in self.cfg.engines().items():
            self.children[eid] = self._child("engine", eid, spec)
        for child in list(self.children.values()):
            await self._spawn(child)
        await self.stop_event.wait()
        await self._stop_all()
        for t in list(self._tasks):
            t.cancel()
        self._ctl.close()
        self._ctx.term()
        ignore_from_now(loop, (signal.SIGINT, signal.SIGTERM))
        if self.exit_code != exit_codes.OK:  # the reason is the daemon's last line
            proxy = self.children.get("proxy")
            reason = proxy.reason if proxy is not None and proxy.reason else \
                f"the proxy could not start ({proxy.last_exit if proxy else 'never ran'})"
            self.console.verdict("supervisor", reason)
        return self.exit_code

    def _spawn_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_signal(self) -> None:
        if self.stopping:
            log.warning("second signal: killing children now")
            for child in self.children.values():
                if (proc := child.running) is not None:
                    proc.kill()
            return
        self._stop("signal")

    def _stop(self, why: str) -> None:
        if self.stopping:
            return
        proxy = self.children.get("proxy")
        if proxy is not None and proxy.alive:
            log.info("stopping (%s): draining requests for up to %.0f s", why,
                     self.cfg.proxy.shutdown_timeout)
        else:
            log.info("stopping (%s)", why)
        self.notifier.notify(STOPPING=1, STATUS=f"draining ({why})")
        self.stopping = True
        self.stop_event.set()

    # ------------------------------------------------------------------ child lifecycle

    async def _spawn(self, child: Child) -> None:
        child.state = "starting"
        child.served = False
        if child.role == "engine":
            await self._rebalance()
        # stderr is our own pipe, not asyncio's: Process.wait() waits for its pipes to close,
        # so with asyncio's a child's death would go unseen while anything held its stderr.
        read_fd, write_fd = os.pipe()
        try:
            kwargs = self.lifeline.spawn_kwargs(self._child_env(child))
            if child.role == "proxy":
                kwargs["pass_fds"] = (*kwargs["pass_fds"], *self._listen_fds())
            child.proc = await asyncio.create_subprocess_exec(
                *child.argv, stdin=asyncio.subprocess.PIPE, stderr=write_fd, **kwargs)
        except BaseException as e:
            os.close(read_fd)
            if not isinstance(e, OSError):
                raise
            child.state = "failed"  # no process (no memory, argv too long): tried again later
            child.reason = shorten(f"cannot start: {e}", REASON_CAP)
            log.error("%s %s %s", child.role, child.child_id, child.reason)
            self._spawn_task(self._cool_down(child, child.epoch))
            self._broadcast()
            if child.role == "engine":
                await self._rebalance()
            return
        finally:
            os.close(write_fd)
        await write_launch(child.proc, self._launch(child))
        self.watchdog.forget(child.child_id)
        log.info("started %s (pid %d, epoch %d)", child.role if child.role == child.child_id
                 else f"{child.role} {child.child_id} for {model_id(child.model)}",
                 child.proc.pid, child.epoch)
        lines = ChildLines(process_name(child.role, child.epoch, model_id(child.model)),
                           child.proc.pid)
        self._spawn_task(drain(read_fd, lambda line: self._child_line(child, lines, line),
                               f"{child.role} {child.child_id}#{child.epoch}"))
        self._spawn_task(self._watch(child, child.proc))
        self._broadcast()

    def _child_env(self, child: Child) -> dict[str, str]:
        """The API key reaches the proxy in its environment, never on a command line; the
        systemd notify variables stay with the supervisor."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("MLXD_API_KEY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        if child.role == "proxy" and self.cfg.daemon.api_key:
            env["MLXD_API_KEY"] = self.cfg.daemon.api_key
        return env

    def _child_line(self, child: Child, lines: ChildLines, line: str) -> None:
        """Children's lines go to our stderr, in the daemon's format, each naming its child;
        the last error line is kept for /stats."""
        error = is_error_line(line)
        rec = lines.record(line, error)
        if error or rec.level in ("ERROR", "CRITICAL"):
            child.last_error = render(rec, "text")[-300:]
        self.console.write(rec)

    async def _watch(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if child.role == "engine":  # its KV arena goes with it (the worker keeps its mapping)
            shm.unlink(shm.segment_name(self.cfg.run_dir, child.child_id, child.epoch))
        if child.proc is not proc:
            return
        child.last_exit = describe_exit(code)
        if self.stopping or child.removed:
            if unclean_stop(code):
                log.warning("%s %s exited with %s while stopping", child.role,
                            child.child_id, child.last_exit)
            child.state = "stopped"
            self._broadcast()
            if child.removed:
                self._last_epoch[child.child_id] = child.epoch
                self.children.pop(child.child_id, None)
                self._broadcast()
                if not self.stopping:  # its memory is free: the others grow into it
                    await self._rebalance()
            return
        if child.role == "proxy" and code == exit_codes.CONFIG_ERROR:
            # It cannot listen (port taken, unusable socket path): a daemon without a
            # listener serves nobody, so it stops and the service manager decides what next.
            child.state = "failed"
            self.exit_code = exit_codes.CONFIG_ERROR
            self._stop("the proxy cannot listen")
            return
        verdict, delay = child.policy.after_exit(code, time.monotonic(),
                                                 progressed=child.served)
        if verdict == "failed":
            child.state = "failed"
            if code != exit_codes.CONFIG_ERROR:
                child.reason = (f"crashed {child.policy.loop_crashes} times in "
                                f"{child.policy.loop_window:.0f} s without serving a token "
                                f"(last: {child.last_exit}); "
                                f"retried after {self.cfg.daemon.crash_cooldown:.0f} s or on "
                                "reset")
                self._spawn_task(self._cool_down(child, child.epoch))
            log.error("%s %s exited with %s and is marked failed: %s", child.role,
                      child.child_id, child.last_exit, child.reason)
            self._broadcast()
            if child.role == "engine":  # it holds no memory until it is tried again
                await self._rebalance()
            return
        child.state = "backoff"
        log.warning("%s %s exited with %s; restarting in %.1f s", child.role, child.child_id,
                    child.last_exit, delay)
        self._broadcast()
        await asyncio.sleep(delay)  # the backoff itself
        if self.stopping or child.removed or child.state != "backoff":
            return
        await self._restart(child)

    async def _restart(self, child: Child) -> None:
        child.epoch += 1
        child.restarts += 1
        await self._spawn(child)

    async def _cool_down(self, child: Child, epoch: int) -> None:
        await asyncio.sleep(self.cfg.daemon.crash_cooldown)
        if child.state == "failed" and child.epoch == epoch and not self.stopping:
            log.info("%s %s: cool-down over, trying again", child.role, child.child_id)
            await self._reset(child)

    async def _reset(self, child: Child) -> None:
        child.policy.reset()
        child.reason = None
        if not child.alive:
            await self._restart(child)

    async def _watch_hangs(self) -> None:
        """Engines and the proxy: once ready, on heartbeats, progress and the probe; while
        starting, only on staying stopped (a load may be silent for minutes). A stopping child
        is the stop's business."""
        while True:
            await asyncio.sleep(0.5)  # the watchdog's tick
            now = time.monotonic()
            for child in list(self.children.values()):
                proc = child.running
                if child.role not in ("engine", "proxy") or proc is None \
                        or child.state not in ("ready", "starting"):
                    continue
                if child.state == "ready":
                    action = self.watchdog.check(child.child_id, now)
                else:
                    action = self.watchdog.stopped(child.child_id, process_stopped(proc.pid), now)
                if action == "abort":
                    why = self.watchdog.why(child.child_id)
                    log.error("%s %s is hung (%s): SIGABRT (stack dump follows), then SIGKILL",
                              child.role, child.child_id, why)
                    child.last_error = f"hung: {why}"
                    proc.send_signal(signal.SIGABRT)
                    proc.send_signal(signal.SIGCONT)  # a stopped child dumps too
                elif action == "kill":
                    proc.kill()

    async def _probe_proxy(self) -> None:
        """The proxy's heartbeats say its control loop runs; this says it answers HTTP."""
        interval, timeout = probe_timing(self.cfg.daemon.hang_timeout)
        while True:
            await asyncio.sleep(interval)  # the probe's period
            proxy = self.children.get("proxy")
            if proxy is None or not proxy.alive or proxy.state != "ready":
                continue
            address = health_probe.probe_address(self.cfg.socket, self.cfg.proxy.host,
                                                 self.cfg.run_dir)
            if address is None:
                continue
            epoch = proxy.epoch
            if await health_probe.probe(address, timeout) is not None \
                    and proxy.epoch == epoch and proxy.state == "ready":
                self.watchdog.answered(proxy.child_id, time.monotonic())

    # ------------------------------------------------------------------ control channel

    async def _read_control(self) -> None:
        """Every child's heartbeats arrive here: this loop must outlive any one message."""
        dec = codec.to_supervisor()
        while True:
            identity, data = await self._ctl.recv_multipart()
            try:
                msg = dec.decode(data)
            except Exception:  # noqa: BLE001  whatever the bytes, this loop outlives them
                log.warning("dropped an undecodable control message from %r", identity[:80])
                continue
            try:
                await self._on_control(msg)
            except Exception:
                log.exception("handling %s from %r failed", type(msg).__name__, identity[:80])

    async def _on_control(self, msg: object) -> None:
        match msg:
            case StartEngine(engine_id=eid, model=spec):
                await self._start_engine(eid, spec)
            case StopEngine(engine_id=eid):
                await self._stop_engine(eid)
            case StopDaemon(reason=reason):
                self._stop(reason)
            case ResetChild(child_id=cid):
                child = self.children.get(cid)
                if child is not None and child.state == "failed":
                    await self._reset(child)
            case Hello() | Ready() | Heartbeat() | ChildFailed():
                self._on_child_message(msg)

    def _on_child_message(self, msg: Hello | Ready | Heartbeat | ChildFailed) -> None:
        child = self.children.get(msg.child_id)
        if child is None or msg.epoch != child.epoch:
            return  # from an earlier life of the child
        child.last_heartbeat = now = time.monotonic()
        match msg:
            case Heartbeat(progress=progress, busy=busy, served=served, pace_s=pace):
                self.watchdog.beat(child.child_id, progress, busy, now, pace)
                child.served = child.served or served > 0
            case Ready(detail=detail):
                child.state = "ready"
                self.watchdog.watch(child.child_id, now,
                                    probed=child.role == "proxy" and probes_proxy(self.cfg))
                self._announce_ready(child, detail)
                self._broadcast()
            case ChildFailed(reason=reason):  # the child logged it; the proxy's reason is
                child.reason = shorten(reason, REASON_CAP)  # the daemon's last line
            case Hello() if child.role == "proxy":
                self._broadcast()
            case Hello() if child.role == "engine" and child.share is not None:
                # a share changed before it connected (it could not be told): its current one
                self._spawn_task(self._send(child, SetMemoryShare(child.child_id, child.epoch,
                                                                  child.share)))

    def _announce_ready(self, child: Child, detail: str) -> None:
        """To systemd. The child has logged its own readiness (one line per event)."""
        if child.role == "proxy":
            self.notifier.notify(READY=1, STATUS=f"listening on {detail}")
        elif child.role == "engine":
            ready = [model_id(c.model) for c in self.children.values()
                     if c.role == "engine" and c.state == "ready"]
            self.notifier.notify(STATUS="serving " + ", ".join(ready))

    async def _start_engine(self, engine_id: str, spec: str) -> None:
        child = self.children.get(engine_id)
        if child is not None and (child.alive or child.state == "backoff"):
            child.removed = False
            return
        if child is None:
            child = self._child("engine", engine_id, spec)
            # Epochs are never reused for an engine id, so a stale message is never taken
            # for the new engine's and the new identity never collides with the old one.
            child.epoch = self._last_epoch.get(engine_id, -1) + 1
            self.children[engine_id] = child
        else:
            child.epoch += 1
            child.policy.reset()
        await self._spawn(child)

    async def _stop_engine(self, engine_id: str) -> None:
        child = self.children.get(engine_id)
        if child is None:
            return
        child.removed = True
        if not child.alive:
            self._last_epoch[engine_id] = child.epoch
            self.children.pop(engine_id, None)
            self._broadcast()
            await self._rebalance()
            return
        child.state = "stopping"
        self._broadcast()
        proc = child.running
        if not await self._send(child, Shutdown("unloaded")) and proc is not None:
            proc.terminate()
        if proc is not None:
            self._spawn_task(self._kill_if_lingering(child, proc))

    async def _kill_if_lingering(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        """An unloaded engine gets the grace a daemon stop gives one to flush and exit; one
        still there after it (stopped, hung in its flush) is killed, since until it is gone
        its memory, and its memory share, are not free for the models that follow."""
        grace = stop_grace(self.cfg)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            if proc.returncode is None:
                log.warning("engine %s for %s did not stop within %.0f s of its unload; "
                            "killing it", child.child_id, model_id(child.model), grace)
                proc.kill()

    async def _send(self, child: Child, msg: ToChild) -> bool:
        try:
            await self._ctl.send_multipart([child.identity, self._enc.encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    def _broadcast(self) -> None:
        """Every child state to the proxy (routing) and the engines (a restarted storage
        worker means their unanswered writes are lost)."""
        now = time.monotonic()
        snapshot = ChildStates([c.info(now) for c in self.children.values()])
        for child in list(self.children.values()):
            if child.alive and child.role in ("proxy", "engine"):
                self._spawn_task(self._send(child, snapshot))

    async def _stop_all(self) -> None:
        """The proxy first: it drains (in-flight requests finish or are aborted at the
        shutdown timeout) while the engines still serve them. Then the engines, which flush
        their caches through the storage worker; the storage worker last."""
        grace = stop_grace(self.cfg)
        if self.listeners is not None:  # new connections: refused once the proxy lets go
            self.listeners.close()
        await self._stop_group([c for c in self.children.values() if c.role == "proxy"], grace)
        await self._stop_group([c for c in self.children.values() if c.role == "engine"], grace,
                               outputs_unread=True)
        await self._stop_group([c for c in self.children.values() if c.role == "storage"], 15)
        shm.remove_leftovers(self.cfg.run_dir)

    async def _stop_group(self, children: list[Child], timeout: float,
                          outputs_unread: bool = False) -> None:
        live = [(c, proc) for c in children if (proc := c.running) is not None]
        for child, proc in live:
            child.state = "stopping"
            if not await self._send(child, Shutdown("daemon stopping", outputs_unread)):
                proc.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for _, p in live)), timeout)
        except TimeoutError:
            for child, proc in live:
                if proc.returncode is None:
                    log.warning("%s %s did not stop in time; killing it", child.role,
                                child.child_id)
                    proc.kill()
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for _, p in live)), EXIT_WAIT)
            except TimeoutError:  # unkillable (stuck in the kernel): not our wait
                log.error("could not reap %s", ", ".join(
                    f"{c.role} {c.child_id} (pid {p.pid})" for c, p in live
                    if p.returncode is None))


def run_supervisor(cfg: ServeConfig) -> int:
    console = setup_logging(cfg.daemon.log_level, "supervisor", cfg.daemon.log_format)
    log.info("starting: model %s, run dir %s", model_id(cfg.daemon.model), cfg.run_dir)
    lock = RunDirLock(cfg.run_dir)
    lock.acquire()
    private_dirs(cfg)
    try:
        code = asyncio.run(Supervisor(cfg, console).run())
    finally:
        lock.release()
    if code == exit_codes.OK:
        log.info("stopped")
    return code


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, SIGTSTP, a debugger's stop)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED,
                                                psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def probes_proxy(cfg: ServeConfig) -> bool:
    """Whether the proxy's liveness is probed over HTTP (off with the hang watchdog)."""
    return cfg.daemon.hang_timeout > 0
