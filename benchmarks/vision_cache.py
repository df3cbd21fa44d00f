"""Images and the prefix cache: time to first token of a conversation's second turn that
re-sends the same image, against its first turn (goal: <= 0.2x), through `mlxd serve
--isolate` on a random-weight LLaVA written for the run (576 image tokens: a 336-pixel image
in 14-pixel patches). Each round uses a new image: turn 1 (a miss: vision tower and prefill),
turn 2 (the same image and turn 1's answer, plus a question: the image is cached), and turn 2
with one pixel changed (a miss again). Then batching: N requests with different images sent
at once against the same N one after the other (vision rows share the text batch). Last, the
vision tower's effect on a running text row: its inter-token gaps while a new image's request
is admitted.

    python benchmarks/vision_cache.py [--family llava|gemma3|mistral3|smolvlm|qwen2_5_vl|qwen2_vl
        |qwen3_vl]
        [--rounds 5] [--stall-rounds 1]
        [--concurrency 4] [--out FILE] [--server-log FILE]
        [--hidden 2048 --layers 16 --vision-hidden 1024 --vision-layers 24 --vision-heads 16
         --model-dtype bfloat16]  (the ~1B models of the H200 runs; every family takes them)

`--family gemma3`: a random-weight Gemma 3 (a 224-pixel image: 256 soft tokens; sliding
window 512 in every other layer); `--family mistral3`: a random-weight Mistral 3 (images fit
into 448 pixels: the 400 x 300 images here take 11 x 15 = 165 positions, plus row breaks);
`--family smolvlm`: a random-weight SmolVLM (images resized to 448 pixels and cut into 224-pixel
tiles of 64 positions: 2 x 2 tiles and the global view, 320 positions); `--family qwen2_5_vl`:
a random-weight Qwen2.5-VL (at most 448 x 448 pixels: a 400 x 300 image takes 11 x 14 = 154
positions, with 3-D rotary positions); `--family qwen3_vl`: a random-weight Qwen3-VL (32-pixel
merged patches, at most 448 x 448 pixels: a 400 x 300 image takes 9 x 12 = 108 positions;
DeepStack features added after the language model's first two layers).

Image sizes: `--image WxH` (400x300 by default) and the families' resizing limits, small by
default (cheap on this CPU); `--max-pixels N` (the Qwen families; their processors ship
12845056, about 3584 x 3584) and `--longest-edge N` (Mistral 3 and SmolVLM; they ship 1540
and 1536) let them be what the shipped processors do, e.g. a 1280x800 screenshot at
`--max-pixels 12845056` or `--longest-edge 1540`. Gemma 3 and LLaVA resize every image to
their one size. `--shipped` sets every family's shipped limits at once (SmolVLM's 384-pixel
tiles and Gemma 3's 896-pixel tower too). `--image-kind screenshot` sends screenshot-like PNGs
(~0.8 MB at 1280 x 800) instead of all-noise ones (~3 MB: their base64 is 4 MB of every
request's JSON, which the client's own encoding and sending pay on every turn). The image's
prompt tokens are measured (the first turn's prompt against a text-only one) and reported with
the computed positions.

`--stall-rounds N`: the text row's gaps measured N times, each with a new image (medians and
the range reported). Under `MLXD_STAGE_TRACE=DIR` the server writes its stage clock there
(`python benchmarks/request_stages.py DIR`: the requests in order, the warm-up first, then each
round's first turn, second turn and changed pixel).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.random_qwen3_vl import qwen3_vl_grid, write_random_qwen3_vl
from support.random_vlm import (  # shared with the tests
    image_tokens,
    mistral3_image_tokens,
    qwen2_5_vl_grid,
    write_random_gemma3,
    write_random_mistral3,
    write_random_qwen2_5_vl,
    write_random_qwen2_vl,
    write_random_smolvlm,
    write_random_vlm,
)
from throughput import Server, free_port, save

MODEL = "bench-llava"
MODEL_NAME = [MODEL]  # the family's model directory's name, once written
NO_EOS: list[dict[str, int]] = [{}]  # a logit bias keeping the text row from ending early
# A logit bias against the tokenizer's special tokens (EOS aside): a random model's answer
# holding an image marker ([IMG], <image>, ...) would make the next turn's prompt hold more
# image markers than images (a 400).
NO_SPECIAL: list[dict[str, int]] = [{}]
IMAGE_SIZE = 336
QUESTION = "Describe this picture in detail."


IMAGE = [(400, 300)]  # (width, height) of every image sent, from --image
IMAGE_KIND = ["noise"]  # from --image-kind


def image_b64(seed: int, change: bool = False) -> str:
    """A PNG, base64: every pixel random ("noise": incompressible, ~3 MB at 1280 x 800), or
    ("screenshot") a flat background around a coarsely quantized random panel, as
    `image_decode.py` makes (~0.8 MB at 1280 x 800); `seed` makes each image its own."""
    from PIL import Image
    width, height = IMAGE[0]
    rng = np.random.default_rng(seed)
    if IMAGE_KIND[0] == "noise":
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        pixels = np.full((height, width, 3), 240, np.uint8)
        y0, x0 = height // 8, width // 12
        panel = rng.integers(0, 256, (height - 2 * y0, width - 2 * x0, 3), dtype=np.uint8)
        pixels[y0:height - y0, x0:width - x0] = panel // 32 * 32
    if change:
        pixels[7, 11, 0] ^= 1
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def turn(image: str) -> dict:
    return {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        {"type": "text", "text": QUESTION}]}


async def ask(base: str, messages: list[dict], max_tokens: int = 8) -> tuple[float, str, dict]:
    """(seconds to the first text, the answer, usage) of one streamed chat."""
    body = {"model": MODEL_NAME[0], "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": NO_SPECIAL[0]}
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s, \
            s.post(base + "/v1/chat/completions", json=body) as r:
        if r.status >= 400:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:500]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            for c in obj.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = obj.get("usage") or usage
    return (first if first is not None else time.perf_counter() - t0), "".join(text), usage


async def token_times(base: str, messages: list[dict], max_tokens: int,
                      started: asyncio.Event, after: int = 8) -> list[float]:
    """The arrival time of every content delta of one streamed chat; `started` is set once
    `after` of them have arrived."""
    body = {"model": MODEL_NAME[0], "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "logit_bias": {**NO_SPECIAL[0], **NO_EOS[0]}}
    times: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s, \
            s.post(base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: {") and any(
                    (c.get("delta") or {}).get("content")
                    for c in json.loads(line[6:]).get("choices") or []):
                times.append(time.perf_counter())
                if len(times) == after:
                    started.set()
    started.set()
    return times


async def tower_stall(base: str, image: str, max_tokens: int) -> dict[str, float]:
    """A text row decoding while a new image's request arrives (its vision tower runs beside
    the engine's steps, its prefill in them): the row's median inter-token gap before the
    image came, and its longest gap while the image's request waited for its first token."""
    started = asyncio.Event()
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
    row = asyncio.create_task(token_times(base, story, max_tokens, started))
    await started.wait()
    t0 = time.perf_counter()
    first_s, _, _ = await ask(base, [turn(image)])
    t1 = t0 + first_s
    times = await row
    before = [b - a for a, b in zip(times, times[1:], strict=False) if b <= t0]
    during = [b - a for a, b in zip(times, times[1:], strict=False) if b > t0 and a < t1]
    return {"median_gap_s": statistics.median(before) if before else 0.0,
            "max_gap_during_image_s": max(during) if during else 0.0,
            "image_first_token_s": first_s, "row_tokens": len(times)}


