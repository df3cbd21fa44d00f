"""A bounded chaos run in CI: benchmarks/soak.py for under a minute with concurrent streams,
fuzzed requests and random SIGKILL / SIGSTOP of the engine, the storage worker and the proxy.
No stream may get wrong text or hang, no fuzzed request may get a 5xx, the supervisor must
survive and leave nothing behind, and the daemon must answer again after the last kill.
(`python benchmarks/soak.py` runs the long version.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_chaos_run_loses_no_work(tmp_path):
    out = tmp_path / "chaos"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "0.6",
         "--streams", "6", "--kill-every", "4", "--stop-share", "0.3", "--fuzz-per-s", "6",
         "--hang-timeout", "3", "--request-timeout", "90", "--seed", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=280)
    summary = json.loads(out.with_suffix(".json").read_text())["summary"] \
        if out.with_suffix(".json").exists() else None
    assert summary is not None, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0, json.dumps(summary, indent=1)
    assert summary["kills"] >= 5 and summary["streams_ok"] >= 20
    assert summary["wrong_text"] == 0 and summary["hangs"] == 0
    assert summary["fuzz_requests"] >= 50 and summary["fuzz_5xx"] == 0
    assert summary["supervisor_survived"] and summary["exit_code"] == 0
    # the daemon answers after the chaos: its model serves, or the breaker parked it and says so
    assert summary["recovery"]["serving"] or summary["recovery"]["parked"], summary["recovery"]
    assert not summary["left_segments"] and not summary["left_processes"]
