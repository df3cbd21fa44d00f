"""Where each request's time to first token went, from a stage-clock trace directory
(`MLXD_STAGE_TRACE=DIR` in the daemon's environment; `protocol/stage_trace.py`): per request,
in the order they reached the proxy, the milliseconds between its stages (proxy: the body
read and parsed after the headers, then the request checked and sent; engine I/O
thread, admission lane: templating and tokenizing, the tiers asked, the MLX thread's inbox and
insert) and from its insert to its first token read back, written by the proxy.

    python benchmarks/request_stages.py DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

STAGES = ("http_in", "proxy_in", "sending", "engine_in", "lane", "tokenized", "restore_checked",
          "prepared", "taken", "inserted", "read_back", "written")


def requests(trace_dir: Path) -> list[dict[str, int]]:
    """Each request's stamps (its first token's read-back and write joined in), in the order
    they reached the proxy."""
    from mlxd.protocol.stage_trace import read
    reqs: dict[str, dict[str, int]] = defaultdict(dict)
    for r in read(trace_dir, requests=True):
        reqs[r.request_id].update(r.stamps)
    for r in read(trace_dir):
        if r.index == 1:
            reqs[r.request_id].update({k: v for k, v in r.stamps.items()
                                       if k in ("read_back", "written")})
    rows = [st for st in reqs.values() if "proxy_in" in st]
    return sorted(rows, key=lambda st: st["proxy_in"])


def spans(st: dict[str, int]) -> dict[str, float]:
    """ms from each stage to the next one present."""
    present = [s for s in STAGES if s in st]
    out = {f"{a}->{b}": (st[b] - st[a]) / 1e6
           for a, b in zip(present, present[1:], strict=False)}
    if present and "written" in st:  # from the headers read where the trace has them
        out["total"] = (st["written"] - st[present[0]]) / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = [spans(st) for st in requests(a.trace_dir)]
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)]
    print("| # | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for i, r in enumerate(rows):
        print(f"| {i} | " + " | ".join(f"{r[k]:.1f}" if k in r else "" for k in keys) + " |")
    print("| median | " + " | ".join(
        f"{statistics.median([r[k] for r in rows if k in r]):.1f}" for k in keys) + " |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
