"""Two variants of benchmarks/agent_session.py's runs on one trace, compared turn by turn.

A first token sent sooner moves time from before it to after it, so a per-turn decode rate
(tokens after the first over the time after the first) drops although no later token comes
later; what the user waits for is the first token and the answer's end. This pairs the same
turn (session, turn index; the first turn left out) of runs A_i and B_i, the i-th file of
each list (run them alternated: A1 B1 A2 B2 ...), and reports B / A for each turn's first
token and its end (`total_s`), per pair and over all turns (median, quartiles), the session
wall, and the change in the time after the first token.

    MLXD_EARLY_FIRST_TOKEN=0 python benchmarks/agent_session.py --model tiny --scale 0.3 \\
        --sessions 2 --reps 1 --configs mlxd-openai --no-inprocess --out off-1.json
    python benchmarks/agent_session.py ... --out on-1.json     # and so on, alternated
    python benchmarks/agent_compare.py --a off-1.json,off-2.json --b on-1.json,on-2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def turns(path: Path, config: str) -> tuple[float, dict[tuple[int, int], dict]]:
    """A results file's first run of `config`: its wall time and its turns after the first."""
    run = json.loads(path.read_text())["runs"][config][0]
    return run["wall_s"], {(s["session"], t["turn"]): t for s in run["sessions"]
                           for t in s["turns"] if t["turn"] > 0}


def compare(a_files: list[Path], b_files: list[Path], config: str) -> list[str]:
    lines = [f"B / A per turn ({config}; A: {', '.join(p.name for p in a_files)}; "
             f"B: {', '.join(p.name for p in b_files)})", "",
             "| pair | turns | first token | answer's end | time after the first token, "
             "B - A ms | session wall |", "|---|---|---|---|---|---|"]
    every: dict[str, list[float]] = {"ttft_s": [], "total_s": []}
    for i, (fa, fb) in enumerate(zip(a_files, b_files, strict=True), 1):
        wall_a, a = turns(fa, config)
        wall_b, b = turns(fb, config)
        both = [k for k in a if k in b]
        ratios = {key: [b[k][key] / a[k][key] for k in both] for key in every}
        for key, rs in ratios.items():
            every[key] += rs
        after = [(b[k]["total_s"] - b[k]["ttft_s"]) - (a[k]["total_s"] - a[k]["ttft_s"])
                 for k in both]
        lines.append(f"| {i} | {len(both)} | {statistics.median(ratios['ttft_s']):.3f} | "
                     f"{statistics.median(ratios['total_s']):.3f} | "
                     f"{statistics.median(after) * 1e3:+.1f} | {wall_b / wall_a:.3f} |")
    for key, name in (("ttft_s", "first token"), ("total_s", "answer's end")):
        q = statistics.quantiles(every[key], n=4)
        lines.append(f"\nAll {len(every[key])} turns, {name}: median {q[1]:.3f}, "
                     f"quartiles {q[0]:.3f}-{q[2]:.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="comma-separated results files, variant A")
    ap.add_argument("--b", required=True, help="comma-separated results files, variant B")
    ap.add_argument("--config", default="mlxd-openai")
    args = ap.parse_args()
    a = [Path(p) for p in args.a.split(",")]
    b = [Path(p) for p in args.b.split(",")]
    print("\n".join(compare(a, b, args.config)))


if __name__ == "__main__":
    main()
