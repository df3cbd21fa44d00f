"""Proxy relay capacity: how many streamed tokens per second one proxy process relays to many
SSE clients, when the engine is never the bottleneck.

A real proxy process (`python -m mlxd.proxy`) is fed by `tests/support/fake_engine.py`, which
speaks the real protocol over the real sockets and emits one token per request per step as fast
as the proxy takes them. Clients run in separate processes (so that parsing SSE does not compete
with the proxy for one interpreter), each holding several streaming chat completions; the figure
is content chunks received per second across all clients, after a warm-up round.

    python benchmarks/proxy_relay.py --streams 64 --tokens 2000 --client-procs 4

`--intake` measures the other half of the proxy's work, taking requests in: bursts of S
one-token streaming requests at once (the clients' share of each burst sent together, the
next burst when all have finished), requests per second over `--rounds` bursts; with
`--profile DIR` py-spy samples the proxy meanwhile (what a request costs it, by function).

    python benchmarks/proxy_relay.py --intake --streams 64 --rounds 50 --profile /tmp/intake
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "tests" / "support" / "fake_engine.py"


async def _stream(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {"model": "fake", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": tokens, "stream": True}
    n = 0
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b'data: {"id"') and b'"content": " tok"' in line:
                n += 1
    return n


def _client(url: str, streams: int, tokens: int, rounds: int, start_at: float,
            q: mp.Queue) -> None:
    """`rounds` times, `streams` streams at once of `tokens` tokens each: (tokens relayed,
    requests that got all their tokens, start, end)."""
    async def run() -> tuple[int, int, float, float]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn,
                                         timeout=aiohttp.ClientTimeout(total=600)) as s:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            t0 = time.time()
            relayed = whole = 0
            for _ in range(rounds):
                counts = await asyncio.gather(*(_stream(s, url, tokens) for _ in range(streams)))
                relayed += sum(counts)
                whole += sum(c == tokens for c in counts)
            return relayed, whole, t0, time.time()
    q.put(asyncio.run(run()))


def _run_clients(url: str, streams: int, tokens: int, rounds: int, procs: int
                 ) -> tuple[int, int, float]:
    """The streams spread over `procs` client processes that start together: (tokens
    relayed, requests answered whole, seconds from the first start to the last end)."""
    q: mp.Queue = mp.Queue()
    start_at = time.time() + 1.0
    per = [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]
    ps = [mp.Process(target=_client, args=(url, n, tokens, rounds, start_at, q))
          for n in per if n]
    for p in ps:
        p.start()
    results = [q.get() for _ in ps]
    for p in ps:
        p.join()
    seconds = max(r[3] for r in results) - min(r[2] for r in results)
    return sum(r[0] for r in results), sum(r[1] for r in results), seconds


def measure_intake(url: str, streams: int, rounds: int, procs: int, proxy_pid: int) -> dict:
    import psutil
    proxy = psutil.Process(proxy_pid)
    cpu0 = sum(proxy.cpu_times()[:2])
    _, answered, seconds = _run_clients(url, streams, 1, rounds, procs)
    cpu = sum(proxy.cpu_times()[:2]) - cpu0
    n = max(answered, 1)
    return {"burst": streams, "rounds": rounds, "requests": answered,
            "seconds": round(seconds, 3), "req_s": round(answered / seconds, 1),
            "ms_per_request": round(1e3 * seconds / n, 3),
            "proxy_cpu_ms_per_request": round(1e3 * cpu / n, 3)}


def measure(url: str, streams: int, tokens: int, procs: int) -> dict:
    total, _, seconds = _run_clients(url, streams, tokens, 1, procs)
    return {"streams": streams, "tokens_per_stream": tokens, "relayed_tokens": total,
            "seconds": round(seconds, 3), "tok_s": round(total / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--intake", action="store_true",
                    help="requests per second taken in (bursts of one-token requests)")
    ap.add_argument("--rounds", type=int, default=30, help="bursts per level, with --intake")
    ap.add_argument("--profile", type=Path, default=None,
                    help="py-spy the proxy during the measured levels (raw text) into DIR")
    args = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-relay-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    from mlxd.daemon.launch import popen
    from mlxd.protocol.models import engine_id_for
    from mlxd.protocol.settings import EngineSettings, ProxyLaunch, ProxySettings
    eid = engine_id_for("fake")  # the id the router derives from the model spec
    proxy = popen(ProxyLaunch(epoch=0, run_dir=str(run_dir), log_level="warning", socket=None,
                              engines={eid: "fake"},
                              settings=ProxySettings(port=port, max_tokens=100000),
                              engine=EngineSettings(batch=256)),
                  env=env, start_new_session=True)
    engine = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--run-dir",
                               str(run_dir), "--engine-id", eid], env=env,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    rows = []
    try:
        deadline = time.monotonic() + 60
        import urllib.request
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the proxy did not become ready")
            time.sleep(0.2)
        measure(url, 8, 200, 1)  # warm-up
        spy = None
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proxy.pid), "--rate",
                                    "500", "--format", "raw", "--output",
                                    str(args.profile / "proxy.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for n in (int(x) for x in args.streams.split(",")):
            procs = min(args.client_procs, n)
            row = (measure_intake(url, n, args.rounds, procs, proxy.pid) if args.intake
                   else measure(url, n, args.tokens, procs))
            rows.append(row)
            print(json.dumps(row), flush=True)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
    finally:
        for p in (engine, proxy):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    import platform
    if args.intake:
        lines = [f"# Proxy intake ({time.strftime('%Y-%m-%d')}, {platform.node()}, "
                 f"{os.cpu_count()} CPUs, {args.client_procs} client processes, one-token "
                 "streaming chat requests)", "",
                 "| burst | bursts | requests/s | ms per request | proxy CPU ms per request |",
                 "|---|---|---|---|---|"]
        lines += [f"| {r['burst']} | {r['rounds']} | {r['req_s']:,.0f} | "
                  f"{r['ms_per_request']:.3f} | {r['proxy_cpu_ms_per_request']:.3f} |"
                  for r in rows]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        return
    lines = [f"# Proxy relay capacity ({time.strftime('%Y-%m-%d')}, {platform.node()}, "
             f"{os.cpu_count()} CPUs, {args.client_procs} client processes)", "",
             "| SSE streams | tokens per stream | relayed tok/s |", "|---|---|---|"]
    lines += [f"| {r['streams']} | {r['tokens_per_stream']} | {r['tok_s']:,.0f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
