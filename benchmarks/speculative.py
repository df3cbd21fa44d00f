"""Speculative decoding against plain decoding, side by side in one run, through the engine's
own MLX-thread code (`engine/batch/runner.py` with and without `engine/speculative/step.py`; no
sockets, so that only decoding is compared).

1. One stream, greedy, a "repeat this code with one change" prompt (about 400 tokens):
   plain steps; speculation as mlxd runs it (`auto`: drafting only while measured to pay);
   and speculation forced on every step (`forced`: what drafting costs or gains by itself).
   Decode rate from the first token to the last (wall clock, and per second of this
   process's CPU time, which other load on the machine disturbs less), acceptance and tokens
   per speculative step.
2. N concurrent streams (default 8): aggregate decode tok/s (first token to last) with
   speculation (`auto`, and `forced` when asked for in `--modes`) against plain: every row
   drafts on its own and one verify pass takes all rows' drafts.

Drafting is prompt lookup unless `--draft-model` names a model (then that model drafts).
Rounds alternate plain and speculative; the median round is kept.

    python benchmarks/speculative.py                                  # CPU, the default model
    python benchmarks/speculative.py --model DIR --draft-model DIR2   # e.g. the H200
    python benchmarks/speculative.py --shape 1b --draft-shape 1b      # random models (GPU)
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = {  # as benchmarks/throughput.py: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 128, 512),
    "small": (512, 8, 8, 4, 1536, 4096),
    "1b": (2048, 16, 32, 8, 8192, 32000),
}

CODE = '''import csv
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    city: str
    age: int
    score: float


def parse_line(line: str) -> Row:
    name, city, age, score = line.strip().split(",")
    return Row(name=name, city=city, age=int(age), score=float(score))


def load(path: str) -> list[Row]:
    rows = []
    with open(path, newline="") as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            rows.append(parse_line(line))
    return rows


def average_score(rows: list[Row]) -> float:
    if not rows:
        return 0.0
    return sum(r.score for r in rows) / len(rows)


def by_city(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.city, []).append(r)
    return out


def main() -> None:
    rows = load("people.csv")
    print("average score:", average_score(rows))
    for city, people in sorted(by_city(rows).items()):
        print(city, len(people), average_score(people))


if __name__ == "__main__":
    main()
'''
NAMES = ["parse_row", "read_line", "parse_record", "split_line", "to_row", "parse_entry",
         "decode_line", "line_to_row"]


def prompt_messages(new_name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": (
        f"Here is a Python file:\n\n```python\n{CODE}```\n\nRepeat the whole file exactly, "
        f"with one change: rename the function `parse_line` to `{new_name}` everywhere.")}]


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from mlxd.engine.load.loader import load_model
    cache = Path(args.cache_dir)
    model_dir, draft_dir = args.model, args.draft_model
    if args.shape:
        model_dir = str(random_model(cache, args.shape, args.model_dtype, seed=0))
    if args.draft_shape:
        draft_dir = str(random_model(cache, args.draft_shape, args.model_dtype, seed=1))
    model, tok, _ = load_model(model_dir, cache, args.dtype)
    draft = load_model(draft_dir, cache, args.dtype)[0] if draft_dir else None
    return model, tok, draft


def random_model(cache: Path, shape: str, dtype: str, seed: int) -> Path:
    from support.random_model import write_random_model
    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    out = cache / f"random-{shape}-{dtype}-{seed}"
    if not (out / "config.json").exists():
        write_random_model(out, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           intermediate=inter, vocab=vocab, context=4096, dtype=dtype,
                           seed=seed)
    return out


def run(model: Any, prompts: list[list[int]], max_tokens: int, spec: Any,
        prefill_step: int) -> dict[str, Any]:
    """Decode `prompts` together through a Runner; wall times of every token."""
    import mlx.core as mx
    from mlx_lm.sample_utils import greedy_sampler

    from mlxd.engine.batch.messages import AddRequest, StepTokens
    from mlxd.engine.batch.runner import Runner
    q: queue.Queue[Any] = queue.Queue()
    # a RAM prefix cache as mlxd has by default: prompts sharing the code prefill it once
    r = Runner(model, [], batch_size=max(8, len(prompts)), prefill_step=prefill_step,
               outbox=q, stream=mx.new_stream(mx.default_device()), speculator=spec,
               cache_bytes=1 << 30)
    for i, p in enumerate(prompts):
        r.inbox.put(AddRequest(f"r{i}", p, max_tokens, greedy_sampler, []))
    t0 = time.perf_counter()
    r.take_commands()
    times: dict[str, list[float]] = {}
    cpu_first = 0.0
    tokens: dict[str, list[int]] = {}
    done = 0
    while done < len(prompts):
        r.step()
        now = time.perf_counter()
        while not q.empty():
            item = q.get()
            if isinstance(item, StepTokens):
                for rid, tok, fin in item.rows:
                    if not times:
                        cpu_first = time.process_time()
                    times.setdefault(rid, []).append(now)
                    tokens.setdefault(rid, []).append(tok)
                    done += fin is not None
    end, cpu_end = time.perf_counter(), time.process_time()
    first = min(t[0] for t in times.values())
    n = sum(len(t) for t in tokens.values())
    out: dict[str, Any] = {
        "tokens": n, "seconds": end - t0,
        "decode_tok_s": (n - len(prompts)) / (end - first) if end > first else 0.0,
        "total_tok_s": n / (end - t0), "texts": tokens,
        # per second of this process's CPU time (all its threads): robust to other load
        "decode_tok_cpu_s": (n - len(prompts)) / (cpu_end - cpu_first)
        if cpu_end > cpu_first else 0.0}
    if spec is not None:
        c = spec.counters
        out.update(spec_steps=c.steps, drafted=c.drafted, accepted=c.accepted,
                   spec_tokens=c.tokens, skipped=c.skipped, batched=c.batched)
    return out


def forward_cost(model: Any, prompt: list[int], n: int, reps: int = 5) -> float:
    """Seconds of the fastest of `reps` forward passes of `n` tokens after the prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-n]]), cache=cache)
    mx.eval([c.state for c in cache])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(model(mx.array([prompt[-n:]]), cache=cache))
        best = min(best, time.perf_counter() - t0)
        trim_prompt_cache(cache, n)
    return best


