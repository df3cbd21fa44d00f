"""A burst's first tokens through the engine's own Runner, in this process (issue 14 item 3).

On the H200 a burst of 32 fresh chats reached its first tokens in 1.6-3.2x the in-process
reference's time with the RAM prefix cache on, and 1.0-1.7x with it off or with short hits not
lent (`MLXD_MIN_CACHED_TOKENS=64`; benchmarks/HISTORY.md section 19), while lending the same short
prefixes to a bare BatchGenerator cost nothing (benchmarks/prefill_cached.py). This drives the
engine's `Runner` (engine/batch/runner.py) on this thread, without processes, HTTP or ZeroMQ: rounds
of S chats ("Round N. Request i: ...", so that only the template's start is cached from one
round to the next) put in its inbox at once, each round run until every request ended; the
time from the put to each request's first token. Each runner runs its own loop
(`Runner.run`) on a thread, as in the engine. Variants, interleaved round by round:

    off         no RAM prefix cache (cache_bytes 0)
    cache       a 1 GiB RAM prefix cache, as the engine runs it (on a GPU, rows admitted
                together are not lent hits shorter than GROUP_MIN_CACHED_GPU)
    cache-all   the same, with every hit lent: each round's rows are lent the template's
                start (the engine's rule before benchmarks/HISTORY.md section 19)
    cache-eval  as cache-all, with every RAM entry evaluated when it is stored

    python benchmarks/burst_runner.py --shape 1b --model-dtype bfloat16 --streams 32,64
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # model_for
from throughput import PROMPTS, SHAPES, model_for, salted

VARIANTS = ["off", "cache", "cache-all", "cache-eval"]


def make_runner(model: Any, eos: list[int], variant: str) -> tuple[Any, queue.Queue]:
    """A Runner on a thread of its own, running its real loop (`Runner.run`); its stream is
    made on that thread, as the engine's is (MLX streams belong to the thread that made them)."""
    import mlx.core as mx

    from mlxd.engine.batch.runner import Runner
    outq: queue.Queue = queue.Queue()
    made: queue.Queue = queue.Queue()

    def serve() -> None:
        runner = Runner(model, eos, batch_size=128, prefill_step=2048, outbox=outq,
                        stream=mx.new_stream(mx.default_device()),
                        cache_bytes=0 if variant == "off" else 1 << 30)
        if variant == "cache-eval":
            insert = runner.cache.insert

            def insert_evaluated(tokens: list[int], layers: list, nbytes: int,
                                 *rest: Any) -> Any:
                mx.eval(layers)  # (entries are evaluated when stored now: as cache-all)
                return insert(tokens, layers, nbytes, *rest)
            runner.cache.insert = insert_evaluated  # type: ignore[method-assign,assignment]
        made.put(runner)
        runner.run()
    threading.Thread(target=serve, name=f"runner-{variant}", daemon=True).start()
    return made.get(timeout=60), outq


def one_round(runner: Any, outq: queue.Queue, prompts: list[list[int]], tokens: int,
              variant: str) -> list[float]:
    """Each request's time from the put to its first token (ms)."""
    from mlx_lm.sample_utils import greedy_sampler

    from mlxd.engine.batch import burst
    from mlxd.engine.batch.messages import AddRequest, StepTokens
    burst.GROUP_MIN_CACHED_GPU = 0 if variant in ("cache-all", "cache-eval") else 64
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        runner.inbox.put(AddRequest(f"r{i}", p, tokens, greedy_sampler, []))
    first: dict[str, float] = {}
    done = 0
    while done < len(prompts):
        item = outq.get(timeout=120)
        if isinstance(item, StepTokens):
            now = time.perf_counter()
            for rid, _tok, fin in item.rows:
                first.setdefault(rid, (now - t0) * 1e3)
                done += fin is not None
    return list(first.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None)
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--streams", default="32")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    import mlx.core as mx

    from mlxd.engine.batch.messages import StopRunner
    from mlxd.engine.load.loader import load_model
    model, tok, _ = load_model(model_for(args), Path(tempfile.gettempdir()) / "mlxd-bench-cache",
                               args.model_dtype)
    eos = sorted(tok.eos_token_ids)
    variants = args.variants.split(",")
    print(f"device {mx.default_device()}, mlx {version('mlx')}")
    for s in [int(x) for x in args.streams.split(",")]:
        runners = {v: make_runner(model, eos, v) for v in variants}
        got: dict[str, list[float]] = {v: [] for v in variants}
        for rnd in range(args.rounds + 1):  # round 0 warms each runner (and fills its cache)
            for v in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
                prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                                   add_generation_prompt=True)
                           for p in salted(PROMPTS[:s])]
                firsts = one_round(*runners[v], prompts, args.max_tokens, v)
                if rnd:
                    got[v].append(statistics.median(firsts))
        print(f"\n{s} requests at once, {args.max_tokens} tokens each, {args.rounds} rounds: "
              "median first token (ms after the put), per round")
        for v in variants:
            c = runners[v][0].counters
            runners[v][0].inbox.put(StopRunner())
            print(f"  {v:11s} {statistics.median(got[v]):7.1f}  {[round(x) for x in got[v]]}"
                  f"  cached tokens {c.cached_tokens}")


if __name__ == "__main__":
    main()
