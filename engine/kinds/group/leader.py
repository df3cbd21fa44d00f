"""Rank 0 of a sharded engine: it starts the follower ranks, joins the group, loads its shard
and sends its generator calls to the followers (`log.py`).

Supervision is the engine's: rank 0 is the supervisor's engine child and the followers are
rank 0's children. A follower that exits takes rank 0 down with it (a watcher thread ends the
process, CRASH), so the supervisor restarts the whole group under a new epoch and the proxy
resumes its requests; a follower that hangs stalls rank 0's steps in a collective, and the
supervisor's hang watchdog kills rank 0. A follower's stdin is a pipe from rank 0: when rank 0
is gone, for whatever reason, the follower's input ends and it exits (`follower.py`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq

from mlxd.engine.admit import prepare as admission
from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.rows import Row
from mlxd.engine.batch.runner import Runner
from mlxd.engine.kinds.group.log import (
    Command,
    GNew,
    GStop,
    LeaderGenerator,
    Notes,
    ProbeModel,
    encode,
)
from mlxd.engine.kinds.group.plan import (
    Backend,
    FollowerLaunch,
    GroupError,
    GroupPlan,
    Layout,
    parse_hosts,
    parse_layout,
    plan,
)
from mlxd.protocol import exit_codes
from mlxd.protocol.messages import Delta, Generate
from mlxd.protocol.models import model_id
from mlxd.protocol.settings import PROMPT_CACHE_GROUP_GB, EngineLaunch

log = logging.getLogger("mlxd.engine")

STOP_WAIT_S = 5.0  # a follower told to stop gets this long before it is killed


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """Linux: a local follower gets SIGKILL when rank 0 dies, even stopped or stuck in a
    collective (elsewhere the end of its stdin tells it)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


def backend_here() -> Backend:
    """NCCL where MLX runs on CUDA GPUs (and has NCCL), else the ring backend over TCP."""
    import mlx.core as mx
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and mx.distributed.is_available("nccl"):
        return "nccl"
    return "ring"


def check_model(model_dir: Path, layout: Layout) -> dict:
    """The model's config, if mlx-lm can split this model this way (GroupError if not), before
    any rank is started."""
    import sys as _sys

    from mlxd.engine.mlx_lm_internals import model_classes
    try:
        config = json.loads((model_dir / "config.json").read_text())
        model_class = model_classes(config)[0]
    except (OSError, ValueError) as e:
        raise GroupError(f"cannot read the model's config: {e}") from e
    kind, n = layout.kind, layout.size
    if kind == "tensor":
        if not hasattr(model_class, "shard"):
            raise GroupError(f"{config.get('model_type')} models have no tensor-parallel "
                             "split in mlx-lm")
        heads = config.get("num_attention_heads", 0)
        kv = config.get("num_key_value_heads", heads)
        if not heads or heads % n or kv % n:
            raise GroupError(f"the model's {heads} attention heads and {kv} KV "
                             f"heads must both divide by {n}")
    else:
        module = _sys.modules[model_class.__module__]
        if not any(hasattr(getattr(module, name), "pipeline") for name in dir(module)
                   if isinstance(getattr(module, name), type)):
            raise GroupError(f"{config.get('model_type')} models have no pipeline split in "
                             "mlx-lm")
        layers = config.get("num_hidden_layers", 0)
        if layers and layers < n:
            raise GroupError(f"the model has only {layers} layers for {n} ranks")
    return config


def load_shard(model_dir: str, dtype: str, layout: Layout, group: Any) -> tuple[Any, Any, dict]:
    """This rank's shard of the model (mlx-lm's `shard` / `pipeline`), weights read after the
    split so that a rank only reads what it keeps."""
    import mlx.core as mx
    import mlx_lm

    from mlxd.engine.load.loader import _cast_for_device
    config = check_model(Path(model_dir), layout)
    model, tokenizer = mlx_lm.load(model_dir, lazy=True)[:2]
    if layout.kind == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    _cast_for_device(model, dtype)
    mx.eval(model.parameters())
    return model, tokenizer, config


