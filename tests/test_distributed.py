"""Issue 18: one pool entry served by a group of processes through mlx.distributed.

The plan and the follower log are tested without processes (a follower replaying rank 0's log
on its own copy of the model makes the same rows and tokens); then a real daemon serves a tiny
model both whole and as a 2-rank tensor-parallel group over the ring backend on localhost:
greedy output is the same token for token, a follower killed with -9 brings the group down and
back up under a new epoch while the stream completes with the same text, and SIGTERM leaves no
rank behind."""

from __future__ import annotations

import json
import os
import shutil
import threading
from typing import Any

import psutil
import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.cli.client import format_status
from mlxd.daemon.group import ShardError, layout_for
from mlxd.engine.kinds.group import log as group_log
from mlxd.engine.kinds.group.log import (
    Follower,
    GInsert,
    GNew,
    GNext,
    KvStore,
    LeaderGenerator,
    Notes,
    Row,
)
from mlxd.engine.kinds.group.plan import (
    FollowerLaunch,
    GroupError,
    Layout,
    follower_command,
    parse_hosts,
    parse_layout,
    plan,
)
from mlxd.protocol.messages import SamplingParams
from support.harness import stream_chat

# ---------------------------------------------------------------------------- the plan


def test_the_id_v1_models_lists_names_a_model_for_shard(tmp_path):
    model = tmp_path / "llama-1b"
    model.mkdir()
    assert layout_for(str(model), {"llama-1b": "tensor:2"}, {}) == "tensor:2"
    assert layout_for(str(model), {"other": "tensor:2"}, {}) == ""


def test_layouts_and_which_engine_is_sharded():
    assert parse_layout("tensor:2") == Layout("tensor", 2)
    assert str(parse_layout(" pipeline:4 ")) == "pipeline:4"
    for bad in ("tensor", "tensor:0", "data:2", "tensor:-1", "tensor:2x"):
        with pytest.raises(GroupError):
            parse_layout(bad)
    aliases = {"big": "/m/llama", "small": "/m/tiny"}
    assert layout_for("/m/llama", {"big": "tensor:2"}, aliases) == "tensor:2"
    assert layout_for("/m/tiny", {"big": "tensor:2"}, aliases) == ""
    assert layout_for("/m/llama", {"/m/llama": "pipeline:2"}, {}) == "pipeline:2"
    assert layout_for("/m/llama", {"big": "tensor:1"}, aliases) == ""  # one rank: whole
    with pytest.raises(ShardError):
        layout_for("/m/llama", {"big": "tensor:2", "/m/llama": "tensor:4"}, aliases)


def test_the_settings_refuse_a_bad_layout_before_anything_starts():
    import msgspec

    from mlxd.protocol.settings import EngineSettings
    ok = msgspec.convert({"shard": {"big": "tensor:2"}}, EngineSettings)
    assert ok.shard == {"big": "tensor:2"}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"shard": {"big": "tensor:two"}}, EngineSettings)


