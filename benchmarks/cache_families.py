"""The second turn of a conversation against its first, for every model family the KV tiers
cache, side by side in one run with `mlx_lm.server`'s prompt cache on the same conversations:

- plain KV (llama), sliding windows (gemma3_text, gpt_oss: RotatingKVCache), hybrids
  (qwen3_next: gated delta + attention; lfm2: convolution + attention), recurrent (mamba2);
- a conversation: a first user message of ~4,000 tokens (text) and a short answer; then that
  conversation, the answer as the server returned it, and a new ~30-token user message;
- the figure: the second turn's time to first content token (streamed, on the client) divided
  by the first turn's, on the same conversation. For mlxd (`serve --isolate`, SSD tier on): on
  the same daemon (RAM), and on a new daemon after `POST /admin/cache/flush`, stop and start
  with the same `--ssd-cache` directory (SSD); for `mlx_lm.server` (default prompt cache, no
  SSD tier): on the same server.

Each repetition is fresh conversations (their own seeds; the RAM and SSD figures each have
their own, so the SSD one is a continuation the first daemon never saw, not a repeat); medians
with the min-max spread. Goals: <= 0.1x from RAM, <= 0.2x from SSD after a restart. Answers are
held by `logit_bias` to tokens whose text encodes back to them (`round_trip_bias`), so that the
second turn holds the tokens generated; `--free-answers` lifts that. Writes
benchmarks/results/cache_families-<shape>-<machine>.json and prints a table. The servers run the
mlxd `import mlxd` finds (its commit is recorded): to measure another checkout than the installed
one, put a package view of it first on PYTHONPATH.

    python benchmarks/cache_families.py                      # tiny random models, all six
    python benchmarks/cache_families.py --shape 1b --machine h200   # ~1B gemma3_text, qwen3_next

`--shape 1b` writes random bfloat16 models of about 1B parameters: gemma3_text (hidden 2048,
16 layers, 16 heads / 8 KV heads, sliding window 512, one full-attention layer in 6) and
qwen3_next (hidden 2048, 16 layers, full attention every 4th layer, 4 experts + a shared one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from throughput import Server, free_port

ALL = ["llama", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "mamba2"]

# shape -> family -> (write_random_model's arguments, keys set over the family's config)
SHAPES: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    "tiny": {f: (dict(hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512), {})
             for f in ALL},
    "1b": {
        # 16 x (attention 12.6M + MLP 50.3M) = 1.01B
        "gemma3_text": (dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=8192,
                             vocab=32000),
                        {"sliding_window": 512, "sliding_window_pattern": 6}),
        # 4 attention + 12 gated delta layers; MLP 4 experts of 1408 + a shared one of 2816
        "qwen3_next": (dict(hidden=2048, layers=16, heads=16, kv_heads=4, intermediate=5632,
                            vocab=32000),
                       {"full_attention_interval": 4}),
    },
}
DEFAULT_FAMILIES = {"tiny": ALL, "1b": ["gemma3_text", "qwen3_next"]}

WORDS = ("the quick brown fox jumps over lazy dog what is capital of france paris hello how are "
         "you today i am fine thank for asking local models run on a mac as background service "
         "chat apps and agents numbers lighthouse keeper sea storm harbour ship lantern night "
         "rock wave gull tide rope anchor sail compass map island fog bell").split()


# ---------------------------------------------------------------- models and conversations

def write_model(family: str, shape: str, dtype: str) -> Path:
    """A random-weight model directory (tests/support/random_model.py), written once."""
    from support import random_model as rm
    kwargs, overrides = SHAPES[shape][family]
    out = Path(tempfile.gettempdir()) / f"mlxd-bench-families-{shape}-{family}-{dtype}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    if not overrides:
        rm.write_random_model(tmp, family=family, context=16384, dtype=dtype, **kwargs)
    else:  # write_random_model with config keys of our own (window, layer pattern)
        import mlx.core as mx
        from tokenizers import Tokenizer
        tmp.mkdir(parents=True)
        make_config, _ = rm.FAMILIES[family]
        vocab = rm.write_tokenizer(tmp, kwargs["vocab"])
        config = make_config({**kwargs, "vocab": vocab, "context": 16384})
        config.update(overrides)
        config["eos_token_id"] = Tokenizer.from_file(str(tmp / "tokenizer.json")).token_to_id(
            "<|im_end|>")
        weights = {k: v.astype(getattr(mx, dtype))
                   for k, v in rm.random_weights(config).items()}
        print(f"{family}: {sum(v.size for v in weights.values()) / 1e9:.2f}B parameters",
              flush=True)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


CHATML_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # random_model's


def words_of(tok: Any, rng: random.Random, tokens: int, frame: str = "{}") -> str:
    """Random words, as many as keep `frame` filled with them within `tokens` tokens."""
    words = [rng.choice(WORDS) for _ in range(tokens)]  # a word is at least one token

    def count(n: int) -> int:
        return len(tok.encode(frame.format(" ".join(words[:n]))).ids)
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= tokens else (lo, mid - 1)
    return " ".join(words[:lo])


def conversation(model_dir: Path, seed: int, first_tokens: int, next_tokens: int
                 ) -> tuple[str, str]:
    """The two user messages of one conversation: the first `first_tokens` tokens long as a
    chat prompt, the second `next_tokens` tokens of text."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    head = f"Conversation {seed}."
    return (head + " " + words_of(tok, rng, first_tokens, CHATML_TURN.format(head + " {}")),
            words_of(tok, rng, next_tokens))


