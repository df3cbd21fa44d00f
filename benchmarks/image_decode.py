"""What an image costs the proxy when a chat client sends it again: decoded (base64, PNG, RGB,
the pixels' hash), as every turn paid before, against taken from the proxy's recently decoded
images (`proxy/core/images.py` `DecodedImages`: the hash of the base64 text), side by side in
one run, on the proxy's own functions.

The image is screenshot-like (a flat background around a noisy, coarsely quantized panel), of
`--size` pixels. Medians over `--reps` calls each.

    python benchmarks/image_decode.py --size 1280x800
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def screenshot_png(width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image
    pixels = np.full((height, width, 3), 240, np.uint8)
    y0, x0 = height // 8, width // 12
    panel = np.random.default_rng(0).integers(0, 256, (height - 2 * y0, width - 2 * x0, 3),
                                              dtype=np.uint8)
    pixels[y0:height - y0, x0:width - x0] = panel // 32 * 32
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    from mlxd.proxy.core import images
    from mlxd.proxy.core.images import DecodedImages, ImageRef
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1280x800")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    png = screenshot_png(width, height)
    ref = ImageRef(base64.b64encode(png).decode(), "image")

    def timed(memo_of: Callable[[], DecodedImages]) -> float:
        times = []
        for _ in range(args.reps):
            memo = memo_of()
            t0 = time.perf_counter()
            images._decode_ref(ref, None, memo)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    decoded = timed(DecodedImages)  # a fresh memo each call: decoded every time
    kept = DecodedImages()
    images._decode_ref(ref, None, kept)
    taken = timed(lambda: kept)
    res = {"size": args.size, "png_bytes": len(png), "decoded_ms": decoded, "kept_ms": taken,
           "ratio": taken / decoded}
    print(f"{args.size} PNG of {len(png):,} bytes: decoded {decoded:.2f} ms, taken back "
          f"{taken:.2f} ms ({taken / decoded:.3f}x), medians of {args.reps}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