def test_local_plan_ring_hostfile_and_commands():
    p = plan(Layout("tensor", 2), None, [5001, 5002, 5003, 5004, 5005])
    assert json.loads(p.hostfile) == [["127.0.0.1:5001"], ["127.0.0.1:5003"]]
    assert [r.connect for r in p.ranks] == ["tcp://127.0.0.1:5002", "tcp://127.0.0.1:5004"]
    cmd = follower_command("/py", p.ranks[1], p.env(1, "/run/h.json"), p.hostfile, "/w")
    assert cmd == ["/usr/bin/env", "MLX_RANK=1", "MLX_HOSTFILE=/run/h.json", "/py", "-m",
                   "mlxd.engine.kinds.group.follower"]
    # on CUDA GPUs: NCCL's rendezvous at rank 0, one GPU per rank of this machine
    g = plan(Layout("tensor", 2), None, [5001, 5002, 5003, 5004, 5005], backend="nccl")
    assert g.env(1, "/run/h.json", visible="4,5") == {
        "MLX_RANK": "1", "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": "5005",
        "MLX_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "5"}
    assert g.env(1, None)["CUDA_VISIBLE_DEVICES"] == "1"


def test_hosts_file_in_mlx_launch_format_and_ssh_commands():
    hosts = parse_hosts(json.dumps([{"ssh": "localhost", "ips": []},
                                    {"ssh": "mac-2", "ips": ["10.0.0.2", "10.0.1.2"]}]))
    p = plan(Layout("tensor", 2), hosts, [1, 2, 3, 4])  # remote: the fixed port ranges
    assert json.loads(p.hostfile) == [["127.0.0.1:32323"], ["10.0.0.2:32324"]]
    assert p.ranks[1].connect == "tcp://10.0.0.2:32424"
    cmd = follower_command("/py", p.ranks[1], p.env(1, None), p.hostfile, "/w")
    assert cmd[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "LogLevel=QUIET"]
    assert cmd[5] == "mac-2" and "-tt" not in cmd  # its stdin's end must reach the follower
    assert "export MLX_RANK=1" in cmd[6] and "MLX_HOSTFILE=$fname" in cmd[6]
    assert "mlxd.engine.kinds.group.follower" in cmd[6]
    # rank 0's attention kernels (engine/cuda_attention.py) travel to a remote rank too
    cmd = follower_command("/py", p.ranks[1], p.env(1, None, attention="1"), p.hostfile, "/w")
    assert "export MLX_CUDA_USE_CUDNN_SDPA=1" in cmd[6]
    for bad, why in (("[]", "non-empty"), ("{}", "non-empty"), ("nope", "not JSON"),
                     ('[{"ips": ["1.2.3.4"]}]', "ssh"),
                     ('[{"ssh": "mac-2"}]', "IP address")):
        with pytest.raises(GroupError, match=why):
            parse_hosts(bad)
    with pytest.raises(GroupError, match="needs 4 hosts"):
        plan(Layout("tensor", 4), hosts)


def test_the_ssh_start_script_sets_a_remote_rank_up_as_mlx_launch_does(tmp_path):
    """What ssh runs on the other host (here run by the local shell, as the remote login
    shell would): the working directory, MLX_RANK, the ring's host file written there."""
    import subprocess
    fake = tmp_path / "python"  # stands in for the remote Python: says what it was given
    fake.write_text('#!/bin/sh\necho "rank=$MLX_RANK"; echo "file=$MLX_HOSTFILE"; '
                    'cat "$MLX_HOSTFILE"; echo "cwd=$(pwd)"; echo "args=$*"\n')
    fake.chmod(0o755)
    hosts = parse_hosts(json.dumps([{"ssh": "localhost", "ips": []},
                                    {"ssh": "mac-2", "ips": ["10.0.0.2"]}]))
    p = plan(Layout("tensor", 2), hosts)
    cmd = follower_command(str(fake), p.ranks[1], p.env(1, None), p.hostfile, str(tmp_path))
    out = subprocess.run(cmd[-1], shell=True, capture_output=True, text=True, cwd="/",
                         timeout=30).stdout.splitlines()
    hostfile = next(line[5:] for line in out if line.startswith("file="))
    os.unlink(hostfile)
    assert "rank=1" in out and f"cwd={tmp_path}" in out
    assert json.loads(out[2]) == [["127.0.0.1:32323"], ["10.0.0.2:32324"]]
    assert "args=-m mlxd.engine.kinds.group.follower" in out


def test_a_model_that_cannot_be_split_so_is_refused_before_any_rank_starts(tiny_model):
    from mlxd.engine.kinds.group.leader import check_model
    assert check_model(tiny_model, Layout("tensor", 2))["num_key_value_heads"] == 2
    with pytest.raises(GroupError, match="4 attention heads and 2 KV heads must both divide"):
        check_model(tiny_model, Layout("tensor", 4))
    with pytest.raises(GroupError, match="no pipeline split"):  # mlx-lm's llama has none
        check_model(tiny_model, Layout("pipeline", 2))


def test_commands_round_trip_and_follower_launch_is_typed():
    cmds: list[group_log.Command] = [
            GNew(8, 8, 64, [2]), GNext(),
            GInsert([Row([1, 2], [], 5, SamplingParams(temperature=0.7, seed=3), 1, None)], [0])]
    for c in cmds:
        assert group_log.decode(group_log.encode(c)) == c
    launch = FollowerLaunch(rank=1, size=2, layout="tensor:2", model_dir="/m", dtype="auto",
                            backend="ring", bind="tcp://*:1", store_bytes=1 << 30,
                            log_level="info",
                            log_format="text", name="e")
    import msgspec
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(launch), type=FollowerLaunch) == launch


# ---------------------------------------------------------------------------- the log


class _Cache:
    def __init__(self, n):
        import mlx.core as mx
        self.keys = mx.zeros((1, 2, n + 4, 8))
        self.values = mx.zeros((1, 2, n + 4, 8))
        self.offset = n


