"""Throughput side by side, in one run, on the same model and prompts:

- `inprocess`: mlx-lm's BatchGenerator driven in-process (the reference),
- `mlxd-isolate`: `mlxd serve --isolate` with streaming HTTP clients,
- `mlxd`: `mlxd serve` (one process),
- `mlx_lm.server`: mlx-lm's own server with streaming HTTP clients.

For each concurrency it runs a warm-up round, then a measured round, and reports aggregate
generated tok/s, the ratio to in-process, and time-to-first-token / inter-token latency
percentiles. Writes a markdown table, a JSON file and (with matplotlib) a PNG plot.

    python benchmarks/throughput.py --shape tiny --concurrency 1,8 --out benchmarks/results/cpu
    python benchmarks/throughput.py --model default --targets inprocess,mlxd-isolate

The servers get a batch as large as the highest concurrency (`--server-batch max`, the
default) or are left at their own defaults (`--server-batch default`: mlxd `--batch auto`,
mlx_lm.server's decode and prompt concurrency). `--repeat N` measures each level N times and
keeps the median round. A target may carry environment variables for its server, to compare
settings side by side: `--targets inprocess,mlxd-isolate,mlxd-isolate:--speculative=off`
(environment variables and `mlxd serve` flags after the colon, separated by `;`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 128, 512),
    "small": (512, 8, 8, 4, 1536, 4096),
    "1b": (2048, 16, 32, 8, 8192, 32000),
}
PROMPTS = [f"Request {i}: write a long and detailed story about a lighthouse keeper, "
           f"the sea, and the number {i}." for i in range(256)]
_ROUNDS = itertools.count()


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """A measured round without this process's garbage collector (collected before, off
    during), every target alike, the in-process one included: this process holds the
    reference's model, tokenizer and libraries, whose full collection would land in whichever
    round it falls in. (It was tried first for the ~100 ms lags of some burst rounds; it did
    not remove them: benchmarks/HISTORY.md section 23 says what did explain them.)"""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def salted(prompts: list[str]) -> list[str]:
    """The prompts of one round, made its own: a server's prefix cache must not serve a round
    the prompts an earlier round (or the warm-up) sent, which the in-process reference would
    prefill (mlxd's RAM cache held 83 of their 84 tokens from one round to the next)."""
    n = next(_ROUNDS)
    return [f"Round {n}. {p}" for p in prompts]


@dataclass
class Round:
    target: str
    concurrency: int
    tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    engine_ttft: float | None = None  # mean request receipt -> first token (engine clock)
    engine_admit: float | None = None  # mlxd: mean engine receipt -> inserted into the batch
    engine_cap: int | None = None  # mlxd: the batch cap in force (/stats batch_cap)
    engine_peak: int | None = None  # mlxd: most rows decoded together so far
    errors: int = 0  # streams that broke off (connection reset, HTTP error)
    first_token: list[float] = field(default_factory=list)  # in-process: each row's first token
    paired: float = float("nan")  # --interleave: median of its rounds' ratios to in-process
    paired_each: list[float] = field(default_factory=list)  # --interleave: every round's ratio

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------- in-process reference

def run_inprocess(model_dir: str, concurrency: int, max_tokens: int, dtype: str,
                  texts: list[str] | None = None) -> Round:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlxd.engine.load.loader import load_model
    global _LOADED
    if _LOADED is None or _LOADED[0] != model_dir:
        cache_dir = Path(tempfile.gettempdir()) / "mlxd-bench-cache"
        model, tok, _ = load_model(model_dir, cache_dir, dtype)
        _LOADED = (model_dir, model, tok)
    _, model, tok = _LOADED
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in (texts or salted(PROMPTS[:concurrency]))]
    global _STREAM
    if _STREAM is None:  # one for the whole run: on CUDA a new stream per round decoded 9 %
        _STREAM = mx.new_stream(mx.default_device())  # slower (benchmarks/decode_stream.py)
    gen = BatchGenerator(model, completion_batch_size=max(concurrency, 1),
                         prefill_batch_size=max(concurrency, 1), prefill_step_size=512,
                         stream=_STREAM)
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[max_tokens] * concurrency)  # no EOS stop: fixed length
    first: dict[int, float] = {}
    first_text: dict[int, float] = {}
    last: dict[int, float] = {}
    itl: list[float] = []
    tokens = 0
    live = set(uids)
    # Time to first *text*, as an HTTP client sees it: a random-weight model often starts
    # with byte tokens that decode to nothing until a character is complete.
    detok = {uid: tok.detokenizer for uid in uids}
    while live:
        _, responses = gen.next()
        now = time.perf_counter()
        for r in responses:
            tokens += 1
            if r.uid not in first:
                first[r.uid] = now - t0
            else:
                itl.append(now - last[r.uid])
            last[r.uid] = now
            if r.uid not in first_text:
                d = detok[r.uid]
                d.add_token(r.token)
                if d.last_segment:
                    first_text[r.uid] = now - t0
            if r.finish_reason is not None:
                live.discard(r.uid)
    seconds = time.perf_counter() - t0
    gen.close()
    return Round("inprocess", concurrency, tokens, seconds, list(first_text.values()), itl,
                 engine_ttft=statistics.mean(first.values()) if first else None,
                 first_token=list(first.values()))


