"""Soak and chaos: `mlxd serve --isolate` under concurrent streams, fuzzed requests and random
SIGKILL / SIGSTOP of its children, for as long as asked.

Every stream's text is compared with the answer the same prompt got before any chaos (greedy
and seeded sampling are deterministic per request, so a resumed stream must match); fuzzed
requests (tests/support/fuzz_requests.py) must never get a 5xx or hang. Each round (one kill)
records the RSS of every process, and the engine's RSS outside its RAM prefix cache.

    python benchmarks/soak.py --minutes 30 --streams 32 --kill-every 20 \
        --out benchmarks/results/soak
    python benchmarks/soak.py --minutes 10 --kinds proxy,storage   # the engine lives throughout

Exits 0 only when every stream that reached a live proxy ended well: no non-200 answer, no
in-band error event, no stream cut short without a finish, no wrong text, no hang; no fuzzed
request got a 5xx (but a 503 while a child it needs was being restarted), an error outside its
endpoint's envelope, or no answer; the supervisor survived; and within RECOVERY_S of the last
kill the model served the reference text again (a model left `failed`, parked by the crash-loop
breaker, fails the run). The one loss tolerated is a connection that a killed proxy drops (its
clients were connected to it; `dropped_by_proxy_death`). Prints one JSON line per round and a
summary, writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = [f"Story {i}: tell me about the lighthouse keeper, the storm and the number {i}."
           for i in range(8)]
FUZZ_CLIENTS = 4
RECOVERY_S = 90.0  # after the chaos, for the daemon to answer again (backoffs reach 30 s)
ROLES = {"mlxd.proxy": "proxy", "mlxd.engine": "engine", "mlxd.storage_worker": "storage"}


@dataclass
class Counts:
    stream_requests: int = 0
    streams_ok: int = 0
    wrong_text: int = 0
    stream_errors: int = 0  # non-200 answers, in-band error events, streams cut short
    dropped_by_proxy_death: int = 0  # connections of a proxy that was killed: expected
    hangs: int = 0
    resumes: int = 0
    fuzz_requests: int = 0
    fuzz_5xx: int = 0
    fuzz_problems: int = 0  # 5xx, or an error not in the endpoint's own envelope
    fuzz_hangs: int = 0
    kills: int = 0
    errors: list[str] = field(default_factory=list)  # samples of what went wrong

    def note(self, what: str) -> None:
        if len(self.errors) < 30:
            self.errors.append(what[:300])


@dataclass
class RoundRecord:
    t: float
    victim: str
    sig: str
    rss_mb: dict[str, float]
    engine_rss_outside_cache_mb: float | None
    engine_epoch: int | None


class SoakDaemon:
    def __init__(self, model: Path, workdir: Path, extra: list[str]) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="mlxd-s-", dir="/tmp"))
        self.workdir = workdir
        self.argv = [sys.executable, "-m", "mlxd.cli.main", "serve", str(model), "--isolate",
                     "--port", "0", "--run-dir", str(self.run_dir), "--cache-dir",
                     str(workdir / "cache"), "--restart-backoff", "0.1", *extra]
        self.model_id = model.name
        self.log = open(workdir / "daemon.log", "w")
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self) -> None:
        from support.harness import TAG_ENV
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
        env.update(PYTHONUNBUFFERED="1", MLXD_CONFIG=os.devnull)
        env[TAG_ENV] = str(self.run_dir)  # so leftovers() finds every process of this daemon
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, env=env)
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(180):
            raise RuntimeError("the daemon did not become ready; see daemon.log")
        listen = json.loads((self.run_dir / "listen.json").read_text())
        self.url = f"http://127.0.0.1:{listen['port']}"

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if " ready in " in line:  # an engine: "model X ready in T s (...)"
                self._ready.set()
        self.log.flush()

    def children(self) -> dict[str, psutil.Process]:
        assert self.proc is not None
        out = {"supervisor": psutil.Process(self.proc.pid)}
        for p in psutil.Process(self.proc.pid).children():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            for mod, role in ROLES.items():
                if f"-m {mod} " in cmd + " ":
                    out[role] = p
        return out

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def _stream(session: aiohttp.ClientSession, url: str, body: dict,
                  timeout: float) -> tuple[str, dict | None, list]:
    """(text, usage, errors): a stream that ends without a finish reason and `[DONE]` is an
    error too (an answer cut short without saying so)."""
    text, usage, errors = [], None, []
    finish, done = None, False
    async with session.post(url + "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}},
            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            return "", None, [f"status {r.status}: {(await r.text())[:200]}"]
        async for raw in r.content:
            line = raw.decode().strip()
            done = done or line == "data: [DONE]"
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                errors.append(obj["error"])
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                text.append(ch["delta"].get("content") or "")
                finish = ch.get("finish_reason") or finish
    if not errors and (finish not in ("stop", "length") or not done):
        errors.append(f"the stream ended without a finish (finish_reason {finish}, "
                      f"[DONE] {'seen' if done else 'missing'})")
    return "".join(text), usage, errors


def _body(i: int, max_tokens: int) -> dict:
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}
    return {"messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": max_tokens,
            **sampling}


class Soak:
    def __init__(self, args: argparse.Namespace, daemon: SoakDaemon) -> None:
        self.args = args
        self.d = daemon
        self.counts = Counts()
        self.rounds: list[RoundRecord] = []
        self.references: dict[int, str] = {}
        self.proxy_killed_at = -1e9
        self.engine_killed_at = -1e9
        # the kill schedule has a generator of its own, so that a seed names one schedule
        # whatever the streams draw meanwhile
        self.kill_rng = random.Random(args.seed)
        self.rng = random.Random(args.seed + 1_000_003)  # the streams' prompts
        self.recovery: dict = {}

    async def run(self) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            for i in range(len(PROMPTS)):  # before any chaos
                text, _, errors = await _stream(s, self.d.url, _body(i, self.args.max_tokens), 300)
                assert not errors, errors
                self.references[i] = text
            fuzz = await asyncio.to_thread(self._fuzz_requests)  # drawn before the clock runs
            deadline = time.monotonic() + self.args.minutes * 60
            tasks = [asyncio.create_task(self._streamer(s, deadline, k))
                     for k in range(self.args.streams)]
            pending = iter(fuzz)
            tasks += [asyncio.create_task(self._fuzzer(s, deadline, pending))
                      for _ in range(FUZZ_CLIENTS)]
            tasks.append(asyncio.create_task(self._chaos(s, deadline)))
            await asyncio.gather(*tasks)
            self.recovery = await self._recover(s)
            await self._record(s, "end", "-")

    async def _recover(self, s: aiohttp.ClientSession) -> dict:
        """After the last kill: the daemon answers again and its model serves the reference
        text (`serving`), or the model is `failed` (`parked`, with the reason: the run fails).
        Polls the daemon's own state, as a client waiting for it would."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < RECOVERY_S:
            try:
                async with s.get(self.d.url + "/stats",
                                 timeout=aiohttp.ClientTimeout(total=5)) as r:
                    eng = (await r.json())["engines"][0]
                if eng["state"] == "failed":  # parked (or refused): the run fails
                    return {"serving": False, "parked": True, "error": eng.get("error"),
                            "after_s": round(time.monotonic() - t0, 1)}
                if eng["state"] == "ready":
                    text, _, errors = await _stream(s, self.d.url, _body(0, self.args.max_tokens),
                                                    60)
                    if not errors and text == self.references[0]:
                        return {"serving": True, "parked": False,
                                "after_s": round(time.monotonic() - t0, 1)}
                    last = f"{errors or 'wrong text'}"
                else:
                    last = f"engine {eng['state']}"
            except (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError, KeyError,
                    IndexError) as e:
                last = repr(e)
            await asyncio.sleep(0.5)
        return {"serving": False, "parked": False, "last": last[:300],
                "after_s": round(time.monotonic() - t0, 1)}

    async def _streamer(self, s: aiohttp.ClientSession, deadline: float, k: int) -> None:
        c = self.counts
        while time.monotonic() < deadline:
            i = self.rng.randrange(len(PROMPTS))
            c.stream_requests += 1
            started = time.monotonic()
            try:
                text, usage, errors = await _stream(s, self.d.url, _body(i, self.args.max_tokens),
                                                    self.args.request_timeout)
            except TimeoutError:
                c.hangs += 1
                c.note(f"stream {i} hung for {self.args.request_timeout} s")
                continue
            except (aiohttp.ClientError, ConnectionError) as e:
                since_kill = time.monotonic() - self.proxy_killed_at
                if started <= self.proxy_killed_at + 1 or since_kill < 5:
                    c.dropped_by_proxy_death += 1
                else:
                    c.stream_errors += 1
                    c.note(f"stream {i}: {e!r}")
                await asyncio.sleep(0.2)  # the proxy restarts: back off as a client would
                continue
            if errors:  # a live proxy answered with an error: whatever the chaos, a failure
                c.stream_errors += 1
                c.note(f"stream {i}: {errors}")
                continue
            if usage and usage.get("resumes"):
                c.resumes += usage["resumes"]
            if text != self.references[i]:
                c.wrong_text += 1
                c.note(f"stream {i}: wrong text {text[:80]!r} != {self.references[i][:80]!r}")
            else:
                c.streams_ok += 1

    def _fuzz_requests(self) -> list:
        """Every fuzzed request of the run, drawn up front (hypothesis is slow enough that
        drawing them during the run would starve the streams' event loop)."""
        if self.args.fuzz_per_s <= 0:
            return []
        from support import fuzz_requests  # the generators the fuzz tests use
        count = int(self.args.minutes * 60 * self.args.fuzz_per_s) + 1
        return list(fuzz_requests.iter_requests(count, self.d.model_id, seed=self.args.seed))

    async def _fuzzer(self, s: aiohttp.ClientSession, deadline: float, pending) -> None:
        """One of FUZZ_CLIENTS clients sending fuzzed requests, together at --fuzz-per-s."""
        from support import fuzz_requests
        c = self.counts
        unix = aiohttp.ClientSession(connector=aiohttp.UnixConnector(
            path=str(self.d.run_dir / "mlxd.sock")))
        interval = FUZZ_CLIENTS / self.args.fuzz_per_s
        next_at = time.monotonic()
        try:
            for req in pending:
                now = time.monotonic()
                if now >= deadline:
                    return
                next_at = max(next_at + interval, now - 1)  # a steady rate
                await asyncio.sleep(max(0.0, next_at - now))
                c.fuzz_requests += 1
                session, base = (unix, "http://localhost") if req.unix else (s, self.d.url)
                try:
                    async with session.request(req.method, base + req.path, data=req.body,
                                               headers=req.headers,
                                               timeout=aiohttp.ClientTimeout(total=60)) as r:
                        body = await r.read()
                        status, headers = r.status, {k.lower(): v for k, v in r.headers.items()}
                except TimeoutError:
                    c.fuzz_hangs += 1
                    c.note(f"fuzz hang: {req.method} {req.path} {req.body[:100]!r}")
                    continue
                except (aiohttp.ClientError, ConnectionError):
                    continue  # a proxy being killed
                if status == 503 and (time.monotonic() - self.proxy_killed_at < 5
                                      or self._engine_down_recently()):
                    continue  # a child it needs is being restarted: the truth, not a fault
                problems = fuzz_requests.problems(req, status, headers, body)
                if status >= 500:
                    c.fuzz_5xx += 1
                if problems:
                    c.fuzz_problems += 1
                    c.note(f"fuzz {req.method} {req.path} {req.body[:100]!r}: {problems}")
        finally:
            await unix.close()

    def _engine_down_recently(self) -> bool:
        return time.monotonic() - self.engine_killed_at < self.args.hang_timeout + 10

    async def _chaos(self, s: aiohttp.ClientSession, deadline: float) -> None:
        kinds = self.args.kinds.split(",") if self.args.kinds else []
        await self._record(s, "start", "-")
        while time.monotonic() + self.args.kill_every < deadline:
            await asyncio.sleep(self.args.kill_every)
            if not kinds:
                await self._record(s, "-", "-")
                continue
            victim = self.kill_rng.choice(kinds)
            sig = (signal.SIGSTOP if self.kill_rng.random() < self.args.stop_share
                   else signal.SIGKILL)
            await self._record(s, victim, sig.name)
            proc = self.d.children().get(victim)
            if proc is None:
                continue
            if victim == "proxy":
                self.proxy_killed_at = time.monotonic() + (
                    self.args.hang_timeout + 5 if sig == signal.SIGSTOP else 0)
            elif victim == "engine":
                self.engine_killed_at = time.monotonic()
            try:
                proc.send_signal(sig)
            except psutil.Error:
                continue
            self.counts.kills += 1
            if sig == signal.SIGSTOP and victim == "storage":
                await asyncio.sleep(5)  # no watchdog for the writer: it pauses, then goes on
                try:
                    proc.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass

    async def _record(self, s: aiohttp.ClientSession, victim: str, sig: str) -> None:
        rss = {}
        for role, p in self.d.children().items():
            try:
                rss[role] = round(p.memory_info().rss / 2**20, 1)
            except psutil.Error:
                pass
        outside, epoch = None, None
        try:
            async with s.get(self.d.url + "/stats", timeout=aiohttp.ClientTimeout(total=5)) as r:
                st = await r.json()
            eng = st["engines"][0]
            epoch = eng["epoch"]
            if "engine" in rss:
                outside = round(rss["engine"] - eng["cache"].get("ram_bytes", 0) / 2**20, 1)
        except Exception:  # noqa: BLE001 - the proxy may be down this instant
            pass
        rec = RoundRecord(round(time.monotonic(), 1), victim, sig, rss, outside, epoch)
        self.rounds.append(rec)
        print(json.dumps(asdict(rec)), flush=True)


