"""Engine process entry: `python -m mlxd.engine --run-dir DIR --engine-id ID --epoch N ...`."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import zmq

from mlxd.engine.service import EngineService, EngineSettings
from mlxd.protocol import faults
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.logs import child_process_setup
from mlxd.protocol.models import model_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxd.engine")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--epoch", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache-dir", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--prompt-cache", type=float, default=4.0)
    ap.add_argument("--ssd-cache", type=Path, default=None)
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--kv-slots", type=int, default=16)
    ap.add_argument("--ssd-verify", default="on")
    ap.add_argument("--generation-checkpoint", type=int, default=0)
    args = ap.parse_args(argv)
    child_process_setup(args.log_level, f"engine:{model_id(args.model)}#{args.epoch}")
    faults.configure(args.epoch)
    settings = EngineSettings(args.engine_id, args.epoch, args.model, args.cache_dir,
                              args.batch, args.prefill_step, args.dtype, args.prompt_cache,
                              args.run_dir, args.ssd_cache, args.block_tokens, args.kv_slots,
                              args.ssd_verify == "on", args.generation_checkpoint)
    ctx = zmq.Context()
    service = EngineService(settings, Endpoints.ipc(args.run_dir), ctx, supervised=True)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    code = service.run()
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
