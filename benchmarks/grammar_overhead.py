"""Per-token cost of a grammar library on the decode path, for picking one: replays a valid
JSON document token by token through llguidance and (when installed) xgrammar, timing the
mask computation plus the token advance, and the cost of applying the mask to MLX logits
(the same for both). Tokenizer: the default model's (SmolLM2, 49,152 tokens) unless --model.

    python benchmarks/grammar_overhead.py --out benchmarks/results/cpu-grammar-overhead.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "population", "tags", "coastal"],
          "properties": {"name": {"type": "string"}, "population": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "coastal": {"type": "boolean"}}}
DOC = {"name": "Saint-Malo", "population": 46097,
       "tags": ["port", "walled city", "Brittany", "tides"], "coastal": True}


def llguidance_run(hf, vocab: int, eos: int, ids: list[int]) -> list[float]:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(tok, grammar)
    mask = allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        fill_next_token_bitmask(m, mask, 0)
        ok = m.consume_token(t)
        times.append(time.perf_counter() - t0)
        assert ok, f"llguidance rejected token {t}: {m.get_error()}"
    return times


def xgrammar_run(hf, vocab: int, ids: list[int]) -> list[float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        ok = m.accept_token(t)
        times.append(time.perf_counter() - t0)
        assert ok, f"xgrammar rejected token {t}"
    return times


def apply_cost(vocab: int, reps: int = 200) -> float:
    import mlx.core as mx
    import numpy as np
    logits = mx.random.normal((1, vocab))
    mask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    mx.eval(logits)
    t0 = time.perf_counter()
    for _ in range(reps):
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
        mx.eval(mx.where(mx.array(allowed.astype(np.bool_)), logits, float("-inf")))
    return (time.perf_counter() - t0) / reps


def apply_cost_batched(vocab: int, rows: int, on_device: bool, reps: int = 50) -> float:
    """The engine's way since the overlap: every row's bitmask unpacked in one go
    (engine/grammar/processor.py `unpack_bits`: by numpy, or from the packed bits on the device),
    then each row masked. Per row."""
    import mlx.core as mx
    import numpy as np

    from mlxd.engine.grammar.processor import apply_mask, unpack_bits
    logits = mx.random.normal((rows, vocab))
    bits = np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)
    mx.eval(logits)
    t0 = time.perf_counter()
    for _ in range(reps):
        allowed = unpack_bits(bits, vocab, on_device)
        mx.eval([apply_mask(logits[j:j + 1], allowed[j:j + 1]) for j in range(rows)])
    return (time.perf_counter() - t0) / reps / rows


def step_fill_cost(hf, vocab: int, eos: int, ids: list[int], rows: int) -> tuple[float, float]:
    """One decode step of `rows` constrained rows (the same document each): consume + mask
    row after row, and consume + llguidance's parallel fill. Median µs per step."""
    import llguidance
    import llguidance.hf
    from llguidance.numpy import (
        allocate_token_bitmask,
        fill_next_token_bitmask,
        fill_next_token_bitmask_par,
    )
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False})
    ex = llguidance.LLExecutor()
    out = []
    for par in (False, True):
        ms = [llguidance.LLMatcher(tok, grammar) for _ in range(rows)]
        bits = allocate_token_bitmask(rows, vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            if par:
                fill_next_token_bitmask_par(ex, [(m, j) for j, m in enumerate(ms)], bits)
            else:
                for j, m in enumerate(ms):
                    fill_next_token_bitmask(m, bits, j)
            for m in ms:
                m.consume_token(t)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times[1:]) * 1e6)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.daemon.paths import default_cache_dir
    from mlxd.engine.load.loader import resolve_model_dir
    model_dir = resolve_model_dir(args.model, default_cache_dir())
    tok = load_tokenizer(model_dir)
    hf = tok._tokenizer
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    ids.append(tok.eos_token_id)
    rows = [("llguidance", llguidance_run(hf, vocab, tok.eos_token_id, ids))]
    xg = xgrammar_run(hf, vocab, ids)
    if xg is not None:
        rows.append(("xgrammar", xg))
    import mlx.core as mx
    lines = [f"# Grammar overhead per token ({model_dir.name}, vocab {vocab}, "
             f"{len(ids)} tokens of JSON, {time.strftime('%Y-%m-%d')}, "
             f"{mx.default_device()})", "",
             "| library | mask + advance, median (µs) | p90 (µs) | first token (ms) |",
             "|---|---|---|---|"]
    for name, t in rows:
        us = sorted(x * 1e6 for x in t[1:])
        lines.append(f"| {name} | {statistics.median(us):.0f} | {us[int(0.9 * len(us))]:.0f} | "
                     f"{t[0] * 1e3:.2f} |")
    lines += ["", f"Applying a mask to MLX logits (numpy unpack + `mx.where`): "
                  f"{apply_cost(vocab) * 1e6:.0f} µs per row."]
    lines += ["", "A decode step of several constrained rows (llguidance, the document above "
                  "in every row):", "",
              "| rows | masks + advance row after row (µs/step) | parallel fill + advance "
              "(µs/step) | all rows' masks applied, numpy unpack (µs/row) | the same, "
              "unpacked by MLX (µs/row) |", "|---|---|---|---|---|"]
    for n in (8, 32):
        serial, par = step_fill_cost(hf, vocab, tok.eos_token_id, ids, n)
        lines.append(f"| {n} | {serial:.0f} | {par:.0f} | "
                     f"{apply_cost_batched(vocab, n, False) * 1e6:.0f} | "
                     f"{apply_cost_batched(vocab, n, True) * 1e6:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