def flatness(rounds: list[RoundRecord]) -> dict:
    """Engine RSS outside the prefix cache: mean of the middle and of the last third."""
    xs = [r.engine_rss_outside_cache_mb for r in rounds if r.engine_rss_outside_cache_mb]
    if len(xs) < 6:
        return {"samples": len(xs)}
    n = len(xs) // 3
    mid, last = xs[n:2 * n], xs[2 * n:]
    m, l_ = sum(mid) / len(mid), sum(last) / len(last)
    return {"samples": len(xs), "middle_third_mb": round(m, 1), "last_third_mb": round(l_, 1),
            "last_vs_middle": round(l_ / m, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--kill-every", type=float, default=20)
    ap.add_argument("--kinds", default="engine,storage,proxy",
                    help="children to kill (comma-separated); empty: no kills")
    ap.add_argument("--stop-share", type=float, default=0.3, help="share of SIGSTOP vs SIGKILL")
    ap.add_argument("--fuzz-per-s", type=float, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--hang-timeout", type=float, default=5)
    ap.add_argument("--request-timeout", type=float, default=180)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None, help="default: a tiny random model")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from support.random_model import write_random_model
    work = Path(tempfile.mkdtemp(prefix="mlxd-soak-"))
    model = args.model or write_random_model(work / "tiny-llama", context=512)
    d = SoakDaemon(model, work, ["--hang-timeout", str(args.hang_timeout),
                                 "--generation-checkpoint", "8", "--block-tokens", "16",
                                 "--batch", str(max(8, args.streams))])
    started = time.time()
    d.start()
    soak = Soak(args, d)
    try:
        asyncio.run(soak.run())
        supervisor_alive = d.proc is not None and d.proc.poll() is None
    finally:
        code = d.stop()
    c = soak.counts
    from support.harness import RUN_DIRS, leftovers
    RUN_DIRS.append(d.run_dir)
    segments, procs, _ = leftovers()
    summary = {"minutes": args.minutes, "streams": args.streams, "kill_every_s": args.kill_every,
               "kinds": args.kinds, "started": started, **asdict(c),
               "supervisor_survived": supervisor_alive, "recovery": soak.recovery,
               "exit_code": code,
               "left_segments": segments, "left_processes": procs,
               "engine_rss": flatness(soak.rounds), "log": str(work / "daemon.log"),
               "passed": passed(c, soak.recovery, supervisor_alive, code, segments, procs)}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"summary": summary, "rounds": [asdict(r) for r in soak.rounds]}, indent=1))
        args.out.with_suffix(".md").write_text(_markdown(summary, soak.rounds))
    return 0 if summary["passed"] else 1


