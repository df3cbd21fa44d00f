"""A follower rank of a sharded engine: `python -m mlxd.engine.kinds.group.follower`, started by
rank 0 (`leader.py`), locally or over ssh, with MLX_RANK and MLX_HOSTFILE set.

It reads its `FollowerLaunch` from stdin (4-byte length, msgpack) and keeps reading: the end of
its input means rank 0 is gone, and it exits at once. It joins the group, loads its shard, binds
its side-channel socket and repeats rank 0's generator calls until told to stop.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading

import msgspec
import zmq

from mlxd.engine.kinds.group.log import Desync, Follower, decode
from mlxd.engine.kinds.group.plan import FollowerLaunch, parse_layout
from mlxd.engine.load import cuda_attention
from mlxd.protocol import exit_codes
from mlxd.protocol.logs import child_process_setup

log = logging.getLogger("mlxd.engine")


def _read_launch() -> FollowerLaunch:
    head = sys.stdin.buffer.read(4)
    if len(head) < 4:
        sys.exit(exit_codes.PARENT_GONE)
    (n,) = struct.unpack(">I", head)
    return msgspec.msgpack.decode(sys.stdin.buffer.read(n), type=FollowerLaunch)


def _watch_stdin() -> None:
    """Rank 0 holds the other end of stdin: when it is closed, rank 0 is gone."""
    while sys.stdin.buffer.read(1 << 16):
        pass
    os._exit(exit_codes.PARENT_GONE)


def main() -> int:
    launch = _read_launch()
    child_process_setup(launch.log_level, f"{launch.name}/rank{launch.rank}",
                        launch.log_format)  # type: ignore[arg-type]
    threading.Thread(target=_watch_stdin, name="rank0-watch", daemon=True).start()
    cuda_attention.apply()  # rank 0 passes its own setting; this is the default without it
    import mlx.core as mx

    from mlxd.engine.kinds.group.leader import load_shard
    group = mx.distributed.init(strict=True, backend=launch.backend)
    model, tokenizer, config = load_shard(launch.model_dir, launch.dtype,
                                          parse_layout(launch.layout), group)
    cuda_attention.install(model)  # as rank 0's runner routes its passes
    grammar_tokenizer = None
    try:
        from mlxd.engine.grammar.processor import TokenizerCache
        from mlxd.engine.mlx_lm_internals import hf_tokenizer
        grammar_tokenizer = TokenizerCache(
            hf_tokenizer(tokenizer), int(config.get("vocab_size") or len(tokenizer)),
            sorted(tokenizer.eos_token_ids))
    except Exception as e:  # noqa: BLE001  only constrained requests need it
        log.warning("no grammar tokenizer on this rank: %s", e)
    follower = Follower(model, launch.store_bytes, grammar_tokenizer,
                        stream=mx.new_stream(mx.default_device()))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(launch.bind)
    log.info("rank %d of %d (%s) ready", launch.rank, launch.size, launch.layout)
    code = exit_codes.OK
    try:
        while follower.apply(decode(pull.recv())):
            pass
    except Desync as e:
        log.error("out of step with rank 0: %s", e)
        code = exit_codes.CRASH
    finally:
        pull.close(linger=0)
        ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
