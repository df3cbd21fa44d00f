"""`mlxd serve` (the default model) from start to first token: cold (empty cache dir, so the
GGUF is converted) and warm (the converted model cached), in one run.

    python benchmarks/startup.py [--isolate]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import free_port


def start_to_first_token(cache_dir: str, isolate: bool) -> float:
    port = free_port()
    argv = [sys.executable, "-m", "mlxd.cli.main", "serve", "--port", str(port), "--cache-dir",
            cache_dir, "--run-dir", tempfile.mkdtemp(prefix="mlxd-bs-", dir="/tmp"),
            "--ssd-cache", "off", "--log-level", "warning"] + (["--isolate"] if isolate else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 1, "stream": True}
        while True:
            try:
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code == 200:
                        for line in r.iter_lines():
                            if '"content": "' in line and '"content": ""' not in line:
                                return time.perf_counter() - t0
                    else:
                        r.read()
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--isolate", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/startup.json"))
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="mlxd-startup-")
    cold = start_to_first_token(cache, args.isolate)
    warm = start_to_first_token(cache, args.isolate)
    result = {"isolate": args.isolate, "cold_s": cold, "warm_s": warm}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
