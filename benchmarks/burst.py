"""First tokens under a burst (issue 14 item 3): S clients send at once; where does each
request's time go before its first token, by the client's, the proxy's and the engine's clock?

Runs `mlxd serve --isolate` with the stage clock on (MLXD_STAGE_TRACE, protocol/stage_trace.py:
one record per request before its first token, and the first token's own stamps) and, side by
side in the same run, mlx-lm's BatchGenerator in this process with all S prompts inserted at
once (the reference of benchmarks/throughput.py, prompts tokenized beforehand). Rounds of the
two alternate. For each request the stamps are taken relative to the moment the round's first
client sent its request, and the table gives, per stage, the median and the p90 over the
requests of all measured rounds:

    client sent -> proxy in -> sending -> engine in -> prepared (template, tokens) ->
    inserted into the generator -> first token read back -> sent -> proxy wrote it ->
    the client's first content

and, per round, how the burst reached the generator: the sizes of the groups inserted
together (one group per MLX-thread step) and of the groups whose first tokens came out of one
step (prefilled together).

    python benchmarks/burst.py --shape tiny --streams 32 --rounds 3
    python benchmarks/burst.py --shape 1b --model-dtype bfloat16 --streams 32,64
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

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput
from throughput import (
    PROMPTS,
    SHAPES,
    Server,
    model_for,
    pct,
    quiet_gc,
    run_inprocess,
    salted,
    start_target,
)

STAGES = [  # (row label, the stamp's name, whose clock)
    ("proxy in (parsed, checked)", "proxy_in", "proxy"),
    ("sending (to ZeroMQ)", "sending", "proxy"),
    ("engine in (I/O thread)", "engine_in", "engine"),
    ("a lane starts preparing it", "lane", "engine"),
    ("templated and tokenized", "tokenized", "engine"),
    ("RAM and SSD tiers asked", "restore_checked", "engine"),
    ("prepared (template, tokens)", "prepared", "engine"),
    ("taken by the MLX thread", "taken", "engine"),
    ("inserted into the generator", "inserted", "engine"),
    ("first token read back", "read_back", "engine"),
    ("first token sent", "sent", "engine"),
    ("first token written (SSE)", "written", "proxy"),
    ("client: first event (the role chunk, written with the first token)", "client_event",
     "client"),
    ("client: first content", "client_first", "client"),
]


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                  tokens: int, out: dict[str, dict[str, int]]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "stream": True}
    sent = time.perf_counter_ns()
    rid = None
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if rid is None:  # the role chunk: the proxy holds it back until the first token
                rid = obj["id"]
                out[rid] = {"client_sent": sent, "client_event": time.perf_counter_ns()}
            if "client_first" not in out[rid] and any(
                    (ch.get("delta") or {}).get("content") for ch in obj.get("choices") or []):
                out[rid]["client_first"] = time.perf_counter_ns()


async def burst(base: str, model: str, streams: int, tokens: int,
                prompts: list[str] | None = None) -> dict[str, dict[str, int]]:
    """One burst's client stamps (perf_counter_ns: the host's monotonic clock), sent from the
    client process when there is one (`throughput.CLIENTS`)."""
    prompts = prompts or salted(PROMPTS[:streams])  # no round served from an earlier one's cache
    if throughput.CLIENTS is not None:
        return await throughput.CLIENTS.run("burst", "burst_round", base, model, prompts, tokens)
    return await burst_round(base, model, prompts, tokens)


async def burst_round(base: str, model: str, prompts: list[str], tokens: int
                      ) -> dict[str, dict[str, int]]:
    streams = len(prompts)
    out: dict[str, dict[str, int]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(_stream(s, base + "/v1/chat/completions", model, prompts[i],
                                       tokens, out) for i in range(streams)))
    return out


def join(trace_dir: Path, client: dict[str, dict[str, int]]) -> list[dict[str, int]]:
    """Each request of the round: the client's, the proxy's and the engine's stamps."""
    from mlxd.protocol.stage_trace import read
    reqs: dict[str, dict[str, int]] = defaultdict(dict)
    for r in read(trace_dir, requests=True):
        reqs[r.request_id].update(r.stamps)
    for r in read(trace_dir):
        if r.index == 1:  # the first token's stamps
            reqs[r.request_id].update({k: v for k, v in r.stamps.items()
                                       if k in ("read_back", "sent", "written")})
    return [{**reqs.get(rid, {}), **st} for rid, st in client.items()]


