"""Decode tokens/s with constrained decoding (a JSON schema through llguidance) against the
same requests unconstrained, on one `mlxd serve --isolate`, at each `--concurrency` (8 and 32
by default), interleaved repetitions: each constrained round beside a free one, the ratio taken
per pair. Each schema (`--schemas`) asks for a long array (of integers, or of objects of one
shape) so that both kinds decode the full `--max-tokens` (a model's EOS ends either early only
by chance).

`--base-tree DIR` measures a second checkout of this repository in the same run (its `mlxd`
imported ahead of the installed one), side by side: before vs after a change, e.g.

    git worktree add /tmp/grammar-base <commit>
    python benchmarks/constrained.py --shape tiny --reps 3 --base-tree /tmp/grammar-base
    git worktree remove /tmp/grammar-base
    python benchmarks/constrained.py --shape 1b --model-dtype bfloat16 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput

SCHEMA = {"type": "object", "required": ["values"], "additionalProperties": False,
          "properties": {"values": {"type": "array", "minItems": 4096,
                                    "items": {"type": "integer", "minimum": 0,
                                              "maximum": 999}}}}


def _many(item: dict) -> dict:
    """A long array of `item` objects: the grammar keeps the row decoding for `--max-tokens`
    (as the integers do), passing through the object's structure again and again."""
    return {"type": "object", "required": ["items"], "additionalProperties": False,
            "properties": {"items": {"type": "array", "minItems": 4096, "items": item}}}


def _object(properties: dict) -> dict:
    return {"type": "object", "required": sorted(properties), "additionalProperties": False,
            "properties": properties}


_WORDS = ["red", "green", "blue", "amber", "violet", "black", "white", "silver", "teal",
          "coral", "olive", "navy"]
# The three shapes (each repeated by `_many`), and the long integer array used before.
SCHEMAS: dict[str, dict] = {
    "ints": SCHEMA,
    "flat": _many(_object({"name": {"type": "string", "maxLength": 24},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "active": {"type": "boolean"}})),
    "mixed": _many(_object({"title": {"type": "string", "maxLength": 32},
                            "count": {"type": "integer"},
                            "tags": {"type": "array", "maxItems": 4,
                                     "items": {"type": "string", "maxLength": 12}}})),
    "enum": _many(_object({f"field_{i}": {"enum": _WORDS[i:] + _WORDS[:i]}
                           for i in range(6)}
                          | {"status": {"enum": ["open", "closed", "pending", "merged"]}})),
}


async def round_(base: str, model: str, n: int, max_tokens: int, constrained: bool,
                 rep: int, schema: str = "ints") -> float:
    async def one(session: aiohttp.ClientSession, i: int) -> int:
        kind = "json" if constrained else "free"  # in the prompt: no hit on the other kind's
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user",
                              "content": f"rep {rep} {schema} {kind} list {i}: items"}]}
        if constrained:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "v", "schema": SCHEMAS[schema]}}
        async with session.post(base + "/v1/chat/completions", json=body) as r:
            data = await r.json()
            assert r.status == 200, data
            return data["usage"]["completion_tokens"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(s, i) for i in range(n)))
        return sum(tokens) / (time.perf_counter() - t0)


