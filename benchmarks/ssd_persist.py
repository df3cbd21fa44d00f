"""What handing finished requests' KV to the SSD tier costs the MLX thread, per block.

When a step ends requests, the engine inserts their histories into the RAM tier and queues
their blocks for the storage worker (`SsdTier.persist_all`, on the MLX thread); the storage
thread then copies each block into its shared-memory slot. Decoding waits for the first part
only. This builds a real `SsdTier` (its shared memory and storage thread; no worker answers,
so every slot is used once) over random KV of the given shape, persists E entries of T tokens
in one call, and reports the MLX thread's time per block and the storage thread's copy.

    python benchmarks/ssd_persist.py --layers 16 --kv-heads 8 --head-dim 64 --tokens 340 \\
        --entries 32 --dtype bfloat16 --reps 5
    python benchmarks/ssd_persist.py --tree /tmp/old-checkout   # another tree's mlxd, same run

`--tree DIR` imports mlxd from another checkout (a `git worktree` of an older commit) so two
versions are compared on one machine; run once per tree.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=340, help="tokens per entry")
    ap.add_argument("--entries", type=int, default=32, help="entries persisted in one call")
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tree", type=Path, default=None, help="import mlxd from this checkout")
    args = ap.parse_args()
    if args.tree is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from constrained import tree_view
        sys.path.insert(0, str(tree_view(args.tree)))
    import mlx.core as mx
    import zmq

    import mlxd
    from mlxd.engine.kv.prefix_cache import Entry
    from mlxd.engine.kv.ssd_tier import SsdTier
    from mlxd.protocol.block_format import Layout
    print(f"mlxd from {Path(mlxd.__file__).parent}; device {mx.default_device()}")
    dt = getattr(mx, args.dtype)
    layout = Layout(args.layers, args.kv_heads, args.head_dim, args.head_dim, args.dtype)
    per_entry = -(-args.tokens // args.block_tokens)
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-persist-"))
    ctx = zmq.Context()
    mlx_s: list[float] = []
    copy_s: list[float] = []
    for rep in range(args.reps):
        tier = SsdTier(root=run_dir / f"kv{rep}", layout=layout, description=f"bench {rep}",
                       block_tokens=args.block_tokens, run_dir=run_dir, engine_id="b",
                       epoch=rep, slots=args.entries * per_entry, verify=False, ctx=ctx,
                       endpoint=f"ipc://{run_dir}/nobody")
        shape = (1, args.kv_heads, args.tokens + 64, args.head_dim)
        entries = []
        for i in range(args.entries):  # as a finished row's: views of a longer cache
            layers = [(mx.random.normal(shape).astype(dt)[..., :args.tokens, :],
                       mx.random.normal(shape).astype(dt)[..., :args.tokens, :])
                      for _ in range(args.layers)]
            mx.eval(layers)
            entries.append(Entry(tuple(range(i * 100_000, i * 100_000 + args.tokens)),
                                 layers, 0))
        copied = threading.Event()
        spent = [0.0]
        original = tier._copy

        def timed_copy(blocks: list, original: Any = original, spent: list = spent,
                       copied: threading.Event = copied) -> Any:
            t = time.perf_counter()
            out = original(blocks)
            spent[0] += time.perf_counter() - t
            copied.set()
            return out
        tier._copy = timed_copy  # type: ignore[method-assign]  # the storage thread's copy, timed
        t0 = time.perf_counter()
        queued = tier.persist_all(entries)
        mlx_s.append((time.perf_counter() - t0) / max(queued, 1))
        copied.wait(60)
        copy_s.append(spent[0] / max(queued, 1))
        tier.close()
    print(f"{args.entries} entries x {args.tokens} tokens ({args.layers} layers, "
          f"{args.kv_heads} KV heads x {args.head_dim}, {args.dtype}), {queued} blocks a call")
    print(f"MLX thread per block: median {statistics.median(mlx_s) * 1e3:.3f} ms "
          f"(min {min(mlx_s) * 1e3:.3f}); storage thread's copy per block: median "
          f"{statistics.median(copy_s) * 1e3:.3f} ms")
    ctx.term()
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
