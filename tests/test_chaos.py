"""A bounded chaos run in CI: benchmarks/soak.py for under a minute with concurrent streams,
fuzzed requests and random SIGKILL / SIGSTOP of the engine, the storage worker and the proxy.
Every failure counts: no stream may get a non-200, an in-band error, wrong text or hang (the
only loss allowed is a connection a killed proxy drops), no fuzzed request may get a 5xx, the
model must not end `failed`, the supervisor must survive and leave nothing behind, and the
model must serve the reference text again after the last kill.
(`python benchmarks/soak.py` runs the long version, with the same gate.)"""

from __future__ import annotations

import importlib.util
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


def _soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_soak_gate_counts_every_failure():
    """soak.py's pass condition, failure by failure (the run above only sees the ones it met)."""
    soak = _soak()
    serving = {"serving": True, "parked": False}
    assert soak.passed(soak.Counts(streams_ok=10, dropped_by_proxy_death=3), serving, True, 0,
                       [], [])
    for failure in ("stream_errors", "wrong_text", "hangs", "fuzz_problems", "fuzz_hangs"):
        assert not soak.passed(soak.Counts(**{failure: 1}), serving, True, 0, [], []), failure
    parked = {"serving": False, "parked": True, "error": "crashed 5 times in 60 s"}
    assert not soak.passed(soak.Counts(), parked, True, 0, [], [])
    assert not soak.passed(soak.Counts(), {"serving": False, "parked": False}, True, 0, [], [])
    assert not soak.passed(soak.Counts(), serving, False, 0, [], [])
    assert not soak.passed(soak.Counts(), serving, True, 1, [], [])
    assert not soak.passed(soak.Counts(), serving, True, 0, ["/mlxd-x"], [])
    assert not soak.passed(soak.Counts(), serving, True, 0, [], [123])