def round_trip_bias(model_dir: Path) -> dict[str, float]:
    """`logit_bias` (+100) on tokens whose every sequence, decoded and encoded again, gives
    the same tokens (checked pairwise): a random model's answer, sent back as text in the
    next turn, is then the tokens it generated, and that turn can continue from the state the
    answer left (mlxd's snapshot of the history's end, mlx_lm.server's cache of prompt and
    answer). Left free, a random model's answer seldom encodes back: mlx-lm's detokenizer drops
    a first token's leading space, a lone byte decodes to U+FFFD, neighbouring pieces merge."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    cand = []
    for t in range(tok.get_vocab_size()):
        text = tok.decode([t])
        if (t not in special and text and text.isprintable() and text == text.strip()
                and tok.encode(text).ids == [t]):
            cand.append(t)
    pieces = {t: tok.decode([t]) for t in cand}
    pairs = [(a, b) for a in cand for b in cand]
    enc = tok.encode_batch([pieces[a] + pieces[b] for a, b in pairs])
    clash: dict[int, set[int]] = {t: set() for t in cand}
    for (a, b), e in zip(pairs, enc, strict=True):
        if e.ids != [a, b]:
            clash[a].add(b)
            clash[b].add(a)
    chosen: list[int] = []
    for t in sorted(cand, key=lambda t: len(clash[t])):
        if t not in clash[t] and not clash[t].intersection(chosen):
            chosen.append(t)
    return {str(t): 100.0 for t in chosen}


# ---------------------------------------------------------------- one request

async def chat(base: str, model: str, messages: list[dict], max_tokens: int,
               bias: dict[str, float] | None) -> dict:
    """A streamed chat completion: time to the first non-empty content (client clock), the
    whole answer text, prompt and cached token counts (from the usage chunk)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if bias:
        body["logit_bias"] = bias
    parts: list[str] = []
    first = None
    usage: dict = {}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async with s.post(base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    raise RuntimeError(obj["error"])
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        if first is None:
                            first = time.perf_counter() - t0
                        parts.append(text)
                if obj.get("usage"):
                    usage = obj["usage"]
    total = time.perf_counter() - t0
    return {"ttft_s": first if first is not None else total, "total_s": total,
            "text": "".join(parts), "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens", 0)}


def first_turn(user: str) -> list[dict]:
    return [{"role": "user", "content": user}]


def second_turn(user: str, answer: str, nxt: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer},
            {"role": "user", "content": nxt}]


class Talk:
    """One server's side of the conversations: the requests with this run's settings."""

    def __init__(self, base: str, model: str, args: argparse.Namespace,
                 bias: dict[str, float] | None) -> None:
        self.base, self.model, self.args, self.bias = base, model, args, bias

    async def first(self, convo: tuple[str, str]) -> dict:
        return await chat(self.base, self.model, first_turn(convo[0]), self.args.answer_tokens,
                          self.bias)

    async def second(self, convo: tuple[str, str], answer: str) -> dict:
        return await chat(self.base, self.model, second_turn(convo[0], answer, convo[1]),
                          self.args.answer_tokens, self.bias)

    async def warm_up(self, convo: tuple[str, str]) -> None:
        """A conversation of its own, both turns: kernels for a long prefill and for a hit."""
        await self.second(convo, (await self.first(convo))["text"])


