"""Engine process entry: `python -m mlxd.engine`, spawned by the supervisor, which writes its
`EngineLaunch` on stdin."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import zmq

from mlxd.engine.load import transformers_index
from mlxd.protocol import codec, faults, stage_trace
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.lifeline import follow_parent
from mlxd.protocol.logs import child_process_setup
from mlxd.protocol.models import model_id
from mlxd.protocol.settings import EngineLaunch


def main() -> int:
    launch = codec.read_launch(EngineLaunch)
    transformers_index.install(Path(launch.cache_dir))  # before the service's imports
    from mlxd.engine.service import EngineService
    follow_parent(launch.lifeline_fd)
    stage_trace.configure(launch.tuning.stage_trace)
    child_process_setup(launch.log_level, f"engine:{model_id(launch.model)}#{launch.epoch}",
                        launch.log_format)
    faults.configure(launch.epoch, launch.tuning.faults)
    ctx = zmq.Context()
    service = EngineService(launch, Endpoints.ipc(Path(launch.run_dir)), ctx, supervised=True)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    code = service.run()
    ctx.term()
    return code


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: by now the service has stopped its threads,
    flushed its caches and closed its sockets and shared memory. MLX's static objects torn
    down at the interpreter's exit raced a thread that had run MLX work (the admission lane
    that runs a vision tower) and aborted the process ("terminate called without an active
    exception"), which a Mac reports as a crash of every engine stopped after an image."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
