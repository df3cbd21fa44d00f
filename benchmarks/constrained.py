"""Decode tokens/s with constrained decoding (a JSON schema through llguidance) against the
same requests unconstrained, on one `mlxd serve --isolate`, at batch 1 and 8, interleaved
repetitions. The schema asks for a long array of integers so that both kinds decode the full
`--max-tokens` (a model's EOS ends either early only by chance).

    python benchmarks/constrained.py --shape tiny --reps 3
    python benchmarks/constrained.py --shape 1b --model-dtype bfloat16 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput

SCHEMA = {"type": "object", "required": ["values"], "additionalProperties": False,
          "properties": {"values": {"type": "array", "minItems": 4096,
                                    "items": {"type": "integer", "minimum": 0,
                                              "maximum": 999}}}}


async def round_(base: str, model: str, n: int, max_tokens: int, constrained: bool,
                 rep: int) -> float:
    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"rep {rep} list {i}: numbers"}]}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "v", "schema": SCHEMA}}
        async with session.post(base + "/v1/chat/completions", json=body) as r:
            data = await r.json()
            assert r.status == 200, data
            return data["usage"]["completion_tokens"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(s, i) for i in range(n)))
        return sum(tokens) / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> dict:
    model_dir = throughput.model_for(args)
    levels = [int(x) for x in args.concurrency.split(",")]
    server, base, name = throughput.start_target("mlxd-isolate", model_dir, max(levels),
                                                 args.dtype, ["--prompt-cache", "0",
                                                              "--ssd-cache", "off"])
    results: dict = {}
    try:
        await server.wait()
        for n in levels:  # warm-up: compile every shape, build llguidance's tokenizer
            for c in (False, True):
                await round_(base, name, n, 16, c, -1)
        for rep in range(args.reps):
            for n in levels:
                for c in ((False, True) if rep % 2 == 0 else (True, False)):
                    tok_s = await round_(base, name, n, args.max_tokens, c, rep)
                    results.setdefault(f"{n}/{'json' if c else 'free'}", []).append(tok_s)
                    print(f"rep {rep} batch {n} {'json' if c else 'free'}: {tok_s:.1f} tok/s",
                          flush=True)
    finally:
        server.stop()
    return results


def report(results: dict, args: argparse.Namespace) -> str:
    import mlx.core as mx
    lines = [f"# Constrained decoding cost: {args.model or args.shape} ({args.model_dtype}), "
             f"{args.max_tokens} tokens per request, {args.reps} interleaved reps", "",
             f"{time.strftime('%Y-%m-%d')}, {platform.node()}, mlx {version('mlx')}, "
             f"device {mx.default_device()}", "",
             "| batch | free tok/s (median) | JSON-schema tok/s (median) | ratio |",
             "|---|---|---|---|"]
    for n in args.concurrency.split(","):
        free = statistics.median(results[f"{n}/free"])
        con = statistics.median(results[f"{n}/json"])
        lines.append(f"| {n} | {free:.1f} | {con:.1f} | {con / free:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default="tiny", choices=sorted(throughput.SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    throughput.save(args.out, report(results, args), results)


if __name__ == "__main__":
    main()