# ---------------------------------------------------------------- servers

def mlxd_server(model: str, run_dir: str, cache_dir: str, ssd: str, port: int,
                log: Path) -> Server:
    argv = [sys.executable, "-m", "mlxd.cli.main", "serve", model, "--isolate", "--port",
            str(port), "--run-dir", run_dir, "--cache-dir", cache_dir, "--log-level", "warning",
            "--ssd-cache", ssd]
    return Logged(argv, f"http://127.0.0.1:{port}/health", log)


def mlx_lm_server(model: str, port: int, log: Path) -> Server:
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port),
            "--log-level", "WARNING"]
    return Logged(argv, f"http://127.0.0.1:{port}/health", log)


class Logged(Server):
    """throughput.Server with the server's output kept in a file (that one discards it)."""

    def __init__(self, argv: list[str], ready_url: str, log: Path) -> None:
        with log.open("ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.ready_url = ready_url

    def stop(self) -> None:
        """SIGTERM to the server's own process only, as a service manager stopping mlxd would
        (`throughput.Server` signals the whole group: mlxd's storage worker then quit before
        the engine's shutdown flush, which waited 10 s for it); then SIGKILL to what is left
        of the group."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


async def unix_post(sock: str, path: str) -> Any:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
        async with s.post("http://localhost" + path) as r:
            r.raise_for_status()
            return await r.json()


async def stats(base: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/stats") as r:
            return await r.json() if r.status == 200 else {}


KEEP = ("cache_layers", "ram_hits", "ram_misses", "ram_snapshots", "ram_bytes", "prompt_tokens",
        "prefilled_tokens", "cached_tokens", "ssd_hits", "ssd_misses", "ssd_restored_tokens",
        "ssd_blocks_written", "ssd_skipped_no_slot", "ssd_write_failures", "ssd_bytes")


def cache_figures(st: dict) -> dict:
    """The engine's cache figures from /stats that say where the turns were served from."""
    cache = (st.get("engines") or [{}])[0].get("cache") or {}
    return {k: cache[k] for k in KEEP if k in cache}


# ---------------------------------------------------------------- one family

async def run_family(family: str, model: str, args: argparse.Namespace, work: Path) -> dict:
    reps = args.reps
    ram_seeds = [2 * r for r in range(reps)]  # the same conversations for mlxd and mlx_lm
    ssd_seeds = [2 * r + 1 for r in range(reps)]
    convo = {seed: conversation(Path(model), seed, args.prompt_tokens, args.next_tokens)
             for seed in [*ram_seeds, *ssd_seeds]}
    warm = [conversation(Path(model), 1000 + i, args.warm_up_tokens, args.next_tokens)
            for i in range(2)]
    bias = None if args.free_answers else round_trip_bias(Path(model))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ssd, cache_dir = str(work / family / "kv"), str(work / family / "cache")
    out: dict[str, Any] = {"family": family, "mlxd": {"ram": [], "ssd": []}, "mlx_lm": {"ram": []},
                           "logit_bias_tokens": len(bias or {})}

    # mlxd, first daemon: RAM conversations (both turns), SSD conversations (first turn only)
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="mlxd-bf-", dir="/tmp")
    srv = mlxd_server(model, run_dir, cache_dir, ssd, port, logs / f"{family}-mlxd-a.log")
    talk = Talk(f"http://127.0.0.1:{port}", model, args, bias)
    ssd_first: dict[int, dict] = {}
    try:
        await srv.wait()
        await talk.warm_up(warm[0])
        for seed in ram_seeds:
            a = await talk.first(convo[seed])
            b = await talk.second(convo[seed], a["text"])
            out["mlxd"]["ram"].append(pair(seed, a, b))
            print(f"{family:12s} mlxd   RAM  {fmt(a, b)}", flush=True)
        for seed in ssd_seeds:
            ssd_first[seed] = await talk.first(convo[seed])
        out["mlxd"]["cache_a"] = cache_figures(await stats(talk.base))
        out["mlxd"]["flush"] = await unix_post(f"{run_dir}/mlxd.sock", "/admin/cache/flush")
    finally:
        srv.stop()

    # mlxd, a new daemon on the same SSD directory: the SSD conversations' second turns
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="mlxd-bf-", dir="/tmp")
    srv = mlxd_server(model, run_dir, cache_dir, ssd, port, logs / f"{family}-mlxd-b.log")
    talk = Talk(f"http://127.0.0.1:{port}", model, args, bias)
    try:
        await srv.wait()
        await talk.warm_up(warm[1])
        for seed in ssd_seeds:
            a = ssd_first[seed]
            b = await talk.second(convo[seed], a["text"])
            out["mlxd"]["ssd"].append(pair(seed, a, b))
            print(f"{family:12s} mlxd   SSD  {fmt(a, b)}", flush=True)
        out["mlxd"]["cache_b"] = cache_figures(await stats(talk.base))
    finally:
        srv.stop()

    # mlx_lm.server (its default prompt cache): the RAM conversations; a failure is recorded
    # (on MLX's CPU backend its bfloat16 mixture-of-experts layers raise in GatherMM)
    port = free_port()
    srv = mlx_lm_server(model, port, logs / f"{family}-mlx_lm.log")
    talk = Talk(f"http://127.0.0.1:{port}", model, args, bias)
    try:
        await srv.wait()
        await talk.warm_up(warm[0])
        for seed in ram_seeds:
            a = await talk.first(convo[seed])
            b = await talk.second(convo[seed], a["text"])
            out["mlx_lm"]["ram"].append(pair(seed, a, b))
            print(f"{family:12s} mlx_lm RAM  {fmt(a, b)}", flush=True)
    except (RuntimeError, aiohttp.ClientError) as e:
        out["mlx_lm"]["error"] = repr(e)
        print(f"{family:12s} mlx_lm failed: {type(e).__name__} {getattr(e, 'status', e)} "
              f"(see {logs / f'{family}-mlx_lm.log'})", flush=True)
    finally:
        srv.stop()
    for target, tier in (("mlxd", "ram"), ("mlxd", "ssd"), ("mlx_lm", "ram")):
        out[target][tier + "_summary"] = summary(out[target][tier])
    return out


