"""Where the time goes in mlxd's serving path under load: starts `mlxd serve --isolate` on a
random-weight model, drives `--concurrency` streaming clients, and samples the engine and proxy
processes with py-spy (`record`, flat text and speedscope JSON) while they work.

    python benchmarks/profile_serving.py --shape 1b --concurrency 32 --seconds 15 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import model_for, run_http, start_target


async def main_async(args: argparse.Namespace) -> None:
    model = model_for(args)
    server, base, name = start_target("mlxd-isolate", model, args.concurrency, "auto",
                                      args.mlxd_args.split() if args.mlxd_args else None)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        await server.wait()
        await run_http("warm", base, name, args.concurrency, 32)
        kids = psutil.Process(server.proc.pid).children(recursive=True)
        roles = {}
        for p in kids:
            cmd = " ".join(p.cmdline())
            for role in ("mlxd.engine", "mlxd.proxy"):
                if role in cmd:
                    roles[role] = p.pid
        rounds: list[float] = []
        for mode in args.modes.split(","):  # one after the other: one py-spy per process
            flags = ["--gil"] if mode == "gil" else []
            tail = "" if mode == "active" else f"-{mode}"
            spies = [subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration",
                                       str(args.seconds), "--rate", "200", "--threads",
                                       *flags, "--format", fmt, "--output",
                                       str(args.out / f"{role.split('.')[-1]}{tail}.{ext}")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for role, pid in roles.items()
                     for fmt, ext in (("raw", "txt"), ("speedscope", "json"))]
            t0 = time.time()
            while time.time() - t0 < args.seconds:
                r = await run_http("mlxd-isolate", base, name, args.concurrency,
                                   args.max_tokens)
                rounds.append(r.tok_s)
                print(f"{mode} round {len(rounds)}: {r.tok_s:.0f} tok/s", flush=True)
            for s in spies:
                s.wait()
    finally:
        server.stop()


def summarize(raw: Path, top: int = 25) -> str:
    """Self time by thread and by leaf frame from py-spy's raw output (active samples only:
    py-spy leaves out threads waiting outside Python without holding the GIL; with --gil,
    only the thread holding it)."""
    from collections import Counter
    threads: Counter = Counter()
    leaves: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        total += n
        threads[thread] += n
        leaves[(thread, frames[-1])] += n
    out = [f"{total} active samples", "", "by thread:"]
    out += [f"{n / total:7.2%} {t}" for t, n in threads.most_common()]
    out += ["", "by leaf frame (self time):"]
    out += [f"{n / total:7.2%} [{t}] {f}" for (t, f), n in leaves.most_common(top)]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--summarize", type=Path, default=None, metavar="DIR",
                    help="only write DIR/*-self-time.txt from the raw profiles in DIR")
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--model-dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--mlxd-args", default="")
    ap.add_argument("--modes", default="active",
                    help="py-spy passes, one after the other: 'active' (threads at work) and "
                         "'gil' (only the thread holding the GIL), comma-separated")
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()))
    args = ap.parse_args()
    if args.summarize is None:
        asyncio.run(main_async(args))
    out = args.summarize or args.out
    for raw in sorted(out.glob("*.txt")):
        if not raw.name.endswith("-self-time.txt"):
            (out / f"{raw.stem}-self-time.txt").write_text(summarize(raw))


if __name__ == "__main__":
    main()
