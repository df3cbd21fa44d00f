"""Storage worker entry: `python -m mlxd.storage_worker`, spawned by the supervisor (or the
one-process server), which writes its `StorageLaunch` on stdin."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import zmq

from mlxd.protocol import codec, faults, stage_trace
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.lifeline import follow_parent
from mlxd.protocol.logs import child_process_setup
from mlxd.protocol.settings import StorageLaunch
from mlxd.storage_worker.worker import StorageWorker


def main() -> int:
    launch = codec.read_launch(StorageLaunch)
    follow_parent(launch.lifeline_fd)
    stage_trace.configure(launch.tuning.stage_trace)
    child_process_setup(launch.log_level, f"storage#{launch.epoch}", launch.log_format)
    faults.configure(launch.epoch, launch.tuning.faults)
    ctx = zmq.Context()
    worker = StorageWorker(launch, ctx, Endpoints.ipc(Path(launch.run_dir)))
    # Not an exit: the engines, signalled with us (a process group's SIGTERM), are flushing
    # through us. An exception raised mid-write would also leave a shared-memory view exported.
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    # The signal's byte wakes the worker's poll at once (else it would notice after its poll's
    # timeout: half a second of every stop).
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    try:
        return worker.run(wake_r)
    finally:
        # A later SIGTERM (the supervisor's, after the group's) must not find the wakeup fd
        # pointing at a closed socket: Python would print its failed write as a traceback.
        signal.set_wakeup_fd(-1)
        wake_w.close()
        wake_r.close()
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