def test_kv_store_finds_an_entry_that_starts_with_the_prefix_and_evicts_oldest():
    per_token = 2 * 2 * 8 * 4 * 2  # K and V, 2 heads of 8 float32, 2 layers
    store = KvStore(max_bytes=per_token * 10)
    store.add([1, 2, 3, 4], [_Cache(4), _Cache(4)])
    store.add([7, 8, 9], [_Cache(3), _Cache(3)])
    layers = store.find([1, 2, 3])
    assert layers is not None and layers[0][0].shape[2] == 4
    assert store.find([1, 2, 5]) is None
    store.add([5] * 6, [_Cache(6), _Cache(6)])  # over the cap: the least recently used goes
    assert store.find([7, 8]) is None and store.find([1, 2]) is not None
    assert store.bytes <= per_token * 10


def test_notes_are_taken_once_by_request_id():
    notes = Notes()
    notes.note("r1", SamplingParams(temperature=0.5, seed=9), 3, None)
    assert notes.take("r2") == (None, 0, None)
    sampling, resumed, grammar = notes.take("r1")
    assert sampling is not None and sampling.seed == 9 and resumed == 3 and grammar is None
    assert notes.take("r1") == (None, 0, None) and len(notes) == 0


def _leader_and_follower(model_dir):
    """Two copies of one whole model: rank 0's runner over a LeaderGenerator whose log goes
    to a list, and a Follower that replays it (a group of one: no collectives, same logic)."""
    import queue

    import mlx_lm

    from mlxd.engine.batch.runner import Runner
    model_a, tok = mlx_lm.load(str(model_dir))[:2]
    model_b = mlx_lm.load(str(model_dir))[0]
    log: list = []
    notes = Notes()
    eos = sorted(tok.eos_token_ids)

    def send(cmd):
        log.append(group_log.decode(group_log.encode(cmd)))  # as on the wire

    class LeaderRunner(Runner):  # GroupLeader.runner_class's, without the sockets
        def _new_generator(self):
            gen = super()._new_generator()
            send(GNew(gen.completion_batch_size, gen.prefill_batch_size,
                      gen.prefill_step_size, eos))
            return LeaderGenerator(gen, send)

        def _insert(self, add, shared=None, floor=None, extra_points=()):
            gen: Any = self._gen  # the LeaderGenerator made above
            gen.next_rows = [notes.take(add.request_id)]
            return super()._insert(add, shared, floor, extra_points)

    out: queue.Queue = queue.Queue()
    runner = LeaderRunner(model_a, eos, batch_size=4, prefill_step=64, outbox=out,
                          cache_bytes=1 << 24)
    return runner, out, log, notes, Follower(model_b, 1 << 26), tok


def test_a_follower_replaying_the_log_makes_the_same_rows_and_tokens(tiny_model):
    from mlxd.engine.admit.sampling import make_request_processors, make_request_sampler
    from mlxd.engine.batch.messages import AbortRequest, AddRequest, RequestStarted, StepTokens
    runner, out, log, notes, follower, tok = _leader_and_follower(tiny_model)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    started: list[str] = []

    def add(rid, p, sampling, n=12):
        procs = make_request_processors(sampling)
        notes.note(rid, sampling, 0, None)
        runner.inbox.put(AddRequest(rid, list(p), n, make_request_sampler(sampling), procs))

    def pump(done):  # the runner's loop, by hand, until done()
        while not done():
            runner.take_commands()
            if runner.rows:
                runner.step()
            while not out.empty():
                item = out.get()
                if isinstance(item, RequestStarted):
                    started.append(item.request_id)
                if isinstance(item, StepTokens):
                    for rid, t, finish in item.rows:
                        tokens.setdefault(rid, []).append(t)
                        if finish is not None:
                            finished.add(rid)

    add("a", prompt, SamplingParams())
    add("b", prompt[:20], SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2))
    add("c", prompt[:30], SamplingParams(temperature=0.9, seed=6))
    # all three running ("c" past its first token, which goes out a step before the
    # generator returns it: `Runner._send_first_tokens`)
    pump(lambda: len(tokens.get("c", [])) >= 2)
    runner.inbox.put(AbortRequest("c"))
    pump(lambda: finished >= {"a", "b"})
    add("d", prompt + [5], SamplingParams())  # a RAM prefix cache hit on rank 0
    pump(lambda: "d" in finished)
    runner._gen.close()
    inserts = [c for c in log if isinstance(c, GInsert)]
    assert any(r.prefix for c in inserts for r in c.rows), "no cached-prefix insert was logged"
    assert all(r.sampling is not None for c in inserts for r in c.rows)
    uid_of = dict(zip(started, [u for c in inserts for u in c.uids], strict=True))
    # the follower: the same row ids (checked by apply), the same token at every step
    follower_tokens: dict[int, list[int]] = {}
    for cmd in log:
        if isinstance(cmd, GNext):
            _, responses = follower.gen.next()
            for r in responses:
                follower_tokens.setdefault(r.uid, []).append(r.token)
                if r.finish_reason is not None and r.prompt_cache is not None:
                    follower.store.add(list(r.all_tokens), r.prompt_cache)
        else:
            assert follower.apply(cmd)
    assert len(tokens["a"]) == len(tokens["d"]) == 12
    for rid in ("a", "b", "c", "d"):
        assert follower_tokens.get(uid_of[rid], []) == tokens.get(rid, []), rid


