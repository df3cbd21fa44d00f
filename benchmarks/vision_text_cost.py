"""A text-only request to a vision model against the same language model served as a text model
(issue 36: "a text-only request to a vision model costs what a text model's would").

It writes a random-weight vision model of a family (the tests' writers), then a text model
directory of its language model alone (the same weights, tokenizer and chat template), starts
`mlxd serve --isolate` on each, and alternates rounds of `--concurrency` streaming chat
requests (text only, the throughput benchmark's prompts) between the two, `--reps` times.
Per round: aggregate tok/s and the median time to first text; per pair the vision model's
figure over the text model's, reported as the median of the pairs and their range. Prompt
token counts are checked equal (the same template and tokenizer).

    python benchmarks/vision_text_cost.py [--family llava|gemma3|mistral3|smolvlm|qwen2_5_vl]
        [--concurrency 1,8] [--reps 3] [--max-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.random_vlm import (  # shared with the tests
    write_random_gemma3,
    write_random_mistral3,
    write_random_qwen2_5_vl,
    write_random_smolvlm,
    write_random_vlm,
)
from throughput import measured_http, pct, save, start_target

# the vision family -> mlx-lm's model type for its language model
TEXT_TYPE = {"llava": "llama", "gemma3": "gemma3_text", "mistral3": "llama",
             "smolvlm": "llama", "qwen2_5_vl": "qwen2"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.json", "chat_template.jinja", "generation_config.json")


def write_vlm(family: str, out: Path, sizes: dict[str, Any]) -> Path:
    if family == "gemma3":
        return write_random_gemma3(out, image_size=224, image_tokens=256, sliding_window=512,
                                   **sizes)
    if family == "mistral3":
        return write_random_mistral3(out, longest_edge=448, **sizes)
    if family == "smolvlm":
        return write_random_smolvlm(out, longest_edge=448, tile=224, **sizes)
    if family == "qwen2_5_vl":
        return write_random_qwen2_5_vl(out, min_pixels=56 * 56, max_pixels=448 * 448,
                                       window_size=112, **sizes)
    return write_random_vlm(out, image_size=336, **sizes)


def language_model_dir(family: str, vlm: Path, out: Path) -> Path:
    """The vision model's language model as a text model directory mlx-lm loads."""
    import mlx.core as mx

    config = json.loads((vlm / "config.json").read_text())
    # Qwen's configs are flat; its 3-D rotary positions are plain ones when, as in text, the
    # three components are equal, so mlx-lm's qwen2 (no M-RoPE) computes the same
    text = dict(config.get("text_config") or {k: v for k, v in config.items()
                                              if k != "vision_config"})
    text["model_type"] = TEXT_TYPE[family]
    if (text.get("rope_scaling") or {}).get("type") == "mrope":
        del text["rope_scaling"]
    eos = config.get("eos_token_id", text.get("eos_token_id"))
    if eos is not None:
        text["eos_token_id"] = eos
    weights: dict[str, mx.array] = {}
    for path in sorted(vlm.glob("*.safetensors")):
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        for name, value in loaded.items():
            if name.startswith("language_model."):
                weights[name[len("language_model."):]] = value
            elif name.startswith("model.text_model."):  # idefics3 / smolvlm's naming
                weights["model." + name[len("model.text_model."):]] = value
            elif name.startswith("lm_head."):
                weights[name] = value
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(text, indent=2))
    for name in TOKENIZER_FILES:
        if (vlm / name).exists():
            shutil.copy(vlm / name, out / name)
    return out