_LOADED: tuple[str, Any, Any] | None = None  # (model dir, model, tokenizer) last loaded
_STREAM: Any = None  # the reference's MLX stream, made once


# ---------------------------------------------------------------- HTTP targets

async def _one_stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                      max_tokens: int, t0: float, ttft: list, itl: list,
                      errors: list | None = None) -> int:
    """Tokens the stream delivered; one that breaks off (a reset, an HTTP error) counts the
    content chunks it delivered and adds to `errors` (raises without it)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    last = None
    usage = 0
    chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        chunks += 1
                        if last is None:
                            ttft.append(now - t0)
                        else:
                            itl.append(now - last)
                        last = now
    except (TimeoutError, aiohttp.ClientError) as e:
        if errors is None:
            raise
        errors.append(repr(e))
        return chunks
    return usage or chunks


CLIENTS: Any = None  # a client_process.ClientProcess: the HTTP rounds run there when set


async def run_http(name: str, base: str, model: str, concurrency: int, max_tokens: int,
                   unix: str | None = None) -> Round:
    """One round of `concurrency` streaming clients, in the client process when there is one
    (the prompts are salted here: one count of rounds for the whole run)."""
    prompts = salted(PROMPTS[:concurrency])
    if CLIENTS is not None:
        return await CLIENTS.run("throughput", "http_round", name, base, model, prompts,
                                 max_tokens, unix)
    return await http_round(name, base, model, prompts, max_tokens, unix)


async def http_round(name: str, base: str, model: str, prompts: list[str], max_tokens: int,
                     unix: str | None = None) -> Round:
    concurrency = len(prompts)
    connector = aiohttp.UnixConnector(path=unix) if unix else aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    ttft: list[float] = []
    itl: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(
            _one_stream(session, base + "/v1/chat/completions", model, prompts[i], max_tokens,
                        t0, ttft, itl, errors)
            for i in range(concurrency)))
        seconds = time.perf_counter() - t0
    if errors:
        print(f"{name} c={concurrency}: {len(errors)} streams broke off, e.g. {errors[0]}",
              flush=True)
    return Round(name, concurrency, sum(counts), seconds, ttft, itl, errors=len(errors))


class Server:
    def __init__(self, argv: list[str], ready_url: str, env: dict | None = None,
                 log: Path | None = None) -> None:
        """`log`: the server's output appended there (else dropped)."""
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if log
                                     else subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        if log is not None:
            out.close()  # type: ignore[union-attr]  # the child holds its own descriptor
        self.ready_url = ready_url

    async def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}")
                try:
                    async with s.get(self.ready_url) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def save(out: Path | None, text: str, data: object) -> None:
    """Print a benchmark's markdown table; with --out, write it and its raw data (JSON)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_target(target: str, model_dir: str, batch: int | None, dtype: str,
                 extra: list[str] | None = None, env: dict | None = None
                 ) -> tuple[Server, str, str]:
    """`batch` None: the server's own default batch. A target may name environment variables
    and `mlxd serve` flags for its server after a colon:
    `mlxd-isolate:MLXD_GIL_SWITCH_US=5000;--speculative=off`."""
    target, _, variant = target.partition(":")
    env, extra = dict(env or {}), list(extra or [])
    for item in filter(None, variant.split(";")):
        key, eq, value = item.partition("=")
        if key.startswith("--"):
            extra += [key, value] if eq else [key]
        else:
            env[key] = value
    port = free_port()
    if target == "mlx_lm.server":
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--port", str(port),
                "--prompt-cache-bytes", "0" , "--log-level", "WARNING"]
        if batch is not None:
            argv += ["--decode-concurrency", str(batch), "--prompt-concurrency", str(batch)]
        base = f"http://127.0.0.1:{port}"
        return Server(argv, f"{base}/health"), base, model_dir
    run_dir = tempfile.mkdtemp(prefix="mlxd-b-", dir="/tmp")
    argv = [sys.executable, "-m", "mlxd.cli.main", "serve", model_dir, "--port", str(port),
            "--run-dir", run_dir, "--dtype", dtype,
            "--cache-dir", str(Path(tempfile.gettempdir()) / "mlxd-bench-cache"),
            "--log-level", "warning"]
    if batch is not None:
        argv += ["--batch", str(batch)]
    if target == "mlxd-isolate":
        argv.append("--isolate")
    argv += extra or []
    return (Server(argv, f"http://127.0.0.1:{port}/health", env), f"http://127.0.0.1:{port}",
            model_dir)


# ---------------------------------------------------------------- driver

def model_for(args: argparse.Namespace) -> str:
    if args.model:
        if args.model == "default":
            return "default"
        return args.model
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.random_model import write_random_model  # tests/support: shared with the tests
    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[args.shape]
    out = Path(tempfile.gettempdir()) / f"mlxd-bench-{args.shape}-{args.model_dtype}"
    if not (out / "config.json").exists():
        write_random_model(out, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           intermediate=inter, vocab=vocab, context=4096,
                           dtype=args.model_dtype)
    return str(out)


async def main_async(args: argparse.Namespace) -> list[Round]:
    model_dir = model_for(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.interleave:
        return await interleaved(args, model_dir, levels)
    rounds: list[Round] = []
    for target in args.targets.split(","):
        if target == "inprocess":
            for c in levels:
                run_inprocess(model_dir, c, min(args.max_tokens, 16), args.dtype)  # warm-up
                r = median_round([run_inprocess(model_dir, c, args.max_tokens, args.dtype)
                                  for _ in range(args.repeat)])
                rounds.append(r)
                print(f"{target:14s} c={c:3d} {r.tok_s:9.1f} tok/s, first text p50 "
                      f"{pct(r.ttft, .5):.3f} s, first token {_secs(r.engine_ttft)} s", flush=True)
            continue
        batch = max(levels) if args.server_batch == "max" else None
        server, base, name = start_target(target, model_dir, batch, args.dtype,
                                          args.mlxd_args.split() if args.mlxd_args else None)
        try:
            await server.wait()
            if target.startswith("mlxd"):
                print(f"{target}: batch {(await engine_figures(base)).get('batch_why')}",
                      flush=True)
            for c in levels:
                await run_http(target, base, name, c, min(args.max_tokens, 16))  # warm-up
                tries = []
                for _ in range(args.repeat):
                    tries.append(await measured_http(target, base, name, c, args.max_tokens))
                r = median_round(tries)
                rounds.append(r)
                print(f"{target:14s} c={c:3d} {r.tok_s:9.1f} tok/s, first text p50 "
                      f"{pct(r.ttft, .5):.3f} s, engine to first token {_secs(r.engine_ttft)} s"
                      + (f" (cap {r.engine_cap}, peak {r.engine_peak})"
                         if r.engine_cap is not None else ""), flush=True)
        finally:
            server.stop()
    return rounds


async def interleaved(args: argparse.Namespace, model_dir: str, levels: list[int]
                      ) -> list[Round]:
    """Every server started up front; at each level, each repetition runs one round of every
    target, in an order that rotates, so that a machine drifting over the run (the H200's
    reference moved by 2x within an hour) moves all targets alike. Each round's ratio to the
    in-process round of the same repetition is kept (`Round.paired`: their median)."""
    targets = args.targets.split(",")
    batch = max(levels) if args.server_batch == "max" else None
    servers = {t: start_target(t, model_dir, batch, args.dtype,
                               args.mlxd_args.split() if args.mlxd_args else None)
               for t in targets if t != "inprocess"}
    rounds: list[Round] = []
    try:
        for server, _, _ in servers.values():
            await server.wait()

        async def one(target: str, c: int, tokens: int) -> Round:
            with quiet_gc():
                if target == "inprocess":
                    return run_inprocess(model_dir, c, tokens, args.dtype)
                _, base, name = servers[target]
                return await measured_http(target, base, name, c, tokens)
        for c in levels:
            for t in targets:
                await one(t, c, min(args.max_tokens, 16))  # warm-up
            tries: dict[str, list[Round]] = {t: [] for t in targets}
            for rep in range(args.repeat):
                order = targets[rep % len(targets):] + targets[:rep % len(targets)]
                for t in order:
                    tries[t].append(await one(t, c, args.max_tokens))
            for t in targets:
                r = median_round(tries[t])
                if "inprocess" in tries:
                    r.paired_each = [x.tok_s / ref.tok_s for x, ref in
                                     zip(tries[t], tries["inprocess"], strict=True)]
                    r.paired = statistics.median(r.paired_each)
                rounds.append(r)
                print(f"{t:14s} c={c:3d} {r.tok_s:9.1f} tok/s, paired ratio {r.paired:.2f}, "
                      f"first text p50 {pct(r.ttft, .5):.3f} s", flush=True)
        for t, (_, base, _) in servers.items():
            if t.startswith("mlxd"):
                print(f"{t}: engine counters {engine_counters(await engine_figures(base))}",
                      flush=True)
    finally:
        for server, _, _ in servers.values():
            server.stop()
    return rounds


def engine_counters(figures: dict) -> dict:
    """What an mlxd engine did over the whole run: steps, cache tiers, speculation."""
    c = figures.get("cache", {})
    keys = ("prompt_tokens", "prefilled_tokens", "cached_tokens", "ram_hits", "ram_misses",
            "ram_evictions", "spec_steps", "spec_acceptance", "spec_tokens_per_step",
            "spec_skipped", "spec_missed", "bursts", "step_s")
    return {"steps": figures.get("steps"), **{k: c[k] for k in keys if k in c}}


def median_round(tries: list[Round]) -> Round:
    return sorted(tries, key=lambda r: r.tok_s)[len(tries) // 2]


async def measured_http(target: str, base: str, name: str, c: int, max_tokens: int) -> Round:
    """One measured round; for mlxd, with the engine's own account of it from /stats."""
    before = await engine_figures(base) if target.startswith("mlxd") else None
    r = await run_http(target, base, name, c, max_tokens)
    if before is not None:
        after = await engine_figures(base)
        n = after["cache"].get("first_tokens", 0) - before["cache"].get("first_tokens", 0)
        if n:
            r.engine_ttft = (after["cache"]["to_first_token_s"]
                             - before["cache"]["to_first_token_s"]) / n
            r.engine_admit = (after["cache"]["to_admit_s"] - before["cache"]["to_admit_s"]) / n
        r.engine_cap, r.engine_peak = after.get("batch_cap"), after.get("peak_batch")
    return r


