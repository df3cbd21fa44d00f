"""Memory side by side: the resident set of every process of each server, at idle and under load.

For each target (`mlxd-isolate`, `mlxd`, `mlx_lm.server`), with its default batch settings and
the same model, it starts the server, sends one request (so that the model is loaded and its
kernels built), then samples every process in the server's tree:

- idle: after that request, once the figures settle;
- load: the peak over a round of `--streams` concurrent streaming requests (sampled every 50 ms);
- idle after the load: once the figures settle again (what a long-running daemon keeps).

Per process it reports RSS (and USS where the platform gives it: memory no other process
shares), and the tree's total. With `--maps` (Linux) it also splits the largest process's USS
(the engine, or `mlx_lm.server`) by what is mapped (`/proc/PID/smaps`: the heap, anonymous
mappings by size, each library, shared memory, device files) idle after the load round, and lists
the categories where the targets differ most: where an engine's extra memory lives.
On Apple Silicon the model's weights and KV live in unified
memory and show in the engine's footprint; on a CUDA machine they live on the GPU and RSS is
the host side only.

    python benchmarks/memory.py --shape 1b --model-dtype bfloat16 --streams 32 \
        --out benchmarks/results/gpu-memory.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import psutil

from throughput import PROMPTS, model_for, run_http, save, start_target


def _role(p: psutil.Process) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "?"
    for needle, role in (("mlxd.engine", "engine"), ("mlxd.proxy", "proxy"),
                         ("mlxd.storage_worker", "storage worker"),
                         ("mlx_lm.server", "mlx_lm.server"), ("mlxd.cli", "supervisor")):
        if needle in cmd:
            return role
    return p.name()


def sample(root: int) -> dict[str, tuple[float, float]]:
    """{role (pid): (rss MB, uss MB)} for the process tree under `root`."""
    out: dict[str, tuple[float, float]] = {}
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            info = p.memory_full_info()
            uss = getattr(info, "uss", 0.0)
            out[f"{_role(p)} ({p.pid})"] = (info.rss / 2**20, uss / 2**20)
        except psutil.Error:
            continue
    return out


def _category(path: str, size_kb: int) -> str:
    if not path:  # anonymous: glibc's per-thread arenas are 64 MB reservations
        return "anon >= 32 MB" if size_kb >= 32 << 10 else "anon < 32 MB"
    if path.startswith("["):
        return path
    if path.startswith("/dev/shm/"):
        return "/dev/shm"
    if path.startswith("/dev/"):
        return path.split(" ")[0]
    return Path(path.split(" ")[0]).name


def uss_by_mapping(pid: int) -> dict[str, float]:
    """{mapping category: private (USS) MB} for one process (Linux `smaps`)."""
    out: dict[str, float] = {}
    cat, size = "", 0
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        head = line.split(None, 5)
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            size = (hi - lo) >> 10
            cat = _category(head[5] if len(head) > 5 else "", size)
        elif head[0] in ("Private_Clean:", "Private_Dirty:"):
            out[cat] = out.get(cat, 0.0) + int(head[1]) / 1024
    return out


def largest(root: int) -> psutil.Process | None:
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
        return max(procs, key=lambda p: p.memory_info().rss)
    except (psutil.Error, ValueError):
        return None


def _merge_peak(peak: dict[str, tuple[float, float]], now: dict[str, tuple[float, float]]) -> None:
    for k, (rss, uss) in now.items():
        old = peak.get(k, (0.0, 0.0))
        peak[k] = (max(old[0], rss), max(old[1], uss))


async def measure(target: str, model_dir: str, streams: int, max_tokens: int,
                  dtype: str, maps: bool = False) -> dict:
    server, base, model = start_target(target, model_dir, None, dtype)
    try:
        await server.wait()
        await run_http(target, base, model, 1, 8)  # load the model, build its kernels
        idle_deadline = time.monotonic() + 3.0
        idle = sample(server.proc.pid)
        while time.monotonic() < idle_deadline:  # let the allocator settle after the request
            await asyncio.sleep(0.5)
            idle = sample(server.proc.pid)
        peak: dict[str, tuple[float, float]] = {}
        load = asyncio.ensure_future(run_http(target, base, model, streams, max_tokens))
        while not load.done():
            _merge_peak(peak, sample(server.proc.pid))
            await asyncio.sleep(0.05)
        r = load.result()
        after = sample(server.proc.pid)
        settle = time.monotonic() + 3.0
        while time.monotonic() < settle:  # idle again: what a long-running daemon keeps
            await asyncio.sleep(0.5)
            after = sample(server.proc.pid)
        out = {"target": target, "idle": idle, "peak": peak, "after": after, "tok_s": r.tok_s,
               "errors": r.errors}
        if maps and (big := largest(server.proc.pid)) is not None:
            out["maps"] = uss_by_mapping(big.pid)
            out["maps_process"] = f"{_role(big)} ({big.pid}), {big.num_threads()} threads"
        return out
    finally:
        server.stop()


def report(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# Memory at idle and under {args.streams} streams ({args.shape or args.model}, "
             f"{args.max_tokens} tokens per stream, default batch settings)", "",
             "| server | process | idle RSS MB | idle USS MB | peak RSS MB | peak USS MB "
             "| idle after the load: RSS MB | USS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        keys = sorted(set(res["idle"]) | set(res["peak"]))
        tot = [0.0] * 6
        for k in keys:
            i = res["idle"].get(k, (0.0, 0.0))
            p = res["peak"].get(k, (0.0, 0.0))
            a = res.get("after", {}).get(k, (0.0, 0.0))
            for n, v in enumerate((*i, *p, *a)):
                tot[n] += v
            lines.append(f"| {res['target']} | {k} | {i[0]:,.0f} | {i[1]:,.0f} | "
                         f"{p[0]:,.0f} | {p[1]:,.0f} | {a[0]:,.0f} | {a[1]:,.0f} |")
        lines.append(f"| {res['target']} | **all** | " + " | ".join(
            f"**{t:,.0f}**" for t in tot) + " |")
    lines.append("")
    for res in results:
        lines.append(f"- {res['target']}: {res['tok_s']:,.0f} tok/s during the load round, "
                     f"{res['errors']} broken streams")
    mapped = [r for r in results if "maps" in r]
    if mapped:
        cats = sorted({c for r in mapped for c in r["maps"]},
                      key=lambda c: -(max(r["maps"].get(c, 0.0) for r in mapped)
                                      - min(r["maps"].get(c, 0.0) for r in mapped)))
        lines += ["", "USS MB by mapping, idle after the load round, the largest process of each "
                  "(categories ordered by their spread between targets):", "",
                  "| mapping | " + " | ".join(f"{r['target']}: {r['maps_process']}"
                                             for r in mapped) + " |",
                  "|---|" + "---|" * len(mapped)]
        for c in cats[:25]:
            lines.append(f"| {c} | " + " | ".join(f"{r['maps'].get(c, 0.0):,.1f}"
                                                 for r in mapped) + " |")
        lines.append("| **all** | " + " | ".join(f"**{sum(r['maps'].values()):,.1f}**"
                                                for r in mapped) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="'default', a model dir, or omit for --shape")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--targets", default="mlxd-isolate,mlxd,mlx_lm.server")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--maps", action="store_true",
                    help="split the largest process's USS by mapping (Linux)")
    args = ap.parse_args()
    model_dir = model_for(args)
    assert len(PROMPTS) >= args.streams
    results = [asyncio.run(measure(t, model_dir, args.streams, args.max_tokens, args.dtype,
                                   args.maps))
               for t in args.targets.split(",")]
    save(args.out, report(results, args), json.loads(json.dumps(results)))


if __name__ == "__main__":
    main()
