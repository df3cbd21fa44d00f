"""Issue 34, item 1: forced tool calls and json_schema answers at small budgets are valid JSON.

200 random JSON schemas (tests/support/json_schemas.py: objects, nested arrays, enums, numbers,
strings with and without length bounds) x budgets from each grammar's shortest completion + 8
up to 128 tokens, through a real daemon: OpenAI (tool_choice required, response_format
json_schema) and Anthropic (tool_choice any, output_config.format), sampled at temperature 1
(a model that runs on). Every call's arguments and every answer must parse and validate
against its schema; the finish reasons are counted.

    python benchmarks/budget_closing.py                      # a random-weight model
    python benchmarks/budget_closing.py --model PATH --budgets 1   # e.g. the default model
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import anthropic
import jsonschema
import openai

from support.harness import Daemon
from support.json_schemas import random_schema

ASK = [{"role": "user", "content": "Fill in every field with realistic values."}]
ROUTES = ("openai-call", "openai-format", "anthropic-call", "anthropic-format")


def shortest(tc: Any, grammar: str) -> int:
    from mlxd.engine.grammar.processor import GrammarProcessor
    guard = GrammarProcessor(tc, grammar, max_tokens=10**6).budget
    assert guard is not None and guard.shortest is not None
    return guard.shortest


def budgets(lo: int, n: int, rng: random.Random, top_only: bool = False) -> list[int]:
    """`n` budgets from lo (the shortest + 8) up to 128: lo, 128, and random ones between
    (`top_only`: 128 alone)."""
    if lo > 128:
        return []
    if top_only:
        return [128]
    picks = [lo, 128][:n] + [rng.randint(lo, 128) for _ in range(max(0, n - 2))]
    return sorted(set(picks))


def one(base: str, model: str, route: str, schema: dict, budget: int, seed: int) -> dict:
    oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
    got: Any
    if route == "openai-call":
        r = oai.chat.completions.create(
            model=model, messages=ASK, max_tokens=budget, temperature=1.0, seed=seed,
            tools=[{"type": "function", "function": {"name": "fill", "parameters": schema}}],
            tool_choice="required")
        (call,) = r.choices[0].message.tool_calls or []
        got, finish = json.loads(call.function.arguments), r.choices[0].finish_reason
    elif route == "openai-format":
        r = oai.chat.completions.create(
            model=model, messages=ASK, max_tokens=budget, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema}})
        got, finish = json.loads(r.choices[0].message.content or ""), r.choices[0].finish_reason
    elif route == "anthropic-call":
        m = ant.messages.create(model=model, max_tokens=budget, messages=ASK,
                                extra_body={"temperature": 1.0, "seed": seed},
                                tools=[{"name": "fill", "input_schema": schema}],
                                tool_choice={"type": "any"})
        (block,) = m.content
        got, finish = block.input, m.stop_reason
    else:
        m = ant.messages.create(model=model, max_tokens=budget, messages=ASK,
                                extra_body={"temperature": 1.0, "seed": seed, "output_config": {
                                    "format": {"type": "json_schema", "schema": schema}}})
        got, finish = json.loads(m.content[0].text), m.stop_reason
    jsonschema.validate(got, schema)
    return {"finish": finish}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model directory (default: a random-weight tiny model)")
    ap.add_argument("--schemas", type=int, default=200)
    ap.add_argument("--budgets", type=int, default=3, help="budgets per schema and route")
    ap.add_argument("--top-only", action="store_true", help="only the budget of 128 tokens")
    ap.add_argument("--rotate", action="store_true",
                    help="each schema through one route only, in turn (a slow model's run)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from mlxd.engine.grammar.processor import TokenizerCache
    from mlxd.proxy.core.constraints import Tool, call_grammar, schema_grammar
    tmp = Path(tempfile.mkdtemp(prefix="budget-closing-"))
    if args.model is None:
        from support.random_model import write_random_model
        model_dir = write_random_model(tmp / "tiny-llama", context=512)
    else:
        model_dir = Path(args.model)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    n_vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    tc = TokenizerCache(hf, n_vocab, [])
    rng = random.Random(0)
    jobs: list[tuple[str, dict, int, int]] = []
    for s in range(args.schemas):
        schema = random_schema(s)
        lo = {"call": shortest(tc, call_grammar([Tool("fill", "", schema)])) + 8,
              "format": shortest(tc, schema_grammar(schema, "schema")) + 8}
        routes = ROUTES[s % 4:s % 4 + 1] if args.rotate else ROUTES
        for route in routes:
            for b in budgets(lo[route.split("-")[1]], args.budgets, rng, args.top_only):
                jobs.append((route, schema, b, len(jobs)))
    d = Daemon(str(model_dir), "--batch", str(max(8, args.concurrency)))
    d.start()
    model = json.loads(__import__("urllib.request").request.urlopen(
        d.url + "/v1/models").read())["data"][0]["id"]
    results: list[dict] = []
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = [(j, pool.submit(one, d.url, model, *j)) for j in jobs]
            for (route, _, b, i), f in futures:
                if len(results) % 50 == 0:
                    print(f"{len(results)}/{len(jobs)} in {time.monotonic() - t0:.0f} s",
                          file=sys.stderr, flush=True)
                try:
                    results.append({"route": route, "budget": b, **f.result()})
                except Exception as e:  # noqa: BLE001 - any failure is the figure measured
                    results.append({"route": route, "budget": b, "error": repr(e)[:300],
                                    "job": i})
    finally:
        d.stop()
        d.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)  # the random model written there
    wall = time.monotonic() - t0
    lines = [f"model: {model_dir.name}  schemas: {args.schemas}  requests: {len(results)}  "
             f"wall: {wall:.0f} s"]
    for route in ROUTES:
        rs = [r for r in results if r["route"] == route]
        ok = [r for r in rs if "error" not in r]
        finishes = Counter(r["finish"] for r in ok)
        lines.append(f"{route:17} {len(ok)}/{len(rs)} valid "
                     f"({100 * len(ok) / max(1, len(rs)):.1f} %)  finish: {dict(finishes)}")
    errors = [r for r in results if "error" in r]
    lines += [f"  {e['route']} budget {e['budget']} job {e['job']}: {e['error']}"
              for e in errors[:10]]
    print("\n".join(lines))
    if args.out:
        args.out.write_text(json.dumps({"summary": lines, "results": results}, indent=1))


if __name__ == "__main__":
    main()
