"""Where a token's time goes, stage by stage: the per-token cost budget of issue 14 item 2.

Runs S streams of N tokens (greedy) through mlx-lm's BatchGenerator in this process and
through `mlxd serve --isolate` with the per-token stage clock on (MLXD_STAGE_TRACE, see
protocol/stage_trace.py), and prints, per stage, the median and p90 in microseconds:

- the step cycle of the MLX thread, in-process and in the engine (graph build, dispatch,
  device wait, token readback, mlx-lm's bookkeeping, the runner's hand-off, the loop until the
  next step): its sum is the step period, the rate the next token waits on;
- the delivery path of each token after the hand-off (output thread wake-up, detokenizer,
  msgspec encode, ZeroMQ send and transit, proxy decode, hand-off to the request's handler
  task, chunk building, SSE write, the client): latency, paid in parallel with the next step
  except where it takes CPU or the GIL from it.

Every stamp is time.perf_counter_ns of one host (CLOCK_MONOTONIC), so the engine's, the
proxy's and this client's stamps compare directly.

Two mlxd daemons run side by side: the step hand-off as it was (MLXD_EAGER_HANDOFF=1: the
output thread woken at each step's end) and as it is (engine/batch/handoff.py: woken when the
MLX thread next waits on MLX); rounds of in-process, before and after are interleaved, so a
busy machine slows all three alike, and each round's rate is also compared with the
in-process round just before it.

    python benchmarks/stage_costs.py --shape tiny --tokens 256 --streams 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PROMPTS, SHAPES, model_for, start_target

CYCLE = [  # (row, from stamp, to stamp); "next:" = the same stamp of the following step
    ("graph build (forward pass, sampler, as lazy ops)", "next_in", "graph_built"),
    ("dispatch (mx.async_eval)", "graph_built", "dispatched"),
    ("wait for the device (mx.eval of the current token)", "dispatched", "device_done"),
    ("token readback (tolist)", "device_done", "read_back"),
    ("mlx-lm bookkeeping (stop matching, responses)", "read_back", "next_out"),
    ("runner bookkeeping + put on the output queue", "next_out", "put"),
    ("loop until the next step (commands, checks)", "put", "next:next_in"),
]
DELIVERY = [
    ("held until the MLX thread waits on MLX", "put", "handed_off"),
    ("output thread wakes and takes the step", "handed_off", "taken"),
    ("detokenize, stop strings, delta", "taken", "detokenized"),
    ("msgspec encode (StepOutput)", "detokenized", "encoded"),
    ("ZeroMQ send and transit to the proxy", "encoded", "received"),
    ("proxy decode", "received", "decoded"),
    ("to the request's handler task (asyncio)", "decoded", "handler"),
    ("dialect chunk building", "handler", "chunk_built"),
    ("SSE write", "chunk_built", "written"),
    ("to the client (aiohttp client parse)", "written", "client"),
]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------- in-process reference

_loaded: Any = None  # (model, tokenizer, config) of the in-process reference
_mx_stream: Any = None

def inprocess(model_dir: str, streams: int, tokens: int, dtype: str) -> dict[str, Any]:
    """The BatchGenerator alone, with the engine's stamps at mlx-lm's step boundaries; the
    loop does what a minimal caller must (collect each token), stamped as the hand-off."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlxd.engine import stage_clock as et
    from mlxd.engine.load.loader import load_model
    from mlxd.protocol.stage_trace import now
    et.install()
    global _loaded
    if _loaded is None:
        _loaded = load_model(model_dir, Path(tempfile.gettempdir()) / "mlxd-bench-cache", dtype)
    model, tok, _ = _loaded
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True) for p in PROMPTS[:streams]]
    global _mx_stream
    if _mx_stream is None:  # one for every run, as the engine has one
        _mx_stream = mx.new_stream(mx.default_device())
    stream = _mx_stream
    result: dict[str, Any] = {}
    for n in (min(tokens, 16), tokens):  # a warm-up, then the measured run
        gen = BatchGenerator(model, completion_batch_size=max(streams, 8),
                             prefill_batch_size=max(streams, 8), prefill_step_size=512,
                             stream=stream)
        gen.insert(prompts, max_tokens=[n] * streams)
        et.steps.clear()
        et.keep_steps = True
        got: list[int] = []
        cycle: list[dict[str, int]] = []
        t0 = time.perf_counter()
        live = streams
        while live:
            _, responses = gen.next()
            for r in responses:
                got.append(r.token)
                live -= r.finish_reason is not None
            if responses and et.steps and et.steps[-1] is et.last_step:
                t = now()
                step = {**et.last_step, "put": t, "handed_off": t, "rows": len(responses)}
                cycle.append(step)
        seconds = time.perf_counter() - t0
        et.keep_steps = False
        gen.close()
        result = {"tokens": len(got), "seconds": seconds, "steps": cycle}
    return result


