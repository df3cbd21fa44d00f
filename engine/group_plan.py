"""The plan of an engine served by a group of processes (`--shard NAME=tensor:N|pipeline:N`):
which ranks run where, the ring backend's host file, each follower's side-channel endpoint and
the command that starts it (locally, or over ssh the way `mlx.launch` does). Pure logic: no
process is started here (`group_leader.py` does that).

Rank 0 is the engine the proxy talks to; ranks 1..N-1 are followers that repeat rank 0's
generator calls (`group_log.py`). Hosts come from a hosts file in `mlx.launch`'s JSON format
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
LOCAL = "127.0.0.1"
RING_PORT = 32323  # mlx.launch's default starting port; remote rank r listens on RING_PORT + r
SIDE_PORT = 32423  # remote follower r takes rank 0's commands on SIDE_PORT + r
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
    bind: str  # the side channel: where this rank binds its PULL socket
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

    @property
    def hostfile(self) -> str:
        """MLX_HOSTFILE's content for the ring backend: each rank's addresses, in rank order."""
        return json.dumps([[r.ring] for r in self.ranks])


def plan(layout: Layout, hosts: list[Host] | None, free_ports: list[int] | None = None
         ) -> GroupPlan:
    """Ranks over `hosts` (None: all on this machine). Local groups use `free_ports` (2 per
    rank: ring, then side channel), which the caller picks free just before starting; remote
    ones the fixed RING_PORT/SIDE_PORT ranges, which the hosts' firewalls must open."""
    n = layout.size
    if hosts is None:
        hosts = [Host("", LOCAL)] * n
    if len(hosts) != n:
        raise GroupError(f"{layout} needs {n} hosts; the hosts file names {len(hosts)}")
    ranks = []
    for r, h in enumerate(hosts):
        if free_ports is not None and all(x.local for x in hosts):
            ring_port, side_port = free_ports[2 * r], free_ports[2 * r + 1]
        else:
            ring_port, side_port = RING_PORT + r, SIDE_PORT + r
        ranks.append(RankPlan(r, h, f"{h.ip}:{ring_port}", f"tcp://*:{side_port}",
                              f"tcp://{h.ip}:{side_port}"))
    return GroupPlan(layout, ranks)


def follower_command(python: str, rank: RankPlan, hostfile_path: str, hostfile: str,
                     cwd: str) -> list[str]:
    """The argv that starts follower `rank`: this Python with MLX_RANK and MLX_HOSTFILE set;
    on another host through ssh, with the host file written there by the script (as
    mlx.launch does), in the same working directory when it exists there."""
    module = [python, "-m", "mlxd.engine.group_follower"]
    env = f"export MLX_RANK={rank.rank}; "
    if rank.host.local:
        return ["/usr/bin/env", f"MLX_RANK={rank.rank}", f"MLX_HOSTFILE={hostfile_path}",
                *module]
    script = (f"if [[ -d {shlex.quote(cwd)} ]]; then cd {shlex.quote(cwd)}; fi; "
              f"fname=$(mktemp); echo {shlex.quote(hostfile)} > $fname; "
              f"export MLX_HOSTFILE=$fname; {env}exec {shlex.join(module)}")
    # no -tt: rank 0's end of stdin closing must reach the follower as end of input
    return ["ssh", "-o", "BatchMode=yes", "-o", "LogLevel=QUIET", rank.host.ssh,
            f"bash -c {shlex.quote(script)}"]
