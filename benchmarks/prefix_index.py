"""What the RAM tier's index costs the MLX thread, by context length: inserting a finished
request's history and looking up a new prompt (engine/kv/prefix_cache.py). Runs this tree's index
and, with `--against REV`, the one of another revision side by side in the same run.

Two patterns, on KV-less entries (the index's own cost; the arrays are lent, never copied):
- new chats: a shared 40-token system prompt, then L fresh tokens; each is inserted, then a
  prompt that extends it is looked up;
- one agent conversation: every turn adds L tokens to the history and is inserted whole (as
  the engine inserts a finished request's history), then the next turn's prompt is looked up.

    python benchmarks/prefix_index.py --against 7d927d2 --lengths 100,1000,10000,30000
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def load(rev: str | None) -> ModuleType:
    if rev is None:
        from mlxd.engine.kv import prefix_cache
        return prefix_cache
    src = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{rev}:engine/prefix_cache.py"],
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="mlxd-index-")) / "prefix_cache_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("prefix_cache_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def new_chats(mod: ModuleType, length: int, n: int, rnd: random.Random) -> tuple[float, float]:
    cache = mod.PrefixCache(1 << 60)
    system = list(range(40))
    ins, look = [], []
    for _ in range(n):
        toks = system + [rnd.randrange(49_000) for _ in range(length)]
        t = time.perf_counter()
        cache.insert(toks, [], 1)
        ins.append(time.perf_counter() - t)
        nxt = toks + [rnd.randrange(49_000) for _ in range(20)]
        t = time.perf_counter()
        cache.lookup(nxt)
        look.append(time.perf_counter() - t)
    return statistics.median(ins) * 1e3, statistics.median(look) * 1e3


def agent(mod: ModuleType, length: int, turns: int, rnd: random.Random) -> tuple[float, float]:
    cache = mod.PrefixCache(1 << 60)
    history: list[int] = list(range(40))
    ins, look = [], []
    for _ in range(turns):
        history += [rnd.randrange(49_000) for _ in range(length)]
        t = time.perf_counter()
        cache.lookup(history)
        look.append(time.perf_counter() - t)
        t = time.perf_counter()
        cache.insert(list(history), [], 1)
        ins.append(time.perf_counter() - t)
    return statistics.median(ins) * 1e3, statistics.median(look) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=None, help="a git revision whose index runs too")
    ap.add_argument("--lengths", default="100,1000,10000,30000")
    ap.add_argument("--chats", type=int, default=60, help="new chats per length")
    ap.add_argument("--turn", type=int, default=500, help="tokens a turn adds (agent)")
    ap.add_argument("--turns", type=int, default=60)
    args = ap.parse_args()
    impls: dict[str, Any] = {"this tree": load(None)}
    if args.against:
        impls[args.against] = load(args.against)
    print(f"median ms per operation; {sys.platform}, Python {sys.version.split()[0]}")
    print("| pattern | " + " | ".join(f"{name}: insert / lookup" for name in impls) + " |")
    print("|---|" + "---|" * len(impls))
    for length in (int(x) for x in args.lengths.split(",")):
        row = []
        for mod in impls.values():  # the same prompts for each
            i, lk = new_chats(mod, length, max(5, args.chats * 1000 // max(length, 1000)),
                              random.Random(length))
            row.append(f"{i:.3f} / {lk:.3f}")
        print(f"| new chat, 40 + {length:,} tokens | " + " | ".join(row) + " |")
    row = []
    for mod in impls.values():
        i, lk = agent(mod, args.turn, args.turns, random.Random(0))
        row.append(f"{i:.3f} / {lk:.3f}")
    print(f"| agent, {args.turns} turns of {args.turn} tokens (to "
          f"{40 + args.turn * args.turns:,}) | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
