"""One row decoding over a long context: where a decode step's time goes between mlx-lm's
single-sequence loop, its batch generator, and mlxd's engine loop, side by side in one run.

Issue 33 measured mlxd's decode at an agent's context lengths at ~0.6x mlx-lm in-process
(`generate_step`, the reference of `agent_session.py`) with one session on the H200, where the
attention kernels of the two paths cost alike (`cuda_long_context.py`). A 1B model's decode
step there is CPU-bound (graph building and kernel launches), so the Python work around each
step is what differs. Each configuration runs in its own child process (the engine's patches
to mlx-lm must not reach the references), one after the other, alternated over `--reps`:

- `generate_step`: mlx-lm's single-sequence loop over a `KVCache` (the in-process reference);
- `batch`: mlx-lm's `BatchGenerator` alone, one row;
- `runner`: mlxd's engine loop (`engine/batch/runner.py` with the engine's patches and
  defaults: unpadded masks, the CUDA attention route, n-gram speculation policy), one row,
  driven on this thread without the engine's IO threads;
- `runner-nospec`: the same without a speculator (`--speculative off`).

Each prefills `--context` random tokens (untimed), then times `--steps` decode steps (greedy,
no stop token). Reports each configuration's median ms per step and its ratio to
`generate_step`, medians over repetitions with their range. With `--rows N` the batched
configurations decode N rows (distinct prompts of `--context` tokens) in each step, as two
agent sessions do; `generate_step` stays one sequence, so its ratio then reads as what a step
of N rows costs against one sequence's step.

    python benchmarks/decode_overhead.py --shape 1b --model-dtype bfloat16 --context 32768
    python benchmarks/decode_overhead.py --shape tiny --context 4096 --profile runner
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 128, 512),
    "narrow16": (64, 16, 4, 2, 128, 32000),  # a 1B's layer count and vocabulary, no compute
    "small": (512, 8, 8, 4, 1536, 4096),
    "1b": (2048, 16, 32, 8, 8192, 32000),
}
CONFIGS = ("generate_step", "batch", "runner", "runner-nospec")


def model_dir(shape: str, dtype: str, context: int) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.random_model import write_random_model
    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    out = Path(tempfile.gettempdir()) / f"mlxd-decode-{shape}-{dtype}"
    if not (out / "config.json").exists():
        write_random_model(out, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           intermediate=inter, vocab=vocab, context=max(context * 2, 4096),
                           dtype=dtype)
    return str(out)


def prompt(n: int, vocab: int) -> list[int]:
    return [3 + (i * 7919) % (vocab - 3) for i in range(n)]


def run_generate_step(model: Any, tokens: list[int], steps: int) -> list[float]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    times: list[float] = []
    last = time.perf_counter()
    for n, _ in enumerate(generate_step(mx.array(tokens), model, prompt_cache=cache,
                                        max_tokens=steps + 1, prefill_step_size=2048)):
        now = time.perf_counter()
        if n > 0:
            times.append(now - last)
        last = now
    return times


def prompts(tokens: list[int], rows: int) -> list[list[int]]:
    """`rows` distinct prompts as long as `tokens`, in its token range."""
    span = max(tokens) - 2
    return [[3 + (t - 3 + r * 101) % span for t in tokens] for r in range(rows)]


def run_batch(model: Any, tokens: list[int], steps: int, rows: int = 1) -> list[float]:
    from mlx_lm.generate import BatchGenerator
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                         prefill_step_size=2048)
    gen.insert(prompts(tokens, rows), max_tokens=[steps + 1] * rows)
    times: list[float] = []
    decoding, last = False, 0.0
    while True:
        _prompts, responses = gen.next()
        now = time.perf_counter()
        if responses:
            if decoding:
                times.append(now - last)
            decoding, last = True, now
            if any(r.finish_reason is not None for r in responses):
                break
    gen.close()
    return times


def run_runner(model: Any, tokens: list[int], steps: int, spec: bool, rows: int = 1
               ) -> list[float]:
    import queue

    import mlx.core as mx

    from mlxd.engine.admit.sampling import greedy_sampler
    from mlxd.engine.batch import handoff
    from mlxd.engine.batch.messages import AddRequest, StepTokens
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.speculative.step import Speculator
    from mlxd.protocol.settings import EngineSettings

    defaults = EngineSettings()
    handoff.install()
    stream = mx.new_stream(mx.default_device())
    outq: queue.Queue = queue.Queue()
    runner = Runner(model, [], batch_size=8, prefill_step=defaults.prefill_step,
                    outbox=outq, stream=stream,
                    speculator=Speculator(defaults.num_draft_tokens, None,
                                          defaults.prefill_step) if spec else None)
    times: list[float] = []
    with mx.stream(stream):
        for r, row in enumerate(prompts(tokens, rows)):
            runner.inbox.put(AddRequest(f"r{r}", row, steps + 1, greedy_sampler, []))
        runner.take_commands()
        done, decoding, last = False, False, 0.0
        while not done:
            runner.step()
            now = time.perf_counter()
            got = 0
            while not outq.empty():
                item = outq.get()
                if isinstance(item, StepTokens):
                    got += len(item.rows)
                    done = done or any(fin for _r, _t, fin in item.rows)
            got = -(-got // rows)  # tokens per row: a speculative step's count as steps
            if got:
                if decoding:
                    times.extend([(now - last) / got] * got)
                decoding, last = True, now
    return times


def child(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm import load
    model = load(args.model_dir)[0]
    mx.eval(model.parameters())
    vocab = model.args.vocab_size
    tokens = prompt(args.context, vocab)
    run = {"generate_step": lambda: run_generate_step(model, tokens, args.steps),
           "batch": lambda: run_batch(model, tokens, args.steps, args.rows),
           "runner": lambda: run_runner(model, tokens, args.steps, True, args.rows),
           "runner-nospec": lambda: run_runner(model, tokens, args.steps, False, args.rows),
           }[args.child]
    run()  # warm-up: the shapes built once, as a long-running server has them
    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        times = run()
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    else:
        times = run()
    print(json.dumps({"config": args.child, "ms": statistics.median(times) * 1e3,
                      "mean_ms": statistics.fmean(times) * 1e3, "steps": len(times)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a model directory in place of --shape")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rows", type=int, default=1, help="rows decoded together (batched configs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--profile", default="", help="a configuration to run once under cProfile")
    ap.add_argument("--out", default=None, help="a JSON file for the figures")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    mdir = args.model or model_dir(args.shape, args.model_dtype, args.context)
    base = [sys.executable, __file__, "--model-dir", mdir, "--context", str(args.context),
            "--steps", str(args.steps), "--rows", str(args.rows)]
    if args.profile:
        subprocess.run(base + ["--child", args.profile, "--profile", "1"], check=True)
        return
    configs = args.configs.split(",")
    got: dict[str, list[float]] = {c: [] for c in configs}
    for rep in range(args.reps):
        for c in (configs if rep % 2 == 0 else configs[::-1]):  # alternated
            out = subprocess.run(base + ["--child", c], check=True, capture_output=True,
                                 text=True).stdout.strip().splitlines()[-1]
            ms = json.loads(out)["ms"]
            got[c].append(ms)
            print(f"rep {rep} {c:14s} {ms:7.3f} ms/step", flush=True)
    ref = got.get("generate_step")
    rows = []
    print(f"\ncontext {args.context}, {args.steps} steps, {args.rows} row(s), medians of "
          f"{args.reps}:")
    for c, v in got.items():  # ratios paired per repetition
        ratio = ([r / m for r, m in zip(ref, v, strict=True)] if ref else [])
        line = (f"{c:14s} {statistics.median(v):7.3f} ms/step ({min(v):.3f}-{max(v):.3f})"
                + (f"  speed vs generate_step {statistics.median(ratio):.3f} "
                   f"({min(ratio):.3f}-{max(ratio):.3f})" if ratio else ""))
        print(line)
        rows.append({"config": c, "ms": v, "speed_ratio": ratio})
    if args.out:
        Path(args.out).write_text(json.dumps({"context": args.context, "steps": args.steps,
                                              "decoding_rows": args.rows,
                                              "shape": args.model or args.shape,
                                              "dtype": args.model_dtype, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