async def prompt_tokens(base: str, model: str) -> int:
    import aiohttp
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/chat/completions", json={
            "model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "Count the tokens of this prompt."}]}) as r:
        return int((await r.json())["usage"]["prompt_tokens"])


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    heads = max(4, args.hidden // 128)
    sizes: dict[str, Any] = {
        "hidden": args.hidden, "layers": args.layers, "heads": heads, "kv_heads": heads // 2,
        "intermediate": args.hidden * 2, "vision_hidden": args.vision_hidden,
        "vision_layers": args.vision_layers, "vision_heads": args.vision_heads,
        "context": 4096, "dtype": args.model_dtype}
    vlm = write_vlm(args.family, work / f"vlm-{args.family}", sizes)
    lm = language_model_dir(args.family, vlm, work / f"lm-{args.family}")
    servers = {name: start_target("mlxd-isolate", str(d), None, "auto", args.mlxd_args.split())
               for name, d in (("vision", vlm), ("text", lm))}
    rounds: list[dict[str, Any]] = []
    try:
        for server, _, _ in servers.values():
            await server.wait()
        counts = {name: await prompt_tokens(base, model)
                  for name, (_, base, model) in servers.items()}
        assert counts["vision"] == counts["text"], counts
        for _, base, model in servers.values():  # kernels built, caches warm
            await measured_http("mlxd-isolate", base, model, max(args.concurrency), 8)
        for rep in range(args.reps):
            for c in args.concurrency:
                order = ["vision", "text"] if rep % 2 == 0 else ["text", "vision"]
                for name in order:
                    _, base, model = servers[name]
                    r = await measured_http("mlxd-isolate", base, model, c, args.max_tokens)
                    rounds.append({"target": name, "rep": rep, "concurrency": c,
                                   "tok_s": r.tok_s, "first_text_p50": pct(r.ttft, .5),
                                   "first_token": r.engine_ttft, "errors": r.errors})
                    print(f"rep {rep} c={c} {name:6s} {r.tok_s:8.1f} tok/s, first text p50 "
                          f"{pct(r.ttft, .5):.3f} s, engine: first token (mean) "
                          f"{r.engine_ttft or 0:.3f} s", flush=True)
    finally:
        for server, _, _ in servers.values():
            server.stop()
    return {"family": args.family, "sizes": sizes, "prompt_tokens": counts,
            "rounds": rounds, "argv": sys.argv[1:]}


def report(r: dict[str, Any]) -> str:
    lines = [f"# A text-only request: {r['family']} vision model / its language model as a "
             f"text model (mlxd --isolate {' '.join(r['argv'])})", "",
             "| streams | vision tok/s (median) | text tok/s | tok/s ratio, median of pairs "
             "(range) | vision first text p50 s | text | first text ratio (range) "
             "| engine's first token (mean), ratio (range) |",
             "|---|---|---|---|---|---|---|---|"]
    for c in sorted({x["concurrency"] for x in r["rounds"]}):
        by = {t: [x for x in r["rounds"] if x["concurrency"] == c and x["target"] == t]
              for t in ("vision", "text")}
        pairs = list(zip(by["vision"], by["text"], strict=True))
        tok = [v["tok_s"] / t["tok_s"] for v, t in pairs]
        first = [v["first_text_p50"] / t["first_text_p50"] for v, t in pairs]
        engine = [v["first_token"] / t["first_token"] for v, t in pairs
                  if v["first_token"] and t["first_token"]]

        def med(t: str, k: str, by: dict[str, list[dict]] = by) -> float:
            return statistics.median(x[k] for x in by[t])
        lines.append(f"| {c} | {med('vision', 'tok_s'):,.1f} | {med('text', 'tok_s'):,.1f} | "
                     f"**{statistics.median(tok):.3f}** ({min(tok):.3f}-{max(tok):.3f}) | "
                     f"{med('vision', 'first_text_p50'):.3f} | "
                     f"{med('text', 'first_text_p50'):.3f} | "
                     f"**{statistics.median(first):.3f}** ({min(first):.3f}-{max(first):.3f}) | "
                     + (f"{statistics.median(engine):.3f} ({min(engine):.3f}-{max(engine):.3f}) |"
                        if engine else " |"))
    lines += ["", "First text: the client's first content delta (a random model's first tokens "
              "may decode to nothing, and the two models' tokens may differ where their "
              "arithmetic does); the engine's first token: its own clock, request received to "
              "first token.", "", f"{len(r['rounds']) // 2} pairs; prompt tokens equal "
              f"({r['prompt_tokens']['text']} for the probe); sizes {r['sizes']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(TEXT_TYPE), default="llava")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-hidden", type=int, default=256)
    ap.add_argument("--vision-layers", type=int, default=2)
    ap.add_argument("--vision-heads", type=int, default=2)
    ap.add_argument("--model-dtype", default="float32", help="the weights' dtype as written")
    ap.add_argument("--mlxd-args", default="", help="more `mlxd serve` flags for both")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxd-bvt-") as work:
        r = asyncio.run(run(args, Path(work)))
    save(args.out, report(r), r)


if __name__ == "__main__":
    main()
