"""LoRA adapters (issue 16): what serving several adapters of one base in one batch costs.

In-process, on the engine's own MLX-thread runner (no HTTP: the figures are the model's and
the batch's), with random rank-R adapters on every linear layer of the base that mlx-lm's
`linear_to_lora_layers` wraps by default:

- decode throughput at S streams (S rows decoding together, the same short prompt), for
  * the base alone (no adapter applied to the model at all: the reference for the overhead),
  * one adapter on every row,
  * two adapters interleaved (rows alternate between them: per-row adapter gather),
  * the base rows of a model that has adapters loaded (what plain requests pay for them);
  measured over the same decode steps, configurations interleaved per round, median of
  `--rounds`; target: two interleaved >= 0.8 x one adapter.
- memory: the bytes of the model's arrays (MLX's active memory after load) for the base and for
  the base + 2 adapters; target <= +10 %.

    python benchmarks/lora.py                      # the default model (SmolLM2-135M), 8 streams
    python benchmarks/lora.py --model DIR --streams 8 --rank 16 --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import platform
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mlxd.daemon.paths import default_cache_dir
from mlxd.engine.batch.messages import AddRequest, StepTokens
from mlxd.engine.batch.runner import Runner
from mlxd.engine.kinds.text.lora import apply_adapters, mark_prompt
from mlxd.engine.load.loader import load_model, resolve_model_dir
from support.lora_adapters import write_random_adapter

PROMPT = "Write a story about a lighthouse keeper."  # short: prefill is not what is measured


class Streams:
    """S rows decoding together on a runner of their own: prefilled once, then measured over
    windows of decode steps (configurations interleaved window by window)."""

    def __init__(self, model: Any, prompts: list[list[int]], max_tokens: int) -> None:
        self.outq: queue.Queue = queue.Queue()
        self.runner = Runner(model, [], batch_size=len(prompts), prefill_step=512,
                             outbox=self.outq, cache_bytes=0)
        for i, p in enumerate(prompts):
            self.runner.inbox.put(AddRequest(f"r{i}", p, max_tokens, greedy_sampler, []))
        self.runner.take_commands()
        decoding = 0
        while decoding < len(prompts):  # prefill, and the first decode step of every row
            decoding = max(decoding, self._step())

    def _step(self) -> int:
        self.runner.step()
        rows = 0
        while not self.outq.empty():
            item = self.outq.get()
            if isinstance(item, StepTokens):
                rows += len(item.rows)
        return rows

    def rate(self, steps: int) -> float:
        """Tokens per second over `steps` decode steps."""
        mx.eval(self.runner._gen._generation_batch._next_tokens)
        t0 = time.perf_counter()
        tokens = sum(self._step() for _ in range(steps))
        mx.eval(self.runner._gen._generation_batch._next_tokens)
        return tokens / (time.perf_counter() - t0)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def active_mib() -> float:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="model spec (default: SmolLM2-135M)")
    ap.add_argument("--random", action="store_true",
                    help="instead, a random float32 model of SmolLM2-135M's shape (30 blocks, "
                         "hidden 576; a small vocabulary): unquantized, so its matmuls run at "
                         "BLAS speed on a CPU and the adapters' share of a step is larger")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8, help="(mlx_lm.lora's default: 8)")
    ap.add_argument("--layers", type=int, default=16,
                    help="transformer blocks adapted, from the last (mlx_lm.lora's default: "
                         "16; -1: all)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps measured per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mlxd-lora-bench-"))
    cache = default_cache_dir()
    if args.random:
        from support.random_model import write_random_model
        base_dir = write_random_model(work / "smollm-shape-f32", hidden=576, layers=30, heads=9,
                                      kv_heads=3, intermediate=1536, context=2048)
    else:
        base_dir = resolve_model_dir(args.model, cache)
    adapters = {name: str(write_random_adapter(base_dir, work / name, rank=args.rank,
                                               num_layers=args.layers, seed=i + 1,
                                               strength=0.5))
                for i, name in enumerate(("coder", "writer"))}
    say(f"adapters written in {work}")

    before = active_mib()
    plain, tok, _ = load_model(str(base_dir), cache)
    base_mib = active_mib() - before
    lora_model, _, _ = load_model(str(base_dir), cache)
    loaded = active_mib()
    lset = apply_adapters(lora_model, adapters)
    assert lset is not None
    adapters_mib = active_mib() - loaded

    prompt = tok.encode(PROMPT)
    s, v = args.streams, lset.vocab
    one_rows = [mark_prompt(prompt, 1, v)] * s
    two_rows = [mark_prompt(prompt, 1 + i % 2, v) for i in range(s)]
    configs = {"base (no adapters loaded)": (plain, [prompt] * s),
               "base rows, adapters loaded": (lora_model, [prompt] * s),
               "one adapter on every row": (lora_model, one_rows),
               "two adapters interleaved": (lora_model, two_rows)}
    streams = {}
    for name, (m, ps) in configs.items():  # prefill; the first steps build the kernels
        streams[name] = Streams(m, ps, 4 + args.rounds * args.steps + 8)
        streams[name].rate(4)
        say(f"{name}: prefilled and warm")
    rates: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for name, st in streams.items():
            rates[name].append(st.rate(args.steps))
            say(f"round {r + 1}: {name}: {rates[name][-1]:.1f} tok/s")
    med = {k: statistics.median(r) for k, r in rates.items()}

    def ratio(k: str, ref: str) -> float:
        """Median over rounds of the round's ratio: the load of a shared machine drifts
        between rounds more than within one."""
        return statistics.median(a / b for a, b in zip(rates[k], rates[ref], strict=True))

    one, base = "one adapter on every row", "base (no adapters loaded)"
    lines = [
        f"# LoRA adapters: {s} streams, rank {args.rank}, "
        f"{lset.adapters['coder'].layers} adapted linear layers "
        f"({args.layers if args.layers > 0 else 'all'} blocks)",
        f"model {base_dir.name}; {platform.machine()} {mx.default_device()}; "
        f"mlx {mx.__version__}; {args.steps} decode steps x {args.rounds} rounds",  # type: ignore[attr-defined]
        "",
        "| configuration | decode tok/s (median) | per round | vs one adapter | vs base |",
        "|---|---|---|---|---|",
        *(f"| {k} | {med[k]:.1f} | {' '.join(f'{r:.1f}' for r in rates[k])} | "
          f"{ratio(k, one):.2f} | {ratio(k, base):.2f} |" for k in configs),
        "",
        "(ratios: median over rounds of each round's ratio)",
        f"two adapters interleaved / one adapter: {ratio('two adapters interleaved', one):.3f}"
        " (target >= 0.8)",
        f"memory: base {base_mib:.1f} MiB; + 2 adapters {adapters_mib:.2f} MiB "
        f"(stacked: {lset.nbytes / 2**20:.2f} MiB) = +{100 * adapters_mib / base_mib:.2f} % "
        "(target <= +10 %)",
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
