"""Engine process entry: `python -m mlxd.engine`, spawned by the supervisor, which writes its
`EngineLaunch` on stdin."""

from __future__ import annotations

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


if __name__ == "__main__":
    sys.exit(main())