def test_a_follower_without_the_cached_prefix_is_out_of_step(tiny_model):
    follower = _leader_and_follower(tiny_model)[4]
    follower.apply(GNew(4, 4, 64, [0]))
    with pytest.raises(group_log.Desync, match="cached prefix"):
        follower.apply(GInsert([Row([9], [1, 2, 3], 4, None)], [0]))


def test_a_groups_kv_blocks_are_keyed_apart_from_the_whole_engines(tiny_model, tmp_path,
                                                                   monkeypatch):
    """The SSD namespace (the root of every block key) of a sharded engine names its layout:
    rank 0's blocks hold its shard of the heads, and a whole engine never reads them."""
    import mlx_lm

    from mlxd.engine.kinds.group.kind import GroupKind
    from mlxd.engine.kinds.text.kind import TextKind
    from mlxd.engine.kv import ssd_tier
    from mlxd.protocol.block_format import namespace_key
    from mlxd.protocol.settings import EngineLaunch, EngineSettings
    seen: list[str] = []
    monkeypatch.setattr(ssd_tier, "SsdTier", lambda **kw: seen.append(kw["description"]))
    model = mlx_lm.load(str(tiny_model))[0]
    for group in ("", "tensor:2", "pipeline:2"):
        launch = EngineLaunch(engine_id="e", epoch=0, model=str(tiny_model),
                              run_dir=str(tmp_path), cache_dir=str(tmp_path),
                              ssd_root=str(tmp_path), log_level="info",
                              settings=EngineSettings(), group=group)
        kind = GroupKind(launch, supervised=True) if group else TextKind(launch)
        ssd_tier.open_ssd_tier(launch, model, None, "ipc://unused",  # type: ignore[arg-type]
                               kind.ssd_namespace())
    whole, tensor, pipeline = seen
    assert "group" not in whole and tensor.endswith("|group tensor:2 rank 0")
    assert len({namespace_key(d) for d in seen}) == 3


# ---------------------------------------------------------------------------- a real group

SLOW = {"MLXD_FAULTS": "engine.step=delay@1#<2"}  # 50 ms steps in epochs 0 and 1
CHATS = [[{"role": "user", "content": f"Tell me story {i} about the sea and the lighthouse."}]
         for i in range(4)]


@pytest.fixture(scope="module")
def group_daemon(tiny_model, tmp_path_factory):
    sharded = tmp_path_factory.mktemp("shard") / "tiny-sharded"
    shutil.copytree(tiny_model, sharded)  # the same weights, served as a 2-rank group
    d = start_daemon(tiny_model, "--model-alias", f"big={sharded}",
                     "--model-alias", f"whole={tiny_model}", "--shard", "big=tensor:2",
                     "--model-pool", "2", "--batch", "8", "--restart-backoff", "0.1",
                     "--hang-timeout", "6",  # a loaded CI machine: no false hangs
                     isolate=True, env=SLOW)
    yield d
    if d.proc.poll() is None:
        stop(d)


def _engine(d, model_id):
    return next(e for e in d.stats()["engines"] if e["model"] == model_id)


def _followers(pid):
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "mlxd.engine.kinds.group.follower" in " ".join(p.cmdline())]


def _complete(d, model, messages, stream, max_tokens=24, on_chunk=None, **sampling):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **sampling}
    if stream:
        return stream_chat(d, body, on_chunk=on_chunk)[0]
    with d.http() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]


