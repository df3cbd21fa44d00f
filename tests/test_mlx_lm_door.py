"""The one door to mlx-lm's internals (`engine/mlx_lm_internals.py`) as a user meets it: an
engine started on an mlx-lm it was not written for fails at start with one line naming the
versions, is not retried, and requests get that line instead of a crash deep in a step."""

from __future__ import annotations

from pathlib import Path

from conftest import start_daemon, stop_and_check

CHAT = [{"role": "user", "content": "Hi"}]



def test_an_engine_on_an_untested_mlx_lm_fails_at_start_in_one_line(tiny_model, tmp_path: Path):
    from mlxd.engine.mlx_lm_internals import TESTED_RANGE
    low, high = TESTED_RANGE
    # every process of this daemon sees an mlx-lm that says it is 0.99.0
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import mlx_lm\nmlx_lm.__version__ = '0.99.0'\n")
    d = start_daemon(tiny_model, isolate=True, ready_marker="failed",
                     env={"PYTHONPATH": str(site)})
    try:
        d.wait_until(lambda s: any(c["role"] == "engine" and c["state"] == "failed"
                                   for c in s["children"]), what="the engine child failed")
        st = d.stats()
        error = st["engines"][0]["error"]
        assert "0.99.0" in error and f"mlx-lm>={low},<{high}" in error and "\n" not in error
        child = next(c for c in st["children"] if c["role"] == "engine")
        assert child["restarts"] == 0 and child["last_exit"] == "code 78"  # not retried
        with d.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 503 and "0.99.0" in r.json()["error"]["message"]
        lines = [line for line in d.lines if "model failed to load" in line]
        assert len(lines) == 1 and "Traceback" not in d.log()
    finally:
        stop_and_check(d)