def start_group(launch: EngineLaunch, model_dir: Path, supervised: bool) -> GroupLeader:
    """Rank 0's group, its followers started (ModelLoadError when it cannot be)."""
    from mlxd.engine.load.loader import ModelLoadError
    if not supervised:
        raise ModelLoadError("a sharded engine (--shard) runs only with --isolate")
    try:
        check_model(model_dir, parse_layout(launch.group))
        leader = GroupLeader(launch, model_dir)
        leader.start()
    except (GroupError, OSError) as e:
        raise ModelLoadError(f"sharded engine ({launch.group}): {e}") from e
    return leader


class GroupLeader:
    def __init__(self, launch: EngineLaunch, model_dir: Path) -> None:
        self.launch = launch
        self.layout = parse_layout(launch.group)
        hosts = None
        if launch.group_hosts:
            hosts = parse_hosts(Path(launch.group_hosts).read_text())
        local = hosts is None or all(h.local for h in hosts)
        if not local and shutil.which("ssh") is None:
            raise GroupError("the hosts file names other machines, and there is no ssh here")
        self.plan: GroupPlan = plan(self.layout, hosts,
                                    free_ports(2 * self.layout.size + 1) if local else None,
                                    backend_here())
        self.model_dir = str(model_dir)
        self.notes = Notes()
        self.eos: list[int] = []  # the model's end tokens: the runner's stop sequences
        # a follower's KV store: rank 0's RAM prefix cache, and room for what else rank 0
        # takes out of its generator (prefill groups' prompts, checkpoints)
        cache = launch.settings.prompt_cache_bytes
        cache = int(PROMPT_CACHE_GROUP_GB * 2**30) if cache is None else cache
        self.store_bytes = int(1.5 * cache) + (256 << 20)
        self.hostfile = Path(launch.run_dir) / f"group-{launch.engine_id}-{launch.epoch}.json"
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stopping = threading.Event()
        self._ctx: zmq.Context | None = None
        self._socks: list[zmq.Socket] = []

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start ranks 1..N-1 (they wait for rank 0 in the ring's set-up)."""
        from mlxd.engine.kinds.group.plan import follower_command
        from mlxd.engine.load import cuda_attention
        fd = os.open(self.hostfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # run dir:
        with os.fdopen(fd, "w") as f:  # every file there is private
            f.write(self.plan.hostfile)
        launch = self.launch
        name = f"engine:{model_id(launch.model)}#{launch.epoch}"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        for rank in self.plan.ranks[1:]:
            env = self.plan.env(rank.rank, str(self.hostfile) if rank.host.local else None,
                                visible, attention=os.environ.get(cuda_attention.ENV, "1"))
            cmd = follower_command(sys.executable, rank, env, self.plan.hostfile, os.getcwd())
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                    preexec_fn=_die_with_parent if rank.host.local else None)
            data = msgspec.msgpack.encode(FollowerLaunch(
                rank=rank.rank, size=self.layout.size, layout=str(self.layout),
                model_dir=self.model_dir, dtype=launch.settings.dtype,
                backend=self.plan.backend, bind=rank.bind, store_bytes=self.store_bytes,
                log_level=launch.log_level, log_format=launch.log_format, name=name))
            assert proc.stdin is not None
            proc.stdin.write(struct.pack(">I", len(data)) + data)
            proc.stdin.flush()  # and kept open: its end tells the follower rank 0 is gone
            self.procs.append(proc)
            threading.Thread(target=self._watch, args=(rank.rank, proc),
                             name=f"group-rank{rank.rank}", daemon=True).start()
        log.info("sharded engine %s: %d ranks (%s), followers started: %s", name,
                 self.layout.size, self.layout,
                 ", ".join(f"rank {r.rank} pid {p.pid} on {r.host.ssh or 'this machine'}"
                           for r, p in zip(self.plan.ranks[1:], self.procs, strict=True)))

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._stopping.is_set():
            return
        log.error("rank %d of the sharded engine exited (code %s): the group goes down and "
                  "is restarted", rank, code)
        self._kill_followers()
        self.hostfile.unlink(missing_ok=True)
        os._exit(exit_codes.CRASH)

    def join(self) -> Any:
        """Join the group as rank 0 (blocks until every rank is up)."""
        import mlx.core as mx
        env = self.plan.env(0, str(self.hostfile))
        env.pop("CUDA_VISIBLE_DEVICES", None)  # rank 0 keeps the device it was started with
        os.environ.update(env)
        try:
            group = mx.distributed.init(strict=True, backend=self.plan.backend)
        finally:
            self.hostfile.unlink(missing_ok=True)  # every rank has read it by now
        if group.size() != self.layout.size:
            raise GroupError(f"the group has {group.size()} ranks, not {self.layout.size}")
        self._ctx = zmq.Context()
        for rank in self.plan.ranks[1:]:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(rank.connect)
            self._socks.append(s)
        return group

    def load(self) -> tuple[Any, Any, dict]:
        from mlxd.engine.load.loader import ModelLoadError
        try:
            group = self.join()
            return load_shard(self.model_dir, self.launch.settings.dtype, self.layout, group)
        except Exception as e:
            raise ModelLoadError(f"sharded engine ({self.layout}): {e}") from e

    # ------------------------------------------------------------------ the log

    def send(self, cmd: Command) -> None:
        data = encode(cmd)
        for s in self._socks:
            s.send(data, copy=False)

    def probe_model(self, model: Any, loaded: Any) -> ProbeModel:
        """The model for start-up forward passes, which the followers repeat."""
        self.eos = sorted(loaded.eos_ids)
        return ProbeModel(model, self.send)

    def prepare(self, msg: Generate, model: Any, received_at: float) -> Admitted | Answered:
        """Admission as for one engine, and a note of what each row's sampler and processors
        were built from, for the followers to build theirs the same way."""
        if msg.adapter or getattr(msg, "images", None):
            return Answered([Delta(msg.request_id, finish_reason="error",
                                   error_code="invalid_request",
                                   error="a sharded engine serves its base model only, "
                                         "without adapters or images")])
        result = admission.prepare(msg, model, lambda _: None, received_at)
        if isinstance(result, Admitted):
            self.notes.note(msg.request_id, msg.sampling, len(msg.resume_token_ids),
                            msg.grammar)
        return result

    def runner_class(self) -> type[Runner]:
        leader = self

        class GroupRunner(Runner):
            """Rank 0's runner: its generator's calls go to the followers first."""
            segmented = False
            adaptive_chunks = False
            auto_cache = False

            def _new_generator(self) -> Any:
                gen = super()._new_generator()
                leader.send(GNew(gen.completion_batch_size, gen.prefill_batch_size,
                                 gen.prefill_step_size, leader.eos))
                return LeaderGenerator(gen, leader.send, leader.broken)

            def _insert(self, add: AddRequest, shared: Any = None,
                        floor: int | None = None, extra_points: Any = ()) -> Row:
                gen: Any = self._gen  # a LeaderGenerator (see _new_generator)
                gen.next_rows = [leader.notes.take(add.request_id)]
                return super()._insert(add, shared, floor, extra_points)

            def _abort(self, rids: list[str]) -> None:
                super()._abort(rids)
                for rid in rids:  # those never inserted: their notes go too
                    leader.notes.take(rid)

            def _fail_all(self, message: str, held: bool = True) -> None:
                waiting = self.waiting_ids(held)
                super()._fail_all(message, held)
                for rid in waiting:
                    leader.notes.take(rid)

        return GroupRunner

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        """Stop every follower: told to, then killed after STOP_WAIT_S."""
        self._stopping.set()
        try:
            self.send(GStop())
        except zmq.ZMQError:
            pass
        for p in self.procs:
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in self._socks:
            s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self.hostfile.unlink(missing_ok=True)

    def broken(self, error: BaseException) -> None:
        """A generator call failed on rank 0: the ranks are out of step (a follower that died
        mid-step shows first as a lost connection, before its exit is seen)."""
        if self._stopping.is_set():
            return
        log.error("a step of the sharded engine failed (%s): the group goes down and is "
                  "restarted", error)
        self._kill_followers()
        self.hostfile.unlink(missing_ok=True)
        os._exit(exit_codes.CRASH)

    def _kill_followers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