def _runs(times: list[float], gap: float) -> list[int]:
    """Sizes of the runs of sorted `times` whose neighbours are at most `gap` ms apart."""
    sizes: list[int] = []
    last = None
    for t in sorted(times):
        if last is None or t - last > gap:
            sizes.append(0)
        sizes[-1] += 1
        last = t
    return sizes


def relative(rows: list[dict[str, int]]) -> tuple[dict[str, list[float]], list[list[int]]]:
    """ms from the round's first client send, per stage; the sizes of the groups of requests
    inserted together (stamps within 1 ms: one MLX-thread step, though a busy CPU spreads one
    insert loop wider), and of those whose first tokens came out of the same step (the same
    read-back stamp: prefilled together)."""
    t0 = min(r["client_sent"] for r in rows)
    rel: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for _, stage, _ in [("", "client_sent", ""), *STAGES]:
            if stage in r:
                rel[stage].append((r[stage] - t0) / 1e6)
    return rel, [_runs(rel["inserted"], 1.0), _runs(rel["read_back"], 0.05)]


def table(streams: int, rels: dict[str, dict[str, list[float]]],
          groups: dict[str, list[list[list[int]]]], ref_first: list[float],
          ref_text: list[float]
          ) -> str:
    names = list(rels)
    lines = [f"### {streams} streams at once", "",
             "median / p90 (ms after the burst's first client send); one column per mlxd "
             "variant (MLXD_BURST_WINDOW=quiet,window ms)", "",
             "| stage | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, stage, _ in [("client sent", "client_sent", ""), *STAGES]:
        cells = []
        for n in names:
            xs = rels[n].get(stage, [])
            cells.append(f"{statistics.median(xs):.1f} / {pct(xs, 0.9):.1f}" if xs else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ref = tuple(f"{statistics.median(xs):.1f} / {pct(xs, 0.9):.1f}" if xs else "no text"
                for xs in (ref_first, ref_text))
    lines.append(f"| in-process, all inserted at once: first token | {ref[0]} |" +
                 " |" * (len(names) - 1))
    lines.append(f"| in-process: first text | {ref[1]} |" + " |" * (len(names) - 1))
    lines.append("")
    for n in names:
        ce, cf = rels[n].get("client_event", []), rels[n].get("client_first", [])
        parts = []
        if ce and ref_first:
            parts.append(f"first token at the client median {statistics.median(ce):.1f} ms "
                         f"against in-process first token {statistics.median(ref_first):.1f} "
                         f"ms: **{statistics.median(ce) / statistics.median(ref_first):.2f}x**")
        if cf and ref_text:
            parts.append(f"first content {statistics.median(cf):.1f} ms against in-process "
                         f"first text {statistics.median(ref_text):.1f} ms: "
                         f"{statistics.median(cf) / statistics.median(ref_text):.2f}x")
        lines.append(f"- {n}: " + "; ".join(parts) + f"; per round, groups inserted together "
                     f"{[g[0] for g in groups[n]]}, first tokens per step "
                     f"{[g[1] for g in groups[n]]}")
    return "\n".join(lines)


def inprocess_first(model_dir: str, streams: int, tokens: int, dtype: str,
                    prompts: list[str] | None = None) -> tuple[list[float], list[float]]:
    """The reference's first tokens and first text (ms after its insert of all S prompts)."""
    rnd = run_inprocess(model_dir, streams, tokens, dtype, prompts)
    return [x * 1e3 for x in rnd.first_token], [x * 1e3 for x in rnd.ttft]


async def main_async(args: argparse.Namespace, model_dir: str) -> str:
    levels = [int(x) for x in args.streams.split(",")]
    trace_root = Path(tempfile.mkdtemp(prefix="mlxd-burst-"))
    extra = args.mlxd_args.split() if args.mlxd_args else []
    variants = args.variants.split(";") if args.variants else [""]
    servers: dict[str, tuple[tuple[Server, str, str], str]] = {}
    for v in variants:
        window, *settings = v.split("+")  # "3,30+--ssd-cache=off+MLXD_X=1"
        env = {"MLXD_STAGE_TRACE": str(trace_root / str(len(servers)))}
        if window:
            env["MLXD_BURST_WINDOW"] = window
        target = "mlxd-isolate" + (":" + ";".join(settings) if settings else "")
        # an SSD tier of its own: the daemons are sent the same prompts, and one daemon's
        # stored blocks must not serve another (a variant's own --ssd-cache comes later, wins)
        kv = ["--ssd-cache", str(trace_root / f"kv-{len(servers)}")]
        servers[v or "default"] = (start_target(target, model_dir, None, args.dtype,
                                                [*extra, *kv], env=env),
                                   env["MLXD_STAGE_TRACE"])
    out = []
    dump: list[dict[str, object]] = []
    try:
        for (server, _, _), _ in servers.values():
            await server.wait()
        for s in levels:
            for (_, base, model), _ in servers.values():
                await burst(base, model, s, args.max_tokens)  # warm-up: shapes built
            inprocess_first(model_dir, s, args.max_tokens, args.dtype)
        for s in levels:
            rels: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in servers}
            groups: dict[str, list[list[list[int]]]] = {n: [] for n in servers}
            ref_first: list[float] = []
            ref_text: list[float] = []
            for i in range(args.rounds):
                # One set of prompts for the round, the reference's and every daemon's: a
                # random model's first token often decodes to no text yet (a partial UTF-8
                # character), and whether it does depends on the prompt, so first *text* is
                # compared on the same prompts (each daemon has its own caches: no hit).
                prompts = salted(PROMPTS[:s])
                with quiet_gc():
                    f, t = inprocess_first(model_dir, s, args.max_tokens, args.dtype, prompts)
                ref_first += f
                ref_text += t
                line = [f"streams {s} round {i}: in-process first token "
                        f"{statistics.median(f):.1f}, first text "
                        f"{statistics.median(t) if t else float('nan'):.1f} ({len(t)} of {s})"]
                for name, ((_, base, model), trace) in servers.items():
                    # each daemon appends to its own directory for the whole run: a round's
                    # records are told apart by their request ids (the client's)
                    with quiet_gc():
                        client = await burst(base, model, s, args.max_tokens, prompts)
                    rows = join(Path(trace), client)
                    r, g = relative(rows)
                    t0 = min(row["client_sent"] for row in rows)
                    dump.append({"streams": s, "round": i, "variant": name, "requests": [
                        {k: round((v - t0) / 1e6, 2) for k, v in row.items()}
                        for row in sorted(rows, key=lambda row: row["client_sent"])]})
                    for k, v in r.items():
                        rels[name][k] += v
                    groups[name].append(g)
                    cf = r.get("client_first", [])
                    line.append(f"{name} first event {statistics.median(r['client_event']):.1f}, "
                                f"content {statistics.median(cf) if cf else float('nan'):.1f} "
                                f"({len(cf)}), inserted {g[0]} first tokens per step {g[1]}")
                print("; ".join(line), flush=True)
            out.append(table(s, rels, groups, ref_first, ref_text))
    finally:
        for (server, _, _), _ in servers.values():
            server.stop()
        shutil.rmtree(trace_root, ignore_errors=True)
    if args.dump:
        Path(args.dump).write_text(json.dumps(dump, indent=1))
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="'default', a model dir, or omit for --shape")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", default="32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mlxd-args", default="", help="extra `mlxd serve` flags")
    ap.add_argument("--variants", default="",
                    help="mlxd daemons side by side, ';'-separated, each a MLXD_BURST_WINDOW "
                         "value ('QUIET_MS,WINDOW_MS', or empty) then '+'-joined settings: "
                         "'3,30;3,30+--ssd-cache=off'; empty: one, the defaults")
    ap.add_argument("--out", default=None, help="write the tables here too")
    ap.add_argument("--dump", default=None,
                    help="write every request's stamps (ms after its round's first send) "
                         "here, as JSON")
    args = ap.parse_args()
    model_dir = model_for(args)
    from client_process import ClientProcess
    throughput.CLIENTS = ClientProcess()
    try:
        report = asyncio.run(main_async(args, model_dir))
    finally:
        throughput.CLIENTS.close()
    import mlx.core as mx
    head = (f"Model: {args.model or 'random ' + args.shape + ' (' + args.model_dtype + ')'}; "
            f"{args.max_tokens} tokens per request, greedy; {args.rounds} rounds; device "
            f"{mx.default_device()}; mlx {mx.__version__}; "  # type: ignore[attr-defined]
            f"{os.cpu_count()} CPUs; "
            f"{time.strftime('%Y-%m-%d')}.")
    print(head + "\n\n" + report)
    if args.out:
        Path(args.out).write_text(head + "\n\n" + report + "\n")


if __name__ == "__main__":
    main()
