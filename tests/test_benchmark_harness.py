"""The throughput harness in its tiny CPU form: it runs end to end and writes its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_throughput_harness_smoke(tmp_path):
    out = tmp_path / "tp"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--shape", "tiny",
         "--concurrency", "1,2", "--max-tokens", "8", "--targets", "inprocess,mlxd-isolate",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    table = out.with_suffix(".md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| inprocess")
            or line.startswith("| mlxd-isolate")]
    assert len(rows) == 4
    for row in rows:
        tok_s = float(row.split("|")[3])
        assert tok_s > 0
    assert out.with_suffix(".png").exists()


def test_proxy_relay_smoke(tmp_path):
    """A real proxy process fed by the fake engine (the real protocol) relays every token."""
    out = tmp_path / "relay.md"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "proxy_relay.py"), "--streams", "1,3",
         "--tokens", "40", "--client-procs", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["streams"], x["relayed_tokens"]) for x in rows] == [(1, 40), (3, 120)]
    assert "| 3 | 40 |" in out.read_text()
