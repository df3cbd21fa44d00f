"""Storage worker entry: `python -m mlxd.storage_worker --run-dir DIR --root SSD_DIR ...`."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import zmq

from mlxd.protocol import faults
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.logs import child_process_setup
from mlxd.storage_worker.worker import StorageWorker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxd.storage_worker")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--max-gb", type=float, default=20.0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--supervised", action="store_true")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    child_process_setup(args.log_level, f"storage#{args.epoch}")
    faults.configure(args.epoch)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    eps = Endpoints.ipc(args.run_dir)
    ctx = zmq.Context()
    worker = StorageWorker(args.root, int(args.max_gb * 2**30), ctx, eps.storage,
                           eps.control if args.supervised else None, args.epoch)
    try:
        return worker.run()
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
