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


def test_proxy_intake_smoke(tmp_path):
    """--intake: every one-token request of every burst gets its token, and the proxy's own
    CPU per request is read (80 requests: more than the 10 ms the kernel counts CPU in)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "proxy_relay.py"), "--intake", "--streams",
         "8", "--rounds", "10", "--client-procs", "1"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["burst"], x["requests"]) for x in rows] == [(8, 80)]
    assert rows[0]["proxy_cpu_ms_per_request"] > 0


def test_burst_harness_smoke(tmp_path):
    """burst.py joins the client's, the proxy's and the engine's stamps of every request (the
    client in its own process, the stage clock on in the daemon) into its table."""
    out = tmp_path / "burst.md"
    dump = tmp_path / "burst.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "burst.py"), "--shape", "tiny", "--streams",
         "4", "--rounds", "1", "--max-tokens", "4", "--out", str(out), "--dump", str(dump)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    [burst] = [b for b in json.loads(dump.read_text()) if b["streams"] == 4]
    assert len(burst["requests"]) == 4
    order = ["client_sent", "proxy_in", "sending", "engine_in", "lane", "tokenized",
             "restore_checked", "prepared", "taken", "inserted", "read_back"]
    for req in burst["requests"]:
        # every stage up to the insert stamped, by one clock, in order; the first token's
        # read-back too where the random model's first token was not an end (it has no text)
        assert all(k in req for k in order[:10]), req
        times = [req[k] for k in order if k in req]
        assert times == sorted(times), req
        # the proxy's write and the client's read both follow the read-back (the client may
        # read before the proxy's `await write` returns and stamps it: no order between them)
        for later in ("written", "client_event", "client_first"):
            if later in req and "read_back" in req:
                assert req[later] >= req["read_back"], req
        # the role chunk is held back until the first token, so it comes with or before text
        assert "client_event" in req and req["client_event"] <= req.get("client_first", 1e9)
    assert any(all(k in req for k in [*order, "written", "client_event"])
               for req in burst["requests"])
