"""What looking a prompt up in the SSD tier costs an admission lane, as blocks pile up on disk.

Every prompt shorter than a block is stored as a tail block under the namespace's root, so one
folder holds every short conversation ever stored. This writes N stored prompts' tails (each
prompt's boundary and its history, as the engine does) with the real block writer, then times
`SsdReader.better_than_ram` for fresh prompts (misses: the usual case for a new chat) and for
stored ones (hits, the files read and verified), at each N: asking the disk for each tail name,
and through the tail index an engine builds at start (engine/kv/tail_index.py).

    python benchmarks/ssd_lookup.py --stored 0,2000,10000
    python benchmarks/ssd_lookup.py --tree /tmp/old-checkout   # another tree's reader, same run
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stored", default="0,2000", help="stored prompts at each measurement")
    ap.add_argument("--prompt-tokens", type=int, default=88)
    ap.add_argument("--lookups", type=int, default=50)
    ap.add_argument("--tree", type=Path, default=None, help="import mlxd from this checkout")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    if args.tree is not None:
        sys.path.insert(0, str(here))
        from constrained import tree_view
        sys.path.insert(0, str(tree_view(args.tree)))
    sys.path.insert(0, str(here.parent / "tests"))
    import mlxd
    from mlxd.engine.kv.ssd_restore import SsdReader
    from mlxd.engine.kv.ssd_tier import SsdStats
    from support.blocks import write_block  # the storage worker's own writer

    print(f"mlxd from {Path(mlxd.__file__).parent}")
    rnd = random.Random(0)
    root = Path(tempfile.mkdtemp(prefix="mlxd-lookup-"))
    n_tok = args.prompt_tokens
    stored: list[list[int]] = []
    try:
        probe = write_block(root, [1])
        reader = SsdReader(probe.namespace, root / "ns", probe.layout, 256, True, SsdStats(),
                           lambda names: None)
        try:
            from mlxd.engine.kv.tail_index import TailIndex
        except ImportError:  # an older tree: no tail index
            TailIndex = None  # type: ignore[assignment,misc]
        for target in (int(x) for x in args.stored.split(",")):
            while len(stored) < target:
                toks = [rnd.randrange(49_000) for _ in range(n_tok + 1)]
                write_block(root, toks[:n_tok - 1])  # the prompt boundary
                write_block(root, toks)  # the history
                stored.append(toks)
            fresh = [[rnd.randrange(49_000) for _ in range(n_tok)] for _ in range(args.lookups)]
            again = [s[:n_tok] for s in rnd.sample(stored, min(len(stored), args.lookups))]
            readers = [("on disk", reader)]
            if TailIndex is not None:  # the tail index, as an engine has it after its scan
                tails = TailIndex(256)
                t0 = time.perf_counter()
                tails.scan(root / "ns")
                scan_ms = (time.perf_counter() - t0) * 1e3
                indexed = SsdReader(probe.namespace, root / "ns", probe.layout, 256, True,
                                    SsdStats(), lambda names: None, tails)
                readers.append((f"tail index ({tails.count} tails, scanned in {scan_ms:.0f} ms)",
                                indexed))
            for label, r in readers:
                miss, hit = _times(r, fresh), _times(r, again)
                print(f"{len(stored):6d} stored prompts, {label}: miss "
                      f"{statistics.median(miss) * 1e3:.3f} ms"
                      + (f", hit {statistics.median(hit) * 1e3:.3f} ms" if hit else "")
                      + " a lookup (median)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _times(reader: object, prompts: list[list[int]]) -> list[float]:
    out = []
    for p in prompts:
        t = time.perf_counter()
        reader.better_than_ram(p, 0)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t)
    return out


if __name__ == "__main__":
    main()