def pair(seed: int, a: dict, b: dict) -> dict:
    return {"seed": seed, "ratio": b["ttft_s"] / a["ttft_s"],
            "first": {k: v for k, v in a.items() if k != "text"} | {"answer": a["text"]},
            "second": {k: v for k, v in b.items() if k != "text"}}


def fmt(a: dict, b: dict) -> str:
    return (f"first {a['ttft_s'] * 1e3:8.1f} ms ({a['prompt_tokens']} tok, cached "
            f"{a['cached_tokens']}), second {b['ttft_s'] * 1e3:8.1f} ms ({b['prompt_tokens']} tok, "
            f"cached {b['cached_tokens']}): {b['ttft_s'] / a['ttft_s']:.3f}x")


def summary(rows: list[dict]) -> dict | None:
    if not rows:
        return None

    def spread(xs: list[float]) -> dict:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return {"ratio": spread([r["ratio"] for r in rows]),
            "first_ttft_s": spread([r["first"]["ttft_s"] for r in rows]),
            "second_ttft_s": spread([r["second"]["ttft_s"] for r in rows]),
            "prompt_tokens": [r["second"]["prompt_tokens"] for r in rows],
            "cached_tokens": [r["second"]["cached_tokens"] for r in rows]}


# ---------------------------------------------------------------- report

def table(results: list[dict]) -> str:
    def span(x: dict, scale: float = 1.0, f: str = ".3f") -> str:
        return (f"{x['median'] * scale:{f}} ({x['min'] * scale:{f}}-"
                f"{x['max'] * scale:{f}})")

    def ratio(s: dict | None) -> str:
        return "failed" if s is None else span(s["ratio"])

    def ms(s: dict | None, key: str) -> str:
        return "-" if s is None else span(s[key], 1e3, ".0f")

    def prefilled(s: dict | None) -> str:
        if s is None:
            return "-"
        n = [p - (c or 0) for p, c in zip(s["prompt_tokens"], s["cached_tokens"], strict=True)]
        return f"{min(n)}-{max(n)}" if min(n) != max(n) else str(n[0])
    lines = ["| family | mlxd RAM ratio | mlxd SSD ratio (restart) | mlx_lm.server RAM ratio | "
             "first turn ms: mlxd; mlx_lm.server | second turn ms: mlxd RAM; SSD; "
             "mlx_lm.server | second turn's tokens not cached: mlxd RAM; SSD; mlx_lm.server |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        m, s, ref = (res["mlxd"]["ram_summary"], res["mlxd"]["ssd_summary"],
                     res["mlx_lm"]["ram_summary"])
        lines.append(f"| {res['family']} | {ratio(m)} | {ratio(s)} | {ratio(ref)} | "
                     f"{ms(m, 'first_ttft_s')}; {ms(ref, 'first_ttft_s')} | "
                     f"{ms(m, 'second_ttft_s')}; {ms(s, 'second_ttft_s')}; "
                     f"{ms(ref, 'second_ttft_s')} | "
                     f"{prefilled(m)}; {prefilled(s)}; {prefilled(ref)} |")
    return "\n".join(lines)