def _concurrently(fn, args_list):
    results: list = [None] * len(args_list)
    errors: list = []

    def run(i, args):
        try:
            results[i] = fn(*args)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def test_sharded_group_output_equals_the_whole_engine(group_daemon):
    d = group_daemon
    whole = _concurrently(lambda m: _complete(d, "whole", m, False), [(m,) for m in CHATS])
    for stream in (False, True):
        got = _concurrently(lambda m, s=stream: _complete(d, "big", m, s), [(m,) for m in CHATS])
        assert got == whole, f"stream={stream}"
    assert all(len(t) > 0 for t in whole)
    # seeded sampling too: every rank builds the row's sampler from its parameters
    seeded = {"temperature": 0.9, "seed": 11, "top_p": 0.95}
    assert _complete(d, "big", CHATS[3], False, **seeded) == \
        _complete(d, "whole", CHATS[3], False, **seeded)
    engine = _engine(d, "tiny-sharded")
    assert engine["peak_batch"] >= 2  # the four streams shared steps
    followers = _followers(engine["pid"])
    assert len(followers) == 1
    # rank 0's attention setting (engine/load/cuda_attention.py: MLX's default) reaches every
    # rank
    assert followers[0].environ().get("MLX_CUDA_USE_CUDNN_SDPA") == "1"


def test_a_dead_or_hung_follower_restarts_the_group_and_the_stream_completes(group_daemon):
    """One stream, two faults: rank 1 killed with -9 after 8 chunks (rank 0 sees it exit and
    goes down), then the next group's rank 1 stopped after 11 (rank 0 waits in a collective,
    the hang watchdog kills it, and the stopped rank dies with it). The client sees the same
    text as from the whole engine, only later."""
    d = group_daemon
    reference = _complete(d, "whole", CHATS[0], True, max_tokens=48)
    first = _engine(d, "tiny-sharded")
    victims: list[psutil.Process] = []
    epochs = [first["epoch"]]

    def fault(chunks):
        if chunks == 8 and not victims:
            victims.append(_followers(first["pid"])[0])
            victims[0].kill()
        elif chunks == 11 and len(victims) == 1:
            second = _engine(d, "tiny-sharded")
            epochs.append(second["epoch"])
            victims.append(_followers(second["pid"])[0])
            victims[1].suspend()  # rank 0's next collective waits for ever: no progress

    text = _complete(d, "big", CHATS[0], True, max_tokens=48, on_chunk=fault)
    assert len(victims) == 2 and text == reference
    assert not psutil.pid_exists(first["pid"]) or \
        psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE
    gone, alive = psutil.wait_procs(victims, timeout=10)  # the stopped one died with rank 0
    assert not alive
    last = _engine(d, "tiny-sharded")
    assert last["epoch"] > epochs[-1] > epochs[0]
    assert len(_followers(last["pid"])) == 1
    assert d.stats()["proxy"]["resume"]["resumes"] >= 2


def test_sigterm_leaves_no_rank_behind(group_daemon):
    d = group_daemon
    engine = _engine(d, "tiny-sharded")
    ranks = [psutil.Process(engine["pid"])]
    ranks += _followers(ranks[0].pid)
    assert len(ranks) == 2
    # /stats and `mlxd status` show the group: its layout and its follower's pid
    assert engine["group"] == "tensor:2" and engine["group_pids"] == [ranks[1].pid], engine
    others = [e for e in d.stats()["engines"] if e["model"] != "tiny-sharded"]
    assert others and all(e["group"] == "" and e["group_pids"] == [] for e in others)
    assert "ready (tensor:2)" in format_status(d.stats())
    stop(d)  # exit 0, no process, socket or segment left
    for p in ranks:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


def test_a_failed_generator_call_on_rank_0_takes_the_group_down():
    """A follower that dies mid-step shows on rank 0 first as a failed collective, before its
    exit is seen: that must bring the group down (restart, resume), not fail the requests."""
    class LostPeer:
        def next(self):
            raise RuntimeError("[ring] connection to a peer was lost")

        def remove(self, uids, return_prompt_caches=False):
            return {}

    seen: list[BaseException] = []
    sent: list = []
    gen = LeaderGenerator(LostPeer(), sent.append, seen.append)
    with pytest.raises(RuntimeError):
        gen.next()
    assert [str(e) for e in seen] == ["[ring] connection to a peer was lost"]
    assert gen.remove([1]) == {} and len(seen) == 1  # calls that succeed are not reported
    assert [type(c).__name__ for c in sent] == ["GNext", "GRemove"]
