"""A bounded chaos run in CI: benchmarks/soak.py for under a minute with concurrent streams,
fuzzed requests and random SIGKILL / SIGSTOP of the engine, the storage worker and the proxy.
Every failure counts: no stream may get a non-200, an in-band error, wrong text or hang (the
only loss allowed is a connection a killed proxy drops), no fuzzed request may get a 5xx, the
model must not end `failed`, the supervisor must survive and leave nothing behind, and the
model must serve the reference text again after the last kill.
(`python benchmarks/soak.py` runs the long version, with the same gate.)"""

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
    assert summary["kills"] >= 5 and summary["streams_ok"] >= 20, json.dumps(summary, indent=1)
    assert summary["stream_errors"] == 0, summary["errors"]
    assert summary["wrong_text"] == 0 and summary["hangs"] == 0, summary["errors"]
    assert summary["fuzz_requests"] >= 50, summary
    assert summary["fuzz_problems"] == 0 and summary["fuzz_hangs"] == 0, summary["errors"]
    assert summary["supervisor_survived"] and summary["exit_code"] == 0
    # after the chaos the model serves the reference text again; parked (`failed`) is a failure
    assert summary["recovery"]["serving"], summary["recovery"]
    assert not summary["left_segments"] and not summary["left_processes"]
    assert summary["passed"] and r.returncode == 0, json.dumps(summary, indent=1)