def mlxd_commit() -> str:
    """The commit of the mlxd the servers run (`python -m mlxd.cli.main` imports the
    installed one, which need not be this checkout), "-dirty" with changed tracked files."""
    import mlxd
    repo = Path(mlxd.__file__).resolve().parents[1]

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True,
                              text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (
        "-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine_label() -> str:
    import mlx.core as mx
    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"


async def main_async(args: argparse.Namespace) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="mlxd-bench-families-"))
    print(f"work directory (servers' logs in logs/): {work}", flush=True)
    results = []
    for family in args.families:
        model = str(write_model(family, args.shape, args.model_dtype))
        results.append(await run_family(family, model, args, work))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--families", default=None,
                    help="comma-separated (default: all six for tiny, gemma3_text,qwen3_next "
                         "for 1b)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=4000, help="the first turn's prompt")
    ap.add_argument("--next-tokens", type=int, default=30, help="the second user message")
    ap.add_argument("--answer-tokens", type=int, default=16, help="each turn's max_tokens")
    ap.add_argument("--warm-up-tokens", type=int, default=None,
                    help="the first turn of the conversation each server gets first (default: "
                         "1024 tiny, the prompt's length 1b)")
    ap.add_argument("--free-answers", action="store_true",
                    help="no logit_bias: answers any tokens (which seldom encode back)")
    ap.add_argument("--model-dtype", default=None,
                    help="random weights' dtype (default: float32 tiny, bfloat16 1b)")
    ap.add_argument("--machine", default=None, help="in the result's name (default: cpu/gpu)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/cache_families-<shape>-<machine>.json")
    args = ap.parse_args()
    args.families = (args.families.split(",") if args.families
                     else DEFAULT_FAMILIES[args.shape])
    for f in args.families:
        if f not in SHAPES[args.shape]:
            ap.error(f"--shape {args.shape} has no {f} (it has {', '.join(SHAPES[args.shape])})")
    args.warm_up_tokens = args.warm_up_tokens or (1024 if args.shape == "tiny"
                                                  else args.prompt_tokens)
    args.model_dtype = args.model_dtype or ("float32" if args.shape == "tiny" else "bfloat16")
    machine = args.machine or machine_label()
    import mlxd
    commit, mlxd_path = mlxd_commit(), str(Path(mlxd.__file__).resolve().parents[1])
    print(f"mlxd {commit} from {mlxd_path}", flush=True)
    t0 = time.time()
    results = asyncio.run(main_async(args))
    from importlib.metadata import version
    out = args.out or (Path(__file__).resolve().parent / "results"
                       / f"cache_families-{args.shape}-{machine}.json")
    data = {"shape": args.shape, "machine": machine, "platform": platform.platform(),
            "mlxd_commit": commit, "mlxd_path": mlxd_path,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "mlx_lm": version("mlx-lm"), "mlx": version("mlx"), "reps": args.reps,
            "prompt_tokens": args.prompt_tokens, "next_tokens": args.next_tokens,
            "answer_tokens": args.answer_tokens, "model_dtype": args.model_dtype,
            "warm_up_tokens": args.warm_up_tokens, "free_answers": args.free_answers,
            "seconds": time.time() - t0, "families": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print()
    print(f"second-turn TTFT / first-turn TTFT, median (min-max) of {args.reps}; "
          f"{args.shape} models, {machine}, mlxd {commit}; goals <= 0.1 RAM, <= 0.2 SSD")
    print(table(results))
    print(f"\nwritten {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