def speculator(args: argparse.Namespace, draft: Any, forced: bool) -> Any:
    from mlxd.engine.speculative.step import Speculator
    spec = Speculator(args.num_draft_tokens, draft, args.prefill_step)
    spec.policy.judge = spec.rows_policy.judge = not forced
    return spec


def median_round(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    rounds = sorted(rounds, key=lambda x: x[key])
    return rounds[len(rounds) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default' or a model directory")
    ap.add_argument("--draft-model", default=None, help="a draft model (else prompt lookup)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="a random model of this shape instead of --model")
    ap.add_argument("--draft-shape", choices=sorted(SHAPES), default=None,
                    help="a second random model (another seed) as the draft")
    ap.add_argument("--draft-self", action="store_true",
                    help="the model drafts for itself (every draft accepted: an upper bound)")
    ap.add_argument("--model-dtype", default="float32", help="dtype of random weights")
    ap.add_argument("--dtype", default="auto", help="activation dtype (mlxd --dtype)")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per single stream")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=48, help="tokens per concurrent stream")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--modes", default="auto,forced", help="speculative modes for one stream")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "mlxd-spec-cache"))
    ap.add_argument("--out", type=Path, default=None, help="write FILE.md and FILE.json")
    args = ap.parse_args()

    import mlx.core as mx
    model, tok, draft = load(args)
    if args.draft_self:
        draft = model
    drafter = ("prompt lookup" if draft is None else
               "the model itself" if draft is model else args.draft_model or args.draft_shape)
    prompt = tok.apply_chat_template(prompt_messages(NAMES[0]), add_generation_prompt=True)
    print(f"model {args.shape or args.model}, drafts by {drafter}, prompt {len(prompt)} tokens, "
          f"{args.max_tokens} tokens; device {mx.default_device()}", flush=True)

    # warm-up: kernels compiled, buffers allocated, for both paths
    run(model, [prompt[:64]], 8, None, args.prefill_step)
    run(model, [prompt[:64]], 8, speculator(args, draft, True), args.prefill_step)

    k = args.num_draft_tokens
    one, many_tokens = forward_cost(model, prompt, 1), forward_cost(model, prompt, k + 1)
    cost = (f"a forward pass of {k + 1} tokens (what verifies {k} drafts) takes "
            f"{many_tokens * 1e3:.1f} ms, {many_tokens / one:.2f}x one token's {one * 1e3:.1f} ms")
    print(" ", cost, flush=True)

    modes = [m for m in args.modes.split(",") if m]
    single: dict[str, list[dict[str, Any]]] = {"plain": [], **{m: [] for m in modes}}
    for _ in range(args.rounds):
        single["plain"].append(run(model, [prompt], args.max_tokens, None, args.prefill_step))
        print(f"  plain: {single['plain'][-1]['decode_tok_s']:.2f} tok/s", flush=True)
        for m in modes:
            res = run(model, [prompt], args.max_tokens, speculator(args, draft, m == "forced"),
                      args.prefill_step)
            single[m].append(res)
            print(f"  {m}: {res['decode_tok_s']:.2f} tok/s, {res['spec_steps']} speculative "
                  f"steps, {res['accepted']}/{res['drafted']} accepted", flush=True)
    rows = []
    base = median_round(single["plain"], "decode_tok_s")
    for m, rounds in single.items():
        res = median_round(rounds, "decode_tok_s")
        same = res["texts"] == base["texts"]
        rows.append({"case": "1 stream", "mode": m, "tok_s": round(res["decode_tok_s"], 2),
                     "ratio": round(res["decode_tok_s"] / base["decode_tok_s"], 3),
                     "cpu_ratio": round(res["decode_tok_cpu_s"] / base["decode_tok_cpu_s"], 3),
                     "spec_steps": res.get("spec_steps", 0),
                     "acceptance": round(res["accepted"] / res["drafted"], 3)
                     if res.get("drafted") else None,
                     "tokens_per_step": round(res["spec_tokens"] / res["spec_steps"], 2)
                     if res.get("spec_steps") else None,
                     "same_text_as_plain": same})

    if args.streams > 1:
        prompts = [tok.apply_chat_template(prompt_messages(NAMES[i % len(NAMES)]),
                                           add_generation_prompt=True)
                   for i in range(args.streams)]
        many: dict[str, list[dict[str, Any]]] = {"plain": [], **{m: [] for m in modes}}
        for _ in range(args.rounds):
            for m in many:
                spec = None if m == "plain" else speculator(args, draft, m == "forced")
                res = run(model, prompts, args.stream_tokens, spec, args.prefill_step)
                many[m].append(res)
                print(f"  {args.streams} streams {m}: {res['decode_tok_s']:.2f} tok/s decoding "
                      f"({res['total_tok_s']:.2f} with the prefill), "
                      f"{res.get('spec_steps', 0)} speculative steps "
                      f"({res.get('batched', 0)} over several rows)", flush=True)
        base_many = median_round(many["plain"], "decode_tok_s")
        for m, rounds in many.items():
            res = median_round(rounds, "decode_tok_s")
            rows.append({"case": f"{args.streams} streams", "mode": m,
                         "tok_s": round(res["decode_tok_s"], 2),
                         "ratio": round(res["decode_tok_s"] / base_many["decode_tok_s"], 3),
                         "cpu_ratio": round(res["decode_tok_cpu_s"]
                                            / base_many["decode_tok_cpu_s"], 3),
                         "spec_steps": res.get("spec_steps", 0),
                         "acceptance": round(res["accepted"] / res["drafted"], 3)
                         if res.get("drafted") else None,
                         "tokens_per_step": round(res["spec_tokens"] / res["spec_steps"], 2)
                         if res.get("spec_steps") else None,
                         "same_text_as_plain": res["texts"] == base_many["texts"]})

    lines = [f"Speculative decoding, {args.shape or args.model}, drafts by {drafter}, "
             f"--num-draft-tokens {args.num_draft_tokens}, prompt {len(prompt)} tokens, "
             f"{platform.machine()} {mx.default_device()}, mlx {version('mlx')}, "
             f"mlx-lm {version('mlx-lm')}, {args.rounds} round(s), median kept; {cost}",
             "", "| case | mode | tok/s | ratio to plain | ratio per CPU-second | "
             "speculative steps | acceptance | tokens per step | same text as plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance"] is None else r["acceptance"]
        lines.append(f"| {r['case']} | {r['mode']} | {r['tok_s']} | {r['ratio']} | "
                     f"{r['cpu_ratio']} | {r['spec_steps']} | {acc} | "
                     f"{r['tokens_per_step'] or '-'} | {r['same_text_as_plain']} |")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(
            {"args": {a: str(v) for a, v in vars(args).items()}, "rows": rows,
             "forward_s": {"1": one, str(k + 1): many_tokens},
             "median_single_plain_tok_s": statistics.median(
                 r["decode_tok_s"] for r in single["plain"])}, indent=1))


if __name__ == "__main__":
    main()