def passed(c: Counts, recovery: dict, supervisor_alive: bool, exit_code: int,
           segments: list, procs: list) -> bool:
    """The gate: every failure counts (see the module's docstring)."""
    return (c.stream_errors == 0 and c.wrong_text == 0 and c.hangs == 0
            and c.fuzz_problems == 0 and c.fuzz_hangs == 0 and bool(recovery.get("serving"))
            and supervisor_alive and exit_code == 0 and not segments and not procs)


def _markdown(s: dict, rounds: list[RoundRecord]) -> str:
    lines = [f"# Soak: {s['minutes']} min, {s['streams']} streams, a kill of one of "
             f"[{s['kinds']}] every {s['kill_every_s']} s", "",
             "| stream requests | ok | wrong text | stream errors | dropped with a killed proxy "
             "| hangs | resumes | kills | fuzzed requests | fuzz 5xx | fuzz other problems "
             "| fuzz hangs | supervisor survived |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
             f"| {s['stream_requests']} | {s['streams_ok']} | {s['wrong_text']} | "
             f"{s['stream_errors']} | "
             f"{s['dropped_by_proxy_death']} | {s['hangs']} | {s['resumes']} | {s['kills']} | "
             f"{s['fuzz_requests']} | {s['fuzz_5xx']} | "
             f"{s['fuzz_problems'] - s['fuzz_5xx']} | {s['fuzz_hangs']} | "
             f"{s['supervisor_survived']} |", "",
             f"After the chaos: {json.dumps(s['recovery'])}", "",
             f"Gate: {'passed' if s['passed'] else 'FAILED'}", "",
             f"Engine RSS outside the prefix cache: {json.dumps(s['engine_rss'])}", "",
             "| t | killed | signal | engine epoch "
             "| RSS MB (supervisor / proxy / engine / storage) | engine outside cache MB |",
             "|---|---|---|---|---|---|"]
    t0 = rounds[0].t if rounds else 0
    for r in rounds:
        rss = " / ".join(str(r.rss_mb.get(k, "-")) for k in
                         ("supervisor", "proxy", "engine", "storage"))
        lines.append(f"| {r.t - t0:.0f} | {r.victim} | {r.sig} | {r.engine_epoch} | {rss} | "
                     f"{r.engine_rss_outside_cache_mb} |")
    if s["errors"]:
        lines += ["", "Samples of what went wrong:", ""] + [f"- `{e}`" for e in s["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