def cached(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    heads = max(4, args.hidden // 128)
    sizes: dict[str, Any] = {
        "hidden": args.hidden, "layers": args.layers, "heads": heads, "kv_heads": heads // 2,
        "intermediate": args.hidden * 2, "vision_hidden": args.vision_hidden,
        "vision_layers": args.vision_layers, "vision_heads": args.vision_heads,
        "context": 4096, "dtype": args.model_dtype}
    MODEL_NAME[0] = f"bench-{args.family}"
    width, height = IMAGE[0] = args.image
    IMAGE_KIND[0] = args.image_kind
    edge, pixels = args.longest_edge, args.max_pixels
    if args.shipped:  # what the families' own processors ship
        pixels = 12845056
        edge = 1536 if args.family == "smolvlm" else 1540
    gemma_size, tile, scale = (896, 384, 3) if args.shipped else (224, 224, 2)
    positions: int | None
    if args.family == "gemma3":
        model = write_random_gemma3(work / MODEL_NAME[0], image_size=gemma_size, image_tokens=256,
                                    sliding_window=512, **sizes)
        positions = 256
    elif args.family == "mistral3":
        model = write_random_mistral3(work / MODEL_NAME[0], longest_edge=edge, **sizes)
        positions = mistral3_image_tokens(width, height, edge)
    elif args.family == "smolvlm":
        model = write_random_smolvlm(work / MODEL_NAME[0], longest_edge=edge, tile=tile,
                                     scale_factor=scale, **sizes)
        positions = 5 * 64 if (edge, width, height, tile) == (448, 400, 300, 224) else None
    elif args.family == "qwen2_5_vl":
        # Qwen2.5-VL's own 112-pixel attention windows (the writer's default, 56, makes every
        # even grid side end in an empty window: mlx-vlm's tower then attends over zero
        # tokens, which kills the process on CUDA; see write_random_qwen2_5_vl)
        model = write_random_qwen2_5_vl(work / MODEL_NAME[0], min_pixels=56 * 56,
                                        max_pixels=pixels, window_size=112, **sizes)
        grid_rows, grid_cols = qwen2_5_vl_grid(width, height, 56 * 56, pixels)
        positions = grid_rows * grid_cols
    elif args.family == "qwen2_vl":  # the same resizing; a tower without windows
        model = write_random_qwen2_vl(work / MODEL_NAME[0], min_pixels=56 * 56,
                                      max_pixels=pixels, **sizes)
        grid_rows, grid_cols = qwen2_5_vl_grid(width, height, 56 * 56, pixels)
        positions = grid_rows * grid_cols
    elif args.family == "qwen3_vl":
        model = write_random_qwen3_vl(work / MODEL_NAME[0], min_pixels=64 * 64,
                                      max_pixels=pixels, **sizes)
        grid_rows, grid_cols = qwen3_vl_grid(width, height, 64 * 64, pixels)
        positions = grid_rows * grid_cols
    else:
        model = write_random_vlm(work / MODEL, image_size=IMAGE_SIZE, **sizes)
        positions = image_tokens(IMAGE_SIZE)
    config = json.loads((model / "config.json").read_text())
    eos = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    NO_EOS[0] = {str(t): -100 for t in (eos if isinstance(eos, list) else [eos])
                 if isinstance(t, int)}
    added = json.loads((model / "tokenizer.json").read_text()).get("added_tokens") or []
    NO_SPECIAL[0] = {str(t["id"]): -100 for t in added
                     if t.get("special") and str(t["id"]) not in NO_EOS[0]}
    port = free_port()
    argv = [sys.executable, "-m", "mlxd.cli.main", "serve", str(model), "--isolate",
            "--port", str(port), "--run-dir", tempfile.mkdtemp(prefix="mlxd-bv-", dir="/tmp"),
            "--cache-dir", str(work / "cache"), "--log-level", "warning"]
    srv = Server(argv, f"http://127.0.0.1:{port}/health", log=args.server_log)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    base = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        await srv.wait()
        # warm-up (kernels for these shapes); the image's prompt tokens against none
        _, _, with_image = await ask(base, [turn(image_b64(999))])
        _, _, text_only = await ask(base, [{"role": "user", "content": QUESTION}])
        image_prompt_tokens = int(with_image.get("prompt_tokens", 0)) - int(
            text_only.get("prompt_tokens", 0))
        for i in range(args.rounds):
            img = image_b64(i)
            first_s, answer, u1 = await ask(base, [turn(img)])
            follow = [turn(img), {"role": "assistant", "content": answer},
                      {"role": "user", "content": "What else is in it?"}]
            second_s, _, u2 = await ask(base, follow)
            follow[0] = turn(image_b64(i, change=True))
            changed_s, _, u3 = await ask(base, follow)
            rows.append({"first_s": first_s, "second_s": second_s, "changed_s": changed_s,
                         "prompt_tokens": [u1.get("prompt_tokens"), u2.get("prompt_tokens")],
                         "cached": [cached(u1), cached(u2), cached(u3)]})
            print(f"round {i}: first turn {first_s:.3f} s, second turn (same image) "
                  f"{second_s:.3f} s ({cached(u2)}/{u2.get('prompt_tokens')} cached), "
                  f"one pixel changed {changed_s:.3f} s ({cached(u3)} cached)", flush=True)
        n = args.concurrency
        images = [image_b64(1000 + k) for k in range(2 * n)]
        t0 = time.perf_counter()
        for k in range(n):
            await ask(base, [turn(images[k])], max_tokens=args.batch_tokens)
        sequential = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(ask(base, [turn(images[n + k])], max_tokens=args.batch_tokens)
                               for k in range(n)))
        together = time.perf_counter() - t0
        # The same, with each image already cached (a follow-up question): decode dominates.
        def again(k: int) -> list[dict]:
            return [turn(images[k]), {"role": "user", "content": "And the colours?"}]
        t0 = time.perf_counter()
        for k in range(n):
            await ask(base, again(k), max_tokens=args.batch_tokens)
        sequential_hit = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(ask(base, again(n + k), max_tokens=args.batch_tokens)
                               for k in range(n)))
        together_hit = time.perf_counter() - t0
        stalls = []
        for k in range(args.stall_rounds):
            one = await tower_stall(base, image_b64(2000 + k), args.stall_tokens)
            stalls.append(one)
            print(f"a text row's inter-token gap: median {one['median_gap_s'] * 1e3:.1f} ms "
                  f"before, longest {one['max_gap_during_image_s'] * 1e3:.1f} ms while a new "
                  f"image's request waited {one['image_first_token_s']:.3f} s for its first "
                  f"token", flush=True)
        stall = ({k: statistics.median(x[k] for x in stalls) for k in stalls[0]}
                 if stalls else None)
    finally:
        srv.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in ("first_s", "second_s",
                                                              "changed_s")}
    return {"rows": rows, "median": med, "ratio": med["second_s"] / med["first_s"],
            "changed_ratio": med["changed_s"] / med["first_s"],
            "image_tokens": positions, "image_prompt_tokens": image_prompt_tokens,
            "image": f"{width}x{height}", "image_kind": args.image_kind,
            "image_png_bytes": len(image_b64(0)) * 3 // 4, "family": args.family, "concurrency": n,
            "sequential_s": sequential, "together_s": together,
            "sequential_hit_s": sequential_hit, "together_hit_s": together_hit,
            "batch_tokens": args.batch_tokens, "tower_stall": stall, "tower_stalls": stalls,
            "weights_bytes": weights, "dtype": args.model_dtype}


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def report(r: dict[str, Any]) -> str:
    m = r["median"]
    rows = r["rows"]
    ratios = [x["second_s"] / x["first_s"] for x in rows]
    stalls = r.get("tower_stalls") or ([r["tower_stall"]] if r.get("tower_stall") else [])
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(r.get("dtype", ""), 0)
    params = (f", about {r['weights_bytes'] / size / 1e9:.2f}B parameters in all"
              if size and r.get("weights_bytes") else "")
    png_size = (f", {r['image_png_bytes'] // 1000:,} kB PNG" if r.get("image_png_bytes")
                else "")
    prompt_tokens = (f", {r['image_prompt_tokens']} prompt tokens each"
                     if r.get("image_prompt_tokens") else "")
    return "\n".join([f"`python benchmarks/vision_cache.py {' '.join(sys.argv[1:])}`", "",
        f"# Vision prefix cache ({r['family']}: {r.get('image', '400x300')} "
        f"{r.get('image_kind', 'noise')} images"
        f"{png_size}, "
        f"{r['image_tokens'] if r['image_tokens'] else 'uncomputed'} image positions"
        f"{prompt_tokens}, "
        f"{len(r['rows'])} rounds, "
        f"medians{params})", "",
        "| turn | time to first text | range over rounds | vs first turn |",
        "|---|---|---|---|",
        f"| first turn (miss) | {m['first_s']:.3f} s | "
        f"{spread([x['first_s'] for x in rows])} | 1.00x |",
        f"| second turn, same image | {m['second_s']:.3f} s | "
        f"{spread([x['second_s'] for x in rows])} | {r['ratio']:.2f}x (per round "
        f"{spread(ratios, '{:.2f}')}) |",
        f"| second turn, one pixel changed | {m['changed_s']:.3f} s | "
        f"{spread([x['changed_s'] for x in rows])} | {r['changed_ratio']:.2f}x |", "",
        f"{r['concurrency']} image requests of {r['batch_tokens']} tokens: one after the "
        f"other {r['sequential_s']:.2f} s, all at once {r['together_s']:.2f} s "
        f"({r['sequential_s'] / r['together_s']:.2f}x); the same with each image cached "
        f"(a follow-up question): {r['sequential_hit_s']:.2f} s against "
        f"{r['together_hit_s']:.2f} s ({r['sequential_hit_s'] / r['together_hit_s']:.2f}x)",
        "",
        f"A text row decoding while a new image's request arrives ({len(stalls)} "
        f"{'time' if len(stalls) == 1 else 'times, medians'}): its median inter-token gap "
        f"{r['tower_stall']['median_gap_s'] * 1e3:.1f} ms before, its longest "
        f"{r['tower_stall']['max_gap_during_image_s'] * 1e3:.1f} ms "
        f"({spread([x['max_gap_during_image_s'] * 1e3 for x in stalls], '{:.1f}')}) while the "
        f"image's request waited {r['tower_stall']['image_first_token_s']:.3f} s for its first "
        "token" if stalls else "The text row's gaps were not measured (--stall-rounds 0)", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["llava", "gemma3", "mistral3", "smolvlm",
                                          "qwen2_5_vl", "qwen2_vl", "qwen3_vl"],
                    default="llava")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--image", type=lambda v: tuple(int(x) for x in v.lower().split("x")),
                    default=(400, 300), help="WxH of the images sent (default 400x300)")
    ap.add_argument("--max-pixels", type=int, default=448 * 448,
                    help="the Qwen families' processor limit (shipped: 12845056)")
    ap.add_argument("--longest-edge", type=int, default=448,
                    help="Mistral 3's and SmolVLM's processor limit (shipped: 1540, 1536)")
    ap.add_argument("--image-kind", choices=["noise", "screenshot"], default="noise",
                    help="every pixel random (the PNG incompressible), or screenshot-like")
    ap.add_argument("--shipped", action="store_true",
                    help="every family's shipped image limits: Qwen 12845056 pixels, Mistral 3 "
                         "1540 and SmolVLM 1536 pixels' longest edge (SmolVLM in 384-pixel "
                         "tiles of 81 positions), Gemma 3's tower at 896 pixels (4,096 patches "
                         "pooled to 256)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--stall-tokens", type=int, default=400,
                    help="tokens of the text row decoding while an image arrives")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-hidden", type=int, default=256)
    ap.add_argument("--vision-layers", type=int, default=2)
    ap.add_argument("--vision-heads", type=int, default=2)
    ap.add_argument("--model-dtype", default="float32", help="the weights' dtype as written")
    ap.add_argument("--stall-rounds", type=int, default=1,
                    help="times the text row's gaps are measured, each with a new image")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--server-log", type=Path, help="the server's output appended there")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxd-bv-") as work:
        r = asyncio.run(run(args, Path(work)))
    save(args.out, report(r), r)


if __name__ == "__main__":
    main()