def tree_view(tree: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import mlxd` load the checkout at `tree`."""
    view = Path(tempfile.mkdtemp(prefix="mlxd-tree-"))
    pkg = view / "mlxd"
    pkg.mkdir()
    for f in ("__init__.py", "__main__.py"):
        (pkg / f).symlink_to(tree.resolve() / "_pkg" / f)
    for name in ("daemon", "proxy", "engine", "storage_worker", "protocol", "deploy"):
        if (tree / name).is_dir():
            (pkg / name).symlink_to(tree.resolve() / name)
    return view


def start(tree: Path | None, model_dir: str, batch: int, dtype: str, env: dict | None = None
          ) -> tuple[throughput.Server, str, str, Path | None]:
    view = tree_view(tree) if tree is not None else None
    saved = os.environ.get("PYTHONPATH")
    if view is not None:  # the server and the engines it spawns import mlxd from `tree`
        os.environ["PYTHONPATH"] = os.pathsep.join([str(view), *filter(None, [saved])])
    try:
        server, base, name = throughput.start_target(
            "mlxd-isolate", model_dir, batch, dtype, ["--prompt-cache", "0", "--ssd-cache", "off"],
            env=env)
    finally:
        if view is not None:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return server, base, name, view


async def main_async(args: argparse.Namespace) -> dict:
    model_dir = throughput.model_for(args)
    levels = [int(x) for x in args.concurrency.split(",")]
    schemas = args.schemas.split(",")
    trees: dict[str, Path | None] = {"after": args.tree}
    if args.base_tree is not None:
        trees["before"] = args.base_tree
    envs: dict[str, dict] = {}
    if args.before_env:  # "before": this tree with these environment variables
        trees["before"] = args.tree
        envs["before"] = dict(kv.split("=", 1) for kv in args.before_env.split(";"))
    servers = {label: start(tree, model_dir, max(levels), args.dtype, envs.get(label))
               for label, tree in trees.items()}
    results: dict = {}
    try:
        for server, base, name, _ in servers.values():
            await server.wait()
            for n in levels:  # warm-up: compile every shape, build llguidance's tokenizer
                for schema in schemas:
                    for c in (False, True):
                        await round_(base, name, n, 16, c, -1, schema)
        for rep in range(args.reps):
            for label, (_, base, name, _) in servers.items():
                for n in levels:
                    for schema in schemas:  # a free round beside each constrained one: pairs
                        for c in ((False, True) if rep % 2 == 0 else (True, False)):
                            tok_s = await round_(base, name, n, args.max_tokens, c, rep, schema)
                            kind = "json" if c else "free"
                            results.setdefault(f"{label}/{key(schema, n)}/{kind}",
                                               []).append(tok_s)
                            print(f"rep {rep} {label} {schema} batch {n} {kind}: "
                                  f"{tok_s:.1f} tok/s", flush=True)
    finally:
        for server, _, _, view in servers.values():
            server.stop()
            if view is not None:
                shutil.rmtree(view, ignore_errors=True)
    return results


def key(schema: str, n: int | str) -> str:
    """Results of the integer array keep their earlier keys ("after/8/json")."""
    return str(n) if schema == "ints" else f"{schema}/{n}"


def report(results: dict, args: argparse.Namespace) -> str:
    import mlx.core as mx
    levels = args.concurrency.split(",")
    schemas = args.schemas.split(",")
    first = key(schemas[0], levels[0])
    labels = [lb for lb in ("before", "after") if f"{lb}/{first}/free" in results]
    lines = [f"# Constrained decoding cost: {args.model or args.shape} ({args.model_dtype}), "
             f"{args.max_tokens} tokens per request, {args.reps} interleaved reps", "",
             f"{time.strftime('%Y-%m-%d')}, {platform.node()}, mlx {version('mlx')}, "
             f"device {mx.default_device()}"
             + (f"; before: the tree at {args.base_tree}" if args.base_tree else "")
             + (f"; before: this tree with {args.before_env}" if args.before_env else "")
             + (f"; after: the tree at {args.tree}" if args.tree else "")
             + ". Tok/s: medians; ratios: median over reps of JSON / free of the same rep.", "",
             "| schema | batch | " + " | ".join(
                 f"{lb}: free tok/s | {lb}: JSON tok/s | {lb}: ratio (range)"
                 for lb in labels) + " |",
             "|---|---|" + "---|---|---|" * len(labels)]
    for schema in schemas:
        for n in levels:
            cells = []
            for lb in labels:
                free = results[f"{lb}/{key(schema, n)}/free"]
                con = results[f"{lb}/{key(schema, n)}/json"]
                ratios = [c / f for c, f in zip(con, free, strict=True)]
                cells.append(f"{statistics.median(free):.1f} | {statistics.median(con):.1f} | "
                             f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-"
                             f"{max(ratios):.3f})")
            lines.append(f"| {schema} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- --engine: the MLX thread alone

class SyncGrammarProcessor:
    """The per-row processor used before the overlap (kept here only, as the reference): reads
    its row's previous token, computes its mask and unpacks it on the host, row after row."""

    def __init__(self, tokenizers: Any, grammar: str) -> None:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        self._allocate, self._fill = allocate_token_bitmask, fill_next_token_bitmask
        self.matcher = llguidance.LLMatcher(tokenizers.get(), grammar)
        self._calls = 0

    def __call__(self, context: Any, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np
        if self._calls:
            self.matcher.consume_token(context[-1].item())
        self._calls += 1
        vocab = logits.shape[-1]
        bits = self._allocate(1, vocab)
        if self.matcher.is_error():
            return logits
        self._fill(self.matcher, bits, 0)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]
        return mx.where(mx.array(allowed.astype(np.bool_)), logits, float("-inf"))


def engine_rounds(args: argparse.Namespace) -> dict:
    """Tokens/s of one in-process Runner (no proxy, no ZeroMQ): free rows, rows with the
    previous per-row processor ("before"), rows with the overlapped one ("after")."""
    import json

    from llguidance import LLMatcher
    from mlx_lm.sample_utils import greedy_sampler

    from mlxd.daemon.paths import default_cache_dir
    from mlxd.engine.batch.messages import AddRequest, StepTokens
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.grammar.processor import GrammarProcessor, TokenizerCache
    from mlxd.engine.load.loader import load_model, resolve_model_dir
    spec = throughput.model_for(args)
    cache = default_cache_dir()
    model, tok, _ = load_model(spec, cache, args.dtype)
    config = json.loads((resolve_model_dir(spec, cache) / "config.json").read_text())
    tokenizers = TokenizerCache(tok._tokenizer, int(config.get("vocab_size") or len(tok)),
                                sorted(tok.eos_token_ids))
    grammars = {schema: LLMatcher.grammar_from_json_schema(
        SCHEMAS[schema], defaults={"whitespace_flexible": False})
        for schema in args.schemas.split(",")}
    makers: dict[str, Any] = {"free": None, "before": SyncGrammarProcessor,
                              "after": GrammarProcessor}
    if args.no_before:
        del makers["before"]

    def one(n: int, kind: str, max_tokens: int, rep: int, grammar: str) -> float:
        outq: queue.Queue = queue.Queue()
        runner = Runner(model, sorted(tok.eos_token_ids), batch_size=n, prefill_step=512,
                        outbox=outq)
        make = makers[kind]
        for i in range(n):
            runner.inbox.put(AddRequest(f"r{i}", tok.encode(f"rep {rep} list {i}: numbers"),
                                        max_tokens, greedy_sampler,
                                        [] if make is None else [make(tokenizers, grammar)]))
        runner.take_commands()
        done = tokens = 0
        t0 = None
        while done < n:
            runner.step()
            while not outq.empty():
                item = outq.get()
                if isinstance(item, StepTokens):
                    if t0 is None:  # decode only: from the step that gave the first tokens
                        t0 = time.perf_counter()
                        continue
                    tokens += len(item.rows)
                    done += sum(1 for row in item.rows if row[2] is not None)
        assert t0 is not None
        return tokens / (time.perf_counter() - t0)

    levels = [int(x) for x in args.concurrency.split(",")]
    for n in levels:  # warm-up
        for grammar in grammars.values():
            for kind in makers:
                one(n, kind, 16, -1, grammar)
    results: dict = {}
    kinds = list(makers)
    for rep in range(args.reps):
        for n in levels:
            for schema, grammar in grammars.items():
                k = rep % len(kinds)
                for kind in kinds[k:] + kinds[:k]:
                    tok_s = one(n, kind, args.max_tokens, rep, grammar)
                    results.setdefault(f"{key(schema, n)}/{kind}", []).append(tok_s)
                    print(f"rep {rep} engine {schema} batch {n} {kind}: {tok_s:.1f} tok/s",
                          flush=True)
    return results


def engine_report(results: dict, args: argparse.Namespace) -> str:
    import mlx.core as mx
    labels = [lb for lb in ("before", "after") if not (lb == "before" and args.no_before)]
    lines = [f"# Constrained decoding cost on the MLX thread alone (in-process Runner): "
             f"{args.model or args.shape} ({args.model_dtype}), {args.max_tokens} tokens per "
             f"request, {args.reps} interleaved reps", "",
             f"{time.strftime('%Y-%m-%d')}, {platform.node()}, mlx {version('mlx')}, "
             f"device {mx.default_device()}. Ratios: median over reps of JSON / free of the "
             f"same rep.", "",
             "| schema | batch | free tok/s | " + " | ".join(
                 f"{lb}: JSON tok/s | {lb}: ratio (range)" for lb in labels) + " |",
             "|---|---|---|" + "---|---|" * len(labels)]
    for schema in args.schemas.split(","):
        for n in args.concurrency.split(","):
            free = results[f"{key(schema, n)}/free"]
            cells = [f"{statistics.median(free):.1f}"]
            for lb in labels:
                con = results[f"{key(schema, n)}/{lb}"]
                ratios = [c / f for c, f in zip(con, free, strict=True)]
                cells += [f"{statistics.median(con):.1f}",
                          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-"
                          f"{max(ratios):.3f})"]
            lines.append(f"| {schema} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default="tiny", choices=sorted(throughput.SHAPES))
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--base-tree", type=Path, default=None,
                    help="a checkout (git worktree) to measure as 'before' in the same run")
    ap.add_argument("--tree", type=Path, default=None,
                    help="a checkout to measure as 'after' (default: the installed mlxd)")
    ap.add_argument("--before-env", default=None,
                    help="'KEY=VALUE;...': 'before' is this tree run with these variables "
                    "(e.g. MLXD_GRAMMAR_ORDER=dispatch-first), instead of --base-tree")
    ap.add_argument("--schemas", default="ints",
                    help="comma-separated, of " + ", ".join(SCHEMAS) + ": 'flat' (a string, "
                    "an integer, a boolean), 'mixed' (a string, an integer, an array of "
                    "strings), 'enum' (seven enum fields), each an object repeated in a long "
                    "array; 'ints' a long array of integers")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", action="store_true",
                    help="measure one in-process Runner instead of a server, the per-row "
                         "processor used before the overlap ('before') against the current")
    ap.add_argument("--no-before", action="store_true",
                    help="--engine: leave out the per-row processor used before the overlap")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.engine:
        results = engine_rounds(args)
        throughput.save(args.out, engine_report(results, args), results)
        return
    results = asyncio.run(main_async(args))
    throughput.save(args.out, report(results, args), results)


if __name__ == "__main__":
    main()
