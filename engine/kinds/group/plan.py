"""The plan of an engine served by a group of processes (`--shard NAME=tensor:N|pipeline:N`):
which ranks run where, the ring backend's host file, each follower's side-channel endpoint and
the command that starts it (locally, or over ssh the way `mlx.launch` does). Pure logic: no
process is started here (`leader.py` does that).

Rank 0 is the engine the proxy talks to; ranks 1..N-1 are followers that repeat rank 0's
generator calls (`log.py`). Hosts come from a hosts file in `mlx.launch`'s JSON format
(`[{"ssh": "mac-1", "ips": ["10.0.0.1"]}, {"ssh": "mac-2", "ips": ["10.0.0.2"]}]`, rank 0
first: the machine the daemon runs on), or, without one, every rank runs on this machine.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Literal

import msgspec

Kind = Literal["tensor", "pipeline"]
Backend = Literal["ring", "nccl"]  # ring: TCP (Thunderbolt, Ethernet); nccl: CUDA GPUs
LOCAL = "127.0.0.1"
RING_PORT = 32323  # mlx.launch's default starting port; remote rank r listens on RING_PORT + r
SIDE_PORT = 32423  # remote follower r takes rank 0's commands on SIDE_PORT + r
NCCL_PORT = 32523  # NCCL's rendezvous at rank 0, for groups across hosts
_LAYOUT = re.compile(r"^(tensor|pipeline):([1-9][0-9]*)$")


class GroupError(ValueError):
    """A shard setting or hosts file that cannot work; said before anything starts."""


@dataclass(frozen=True)
class Layout:
    kind: Kind
    size: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.size}"


def parse_layout(text: str) -> Layout:
    m = _LAYOUT.match(text.strip())
    if m is None:
        raise GroupError(f"shard layout {text!r}: expected tensor:N or pipeline:N (N >= 1)")
    kind: Kind = "tensor" if m.group(1) == "tensor" else "pipeline"
    return Layout(kind, int(m.group(2)))


@dataclass(frozen=True)
class Host:
    ssh: str  # what ssh is given ("" or 127.0.0.1: this machine, no ssh)
    ip: str  # the address the ring and the side channel use

    @property
    def local(self) -> bool:
        return self.ssh in ("", LOCAL, "localhost")


def parse_hosts(text: str) -> list[Host]:
    """A hosts file in mlx.launch's JSON format: a list of {"ssh": NAME, "ips": [IP, ...]}."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise GroupError(f"hosts file: not JSON: {e}") from e
    if not isinstance(data, list) or not data:
        raise GroupError("hosts file: expected a non-empty list of {\"ssh\", \"ips\"} objects")
    hosts = []
    for i, h in enumerate(data):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str):
            raise GroupError(f"hosts file: entry {i} has no \"ssh\" name")
        ips = h.get("ips") or []
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise GroupError(f"hosts file: entry {i}: \"ips\" must be a list of addresses")
        if not ips and h["ssh"] not in ("localhost", LOCAL):
            raise GroupError(f"hosts file: entry {i} ({h['ssh']}): the ring backend needs "
                             "an IP address in \"ips\"")
        hosts.append(Host(h["ssh"], ips[0] if ips else LOCAL))
    return hosts


class FollowerLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What a follower rank is started with, on its stdin (msgpack, then the pipe stays open:
    its end is the sign that rank 0 is gone)."""
    rank: int
    size: int
    layout: str  # "tensor:2"
    model_dir: str  # resolved on rank 0; the same path must hold the model on every host
    dtype: str
    backend: str  # mx.distributed's: "ring" or "nccl"
    bind: str  # the side channel: where this rank binds its PULL socket
    store_bytes: int  # its KV store's cap (log.KvStore)
    log_level: str
    log_format: str
    name: str  # the engine's log name, "engine:MODEL#EPOCH"


@dataclass(frozen=True)
class RankPlan:
    rank: int
    host: Host
    ring: str  # "ip:port" this rank's ring connection listens on
    bind: str  # side channel, bound by the follower (tcp://*:port)
    connect: str  # side channel, as rank 0 connects to it


@dataclass(frozen=True)
class GroupPlan:
    layout: Layout
    ranks: list[RankPlan]
    backend: Backend = "ring"
    nccl_port: int = NCCL_PORT

    @property
    def hostfile(self) -> str:
        """MLX_HOSTFILE's content for the ring backend: each rank's addresses, in rank order."""
        return json.dumps([[r.ring] for r in self.ranks])

    def env(self, rank: int, hostfile_path: str | None, visible: str | None = None,
            attention: str | None = None) -> dict[str, str]:
        """The variables rank `rank` joins the group with, as mlx.launch sets them: MLX_RANK,
        and MLX_HOSTFILE (ring; None: written on the remote host by the start script) or
        NCCL's rendezvous at rank 0 and the rank's GPU (the n-th of `visible`, this
        machine's CUDA_VISIBLE_DEVICES, counting the ranks on the same host); and
        `attention`, rank 0's MLX_CUDA_USE_CUDNN_SDPA (engine/load/cuda_attention.py), so that
        every rank runs the same attention kernels (a remote shell inherits nothing)."""
        env = {"MLX_RANK": str(rank)}
        if attention is not None:
            env["MLX_CUDA_USE_CUDNN_SDPA"] = attention
        if self.backend == "ring":
            if hostfile_path is not None:
                env["MLX_HOSTFILE"] = hostfile_path
            return env
        host = self.ranks[rank].host
        index = sum(1 for r in self.ranks[:rank] if r.host == host)
        devices = (visible or "").split(",") if visible and host.local else []
        env.update({"NCCL_HOST_IP": self.ranks[0].host.ip, "NCCL_PORT": str(self.nccl_port),
                    "MLX_WORLD_SIZE": str(len(self.ranks)),
                    "CUDA_VISIBLE_DEVICES": devices[index] if index < len(devices)
                    else str(index)})
        return env


def plan(layout: Layout, hosts: list[Host] | None, free_ports: list[int] | None = None,
         backend: Backend = "ring") -> GroupPlan:
    """Ranks over `hosts` (None: all on this machine). Local groups use `free_ports` (2 per
    rank: ring, then side channel, and one more for NCCL), which the caller picks free just
    before starting; remote ones the fixed port ranges, which the hosts' firewalls must open."""
    n = layout.size
    if hosts is None:
        hosts = [Host("", LOCAL)] * n
    if len(hosts) != n:
        raise GroupError(f"{layout} needs {n} hosts; the hosts file names {len(hosts)}")
    local = free_ports is not None and all(x.local for x in hosts)
    ranks = []
    for r, h in enumerate(hosts):
        if local:
            assert free_ports is not None
            ring_port, side_port = free_ports[2 * r], free_ports[2 * r + 1]
        else:
            ring_port, side_port = RING_PORT + r, SIDE_PORT + r
        ranks.append(RankPlan(r, h, f"{h.ip}:{ring_port}", f"tcp://*:{side_port}",
                              f"tcp://{h.ip}:{side_port}"))
    nccl = free_ports[2 * n] if local and free_ports and len(free_ports) > 2 * n else NCCL_PORT
    return GroupPlan(layout, ranks, backend, nccl)


def follower_command(python: str, rank: RankPlan, env: dict[str, str], hostfile: str,
                     cwd: str) -> list[str]:
    """The argv that starts follower `rank` with `env` (GroupPlan.env): this Python, here; on
    another host through ssh, in the same working directory when it exists there, with the
    ring's host file written there by the script when `env` names none (as mlx.launch does)."""
    module = [python, "-m", "mlxd.engine.kinds.group.follower"]
    if rank.host.local:
        return ["/usr/bin/env", *(f"{k}={v}" for k, v in env.items()), *module]
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
    if "MLX_HOSTFILE" not in env and "NCCL_HOST_IP" not in env:
        exports += (f"fname=$(mktemp); echo {shlex.quote(hostfile)} > $fname; "
                    "export MLX_HOSTFILE=$fname; ")
    script = f"if [[ -d {shlex.quote(cwd)} ]]; then cd {shlex.quote(cwd)}; fi; {exports}" \
             f"exec {shlex.join(module)}"
    # no -tt: rank 0's end of stdin closing must reach the follower as end of input
    return ["ssh", "-o", "BatchMode=yes", "-o", "LogLevel=QUIET", rank.host.ssh,
            f"bash -c {shlex.quote(script)}"]