async def engine_figures(base: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(base + "/stats") as r:
        return (await r.json())["engines"][0]


def _secs(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def report(rounds: list[Round], args: argparse.Namespace, out: Path) -> str:
    import mlx.core as mx
    ref = {r.concurrency: r.tok_s for r in rounds if r.target == "inprocess"}
    lines = [f"Model: {args.model or 'random ' + args.shape + ' (' + args.model_dtype + ')'}; "
             f"{args.max_tokens} generated tokens per request, greedy; servers' batch: "
             f"{args.server_batch}; median of {args.repeat} round(s); "
             f"device {mx.default_device()}; "
             f"mlx {version('mlx')}; {platform.machine()} {os.cpu_count()} cores; "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "| target | concurrency | tok/s | ratio to in-process | first text p50 (s) "
             "| first text p90 (s) | ITL p50 (ms) | ITL p90 (ms) | engine: to batch, mean (s) "
             "| engine: to first token, mean (s) | mlxd batch cap (peak) | streams broken |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        ratio = r.tok_s / ref[r.concurrency] if ref.get(r.concurrency) else float("nan")
        lines.append(f"| {r.target} | {r.concurrency} | {r.tok_s:.1f} | {ratio:.2f} | "
                     f"{pct(r.ttft, .5):.3f} | {pct(r.ttft, .9):.3f} | {pct(r.itl, .5) * 1e3:.1f} "
                     f"| {pct(r.itl, .9) * 1e3:.1f} | {_secs(r.engine_admit)} | "
                     f"{_secs(r.engine_ttft)} | "
                     f"{'' if r.engine_cap is None else f'{r.engine_cap} ({r.engine_peak})'} | "
                     f"{r.errors} |")
    if args.interleave:
        lines += ["", f"Interleaved: each of the {args.repeat} repetitions ran every target in "
                  "turn (the order rotating); paired ratio = median over repetitions of the "
                  "round's tok/s / the in-process round's of the same repetition:", ""]
        lines += [f"- {r.target} at {r.concurrency}: {r.paired:.2f} (each repetition: "
                  f"{', '.join(f'{x:.2f}' for x in r.paired_each)})" for r in rounds
                  if r.target != "inprocess"]
    table = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps(
        [{**asdict(r), "tok_s": r.tok_s, "ttft": None, "itl": None,
          "ttft_p50": pct(r.ttft, .5), "itl_p50": pct(r.itl, .5)} for r in rounds], indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in dict.fromkeys(r.target for r in rounds):
            rs = [r for r in rounds if r.target == target]
            ax.plot([r.concurrency for r in rs], [r.tok_s for r in rs], marker="o", label=target)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("generated tok/s")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    except ImportError:
        pass
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="'default', a model dir, or omit for --shape")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model-dtype", default="float32", help="dtype of the random weights")
    ap.add_argument("--dtype", default="auto", help="mlxd --dtype (and the in-process load)")
    ap.add_argument("--targets", default="inprocess,mlxd-isolate,mlxd,mlx_lm.server")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-batch", choices=["max", "default"], default="max",
                    help="max: servers get --batch / --decode-concurrency of the highest "
                    "concurrency; default: their own defaults (mlxd --batch auto)")
    ap.add_argument("--repeat", type=int, default=1, help="measured rounds per level (median)")
    ap.add_argument("--interleave", action="store_true",
                    help="start every server first and alternate the targets round by round "
                         "(paired ratios, robust to a drifting machine)")
    ap.add_argument("--mlxd-args", default="", help="extra `mlxd serve` flags, e.g. "
                    "'--ssd-cache off --prompt-cache 0'")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput"))
    args = ap.parse_args()
    global CLIENTS
    from client_process import ClientProcess
    CLIENTS = ClientProcess()
    try:
        rounds = asyncio.run(main_async(args))
    finally:
        CLIENTS.close()
    print(report(rounds, args, args.out))


if __name__ == "__main__":
    main()