# ---------------------------------------------------------------- mlxd --isolate, traced

async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                  tokens: int, seen: list[tuple[str, int, int]]) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    chars = 0
    usage = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            for ch in obj.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    chars += len(text)
                    seen.append((obj["id"], chars, time.perf_counter_ns()))
            if obj.get("usage"):
                usage = obj["usage"]["completion_tokens"]
    return usage


async def served(base: str, model: str, streams: int, tokens: int
                 ) -> tuple[int, float, list[tuple[str, int, int]]]:
    seen: list[tuple[str, int, int]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_stream(s, base + "/v1/chat/completions", model,
                                                PROMPTS[i], tokens, seen)
                                        for i in range(streams)))
        return sum(counts), time.perf_counter() - t0, seen


def join(trace_dir: Path, seen: list[tuple[str, int, int]]) -> list[dict[str, int]]:
    """One dict of stamps per token: the engine's, the proxy's and the client's joined."""
    from mlxd.protocol.stage_trace import read
    tokens: dict[tuple[str, int], dict[str, int]] = defaultdict(dict)
    chars: dict[tuple[str, int], tuple[str, int]] = {}
    for r in read(trace_dir):
        key = (r.request_id, r.index)
        tokens[key].update(r.stamps)
        if r.rows:
            tokens[key].setdefault("rows", r.rows)
        if r.chars >= 0:
            chars[(r.request_id, r.chars)] = key
    for rid, n, t in seen:
        done = chars.get((rid, n))
        if done is not None:  # the token that completed this chunk's text
            tokens[done]["client"] = t
    return [st for _, st in sorted(tokens.items())]


# ---------------------------------------------------------------- the tables

def cycle_costs(steps: list[dict[str, int]]) -> dict[str, list[float]]:
    """µs per step for each cycle stage, over consecutive decode steps."""
    steps = sorted({s["next_in"]: s for s in steps if "next_in" in s}.values(),
                   key=lambda s: s["next_in"])
    costs: dict[str, list[float]] = defaultdict(list)
    for a, b in zip(steps, steps[1:], strict=False):
        for name, x, y in CYCLE:
            end = b[y[5:]] if y.startswith("next:") else a.get(y)
            if x in a and end is not None:
                costs[name].append((end - a[x]) / 1e3)
        costs["step period"].append((b["next_in"] - a["next_in"]) / 1e3)
        costs["rows"].append(a.get("rows", 1))
    return costs


def delivery_costs(tokens: list[dict[str, int]]) -> dict[str, list[float]]:
    costs: dict[str, list[float]] = defaultdict(list)
    for st in tokens:
        if not all(s in st for _, s, _ in DELIVERY) or "client" not in st:
            continue
        for name, x, y in DELIVERY:
            costs[name].append((st[y] - st[x]) / 1e3)
        costs["sum: put to client"].append((st["client"] - st["put"]) / 1e3)
        costs["send"].append((st["sent"] - st["encoded"]) / 1e3)
        costs["step start to client"].append((st["client"] - st["next_in"]) / 1e3)
    return costs


def _cell(xs: list[float] | None, per: float = 1.0) -> str:
    if not xs:
        return "-"
    return f"{pct(xs, .5) / per:.0f} / {pct(xs, .9) / per:.0f}"


def _merge(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Rounds pooled: every round's samples of each stage."""
    out: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        for k, v in r.items():
            out[k].extend(v)
    return out


def table(streams: int, ref: list[dict[str, Any]], variants: dict[str, list[dict[str, Any]]]
          ) -> str:
    """`ref`: the in-process rounds; `variants`: name -> the traced mlxd rounds."""
    rc = _merge([cycle_costs(r["steps"]) for r in ref])
    cyc = {v: _merge([cycle_costs(r["steps"]) for r in runs]) for v, runs in variants.items()}
    dlv = {v: _merge([delivery_costs(r["tokens"]) for r in runs])
           for v, runs in variants.items()}
    names = list(variants)
    rate = {v: statistics.median(r["count"] / r["seconds"] for r in runs)
            for v, runs in variants.items()}
    ref_rate = statistics.median(r["tokens"] / r["seconds"] for r in ref)
    # each round's ratio to the in-process round run just before it (a busy machine moves
    # both alike), median over rounds
    paired = {v: statistics.median((r["count"] / r["seconds"]) / (q["tokens"] / q["seconds"])
                                   for r, q in zip(runs, ref, strict=True))
              for v, runs in variants.items()}
    rows = statistics.median(rc["rows"]) if rc["rows"] else 1
    div = rows if streams > 1 else 1
    per = f" ÷ {rows:.0f} rows (µs per token)" if streams > 1 else " (= per token)"
    lines = [f"### {streams} stream(s) x {ref[0]['tokens'] // streams} tokens, "
             f"{len(ref)} round(s) each, interleaved", "",
             "Rate (median round): in-process " + f"{ref_rate:.0f} tok/s; " + "; ".join(
                 f"mlxd {v} {rate[v]:.0f} tok/s (median of per-round ratios to in-process "
                 f"{paired[v]:.2f})" for v in names) + ".", "",
             f"MLX thread, µs per step{per}, median / p90:", "",
             "| stage | in-process | " + " | ".join(f"mlxd {v}" for v in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for name in [*(n for n, _, _ in CYCLE), "step period"]:
        label = f"**{name}**" if name == "step period" else name
        lines.append(f"| {label} | {_cell(rc.get(name), div)} | "
                     + " | ".join(_cell(cyc[v].get(name), div) for v in names) + " |")
    lines += ["", "Delivery path after the put, µs of latency per token, median / p90 (beside "
              "the next step: it costs the step only through CPU and the GIL):", "",
              "| stage | where | " + " | ".join(f"mlxd {v}" for v in names) + " |",
              "|---|---|" + "---|" * len(names)]
    where = ["engine: MLX thread", *["engine: output thread"] * 3, "ZeroMQ",
             "proxy: reader task", "proxy: asyncio", *["proxy: handler task"] * 2, "client"]
    for (name, _, _), w in zip(DELIVERY, where, strict=True):
        lines.append(f"| {name} | {w} | " + " | ".join(_cell(dlv[v].get(name)) for v in names)
                     + " |")
    lines.append("| **sum of the medians** | | " + " | ".join(
        f"{sum(pct(dlv[v][n], .5) for n, _, _ in DELIVERY if dlv[v].get(n)):.0f}"
        for v in names) + " |")
    lines.append("| (output thread: back from the send, GIL retaken) | engine | " + " | ".join(
        _cell(dlv[v].get("send")) for v in names) + " |")
    lines.append("| put to client, per token | | " + " | ".join(
        _cell(dlv[v].get("sum: put to client")) for v in names) + " |")
    lines.append("| step start to client, per token | | " + " | ".join(
        _cell(dlv[v].get("step start to client")) for v in names) + " |")
    lines.append("\nTokens with every stamp: " + ", ".join(
        f"{v} {len(dlv[v].get(DELIVERY[0][0], []))} of {sum(r['count'] for r in variants[v])}"
        for v in names) + " (a token whose text is empty sends no chunk).")
    return "\n".join(lines) + "\n"


VARIANTS = {  # name -> extra environment of `mlxd serve`
    "eager hand-off (before)": {"MLXD_EAGER_HANDOFF": "1"},
    "deferred hand-off (after)": {},
}


async def start_mlxd(model_dir: str, levels: list[int], dtype: str, extra: list[str],
                     env: dict[str, str], trace_dir: Path) -> tuple[Any, str, str]:
    saved = dict(os.environ)
    os.environ.update({"MLXD_STAGE_TRACE": str(trace_dir), **env})
    try:
        server, base, name = start_target("mlxd-isolate", model_dir, max(levels), dtype, extra)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    await server.wait()
    for c in levels:
        await served(base, name, c, 16)  # warm-up
    return server, base, name


async def traced_round(base: str, name: str, streams: int, tokens: int,
                       trace_dir: Path) -> dict[str, Any]:
    for p in trace_dir.glob("*.jsonl"):
        p.unlink()
    count, seconds, seen = await served(base, name, streams, tokens)
    await asyncio.sleep(0.3)  # the last records are written at each request's end
    toks = join(trace_dir, seen)
    return {"count": count, "seconds": seconds, "tokens": toks,
            "steps": [t for t in toks if "next_in" in t]}


async def main_async(args: argparse.Namespace, model_dir: str, levels: list[int]) -> str:
    dirs = {v: Path(tempfile.mkdtemp(prefix="mlxd-trace-")) for v in VARIANTS}
    servers = {}
    try:
        for v, env in VARIANTS.items():
            servers[v] = await start_mlxd(model_dir, levels, args.dtype,
                                          args.mlxd_args.split(), env, dirs[v])
        inprocess(model_dir, 1, 16, args.dtype)  # load and warm the in-process reference
        out = []
        for c in levels:
            ref: list[dict[str, Any]] = []
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for i in range(args.rounds):  # interleaved: a busy machine slows all alike
                ref.append(inprocess(model_dir, c, args.tokens, args.dtype))
                for v in VARIANTS:
                    _, base, name = servers[v]
                    runs[v].append(await traced_round(base, name, c, args.tokens, dirs[v]))
                print(f"{c} stream(s), round {i + 1}: in-process "
                      f"{ref[-1]['tokens'] / ref[-1]['seconds']:.0f} tok/s, " + ", ".join(
                          f"{v} {runs[v][-1]['count'] / runs[v][-1]['seconds']:.0f}"
                          for v in VARIANTS), file=sys.stderr, flush=True)
            out.append(table(c, ref, runs))
        return "\n".join(out)
    finally:
        for server, _, _ in servers.values():
            server.stop()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="'default', a model dir, or omit for --shape")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per variant")
    ap.add_argument("--mlxd-args", default="--ssd-cache off --prompt-cache 0 --speculative off",
                    help="extra `mlxd serve` flags (default: the plain decode path the "
                    "in-process generator runs: no speculation, no caches)")
    ap.add_argument("--out", type=Path, default=None, help="write the tables here too")
    args = ap.parse_args()
    model_dir = model_for(args)
    levels = [int(c) for c in args.streams.split(",")]
    tables = asyncio.run(main_async(args, model_dir, levels))
    import mlx.core as mx
    head = (f"Model: {args.model or 'random ' + args.shape + ' (' + args.model_dtype + ')'}; "
            f"{args.tokens} tokens per stream, greedy; mlxd --isolate {args.mlxd_args}; "
            f"device {mx.default_device()}; {os.cpu_count()} cores; load average "
            f"{os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M')}.\n")
    report = head + "\n" + tables
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
