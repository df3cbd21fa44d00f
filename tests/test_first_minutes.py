"""The first five minutes (issue 19): one log line per event in one format (text or json) with
each process's name, progress a person can see (a bar on a terminal, lines elsewhere, the
engine's status while it loads), the socket path as the daemon computes it, a warm-up that
leaves no trace, and service files that never hold the API key."""

from __future__ import annotations

import io
import json
import logging
import os
import plistlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pexpect
import psutil
import pytest
import zmq

from conftest import start_daemon, stop_and_check
from mlxd.cli.client import engine_state, format_status
from mlxd.daemon.launch import popen
from mlxd.protocol import codec
from mlxd.protocol.addresses import Endpoints
from mlxd.protocol.logs import (
    ChildLines,
    Console,
    Progress,
    ProgressLog,
    Record,
    parse,
    render,
)
from mlxd.protocol.messages import EngineStatus
from mlxd.protocol.settings import EngineLaunch, EngineSettings, TuningSettings
from support.harness import LISTENING, READY, RUN_DIRS, TAG_ENV

CLI = [sys.executable, "-m", "mlxd.cli.main"]
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (\S+) "
                       r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
SLOW_READ = {"MLXD_FAULTS": "engine.read=delay"}  # 50 ms per piece of weights: a slow disk
KEY = "sk-first-minutes-0123456789"


def env(**extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    return {**clean, "MLXD_CONFIG": os.devnull, "PYTHONUNBUFFERED": "1", **extra}


# ---------------------------------------------------------------- log records (pure)

def test_records_render_and_parse_back_in_both_formats():
    t = time.time()
    plain = Record(t, "engine:m#2", 42, "WARNING", "slow: 3 s")
    bar = Record(t, "engine:m#2", 42, "INFO", "loading weights", Progress(40, 93, "MiB"))
    text = render(bar, "text")
    assert text.endswith(" engine:m#2 INFO loading weights: 43% (40/93 MiB)")
    assert "\n" not in text and "\n" not in render(bar, "json")
    for rec in (plain, bar):
        back = parse(render(rec, "json"))
        assert back is not None and back.progress == rec.progress and back.pid == 42
        assert (back.process, back.level, back.message) == (rec.process, rec.level,
                                                            rec.message)
        assert abs(back.time - t) < 0.002
        back = parse(render(rec, "text"), pid=7)
        assert back is not None and back.pid == 7 and back.progress == rec.progress
        assert back.message == rec.message and abs(back.time - t) < 0.002
    assert json.loads(render(bar, "json"))["progress"] == {"done": 40, "total": 93,
                                                           "unit": "MiB"}
    assert parse("Traceback (most recent call last):") is None
    assert parse('{"not": "a record"}') is None


def test_a_childs_raw_output_becomes_records_of_that_child():
    lines = ChildLines("engine:m#0", 99)
    t = time.time()
    rec = lines.record(render(Record(t, "engine:m#0", 0, "ERROR", "step failed"), "text"))
    assert (rec.level, rec.pid, rec.message) == ("ERROR", 99, "step failed")
    # the traceback's lines follow their record's level; a stack dump line is the child's own
    follow = lines.record('  File "x.py", line 1, in f')
    assert (follow.process, follow.level, follow.pid) == ("engine:m#0", "ERROR", 99)
    lines.record(render(Record(t, "engine:m#0", 0, "INFO", "fine"), "json"))
    assert lines.record("Thread 0x1 (most recent call first):").level == "INFO"
    assert lines.record("Fatal Python error: Aborted", error_line=True).level == "ERROR"


def test_a_terminal_gets_one_bar_redrawn_and_other_streams_get_few_lines():
    t = time.time()
    steps = [Record(t, "engine:m#0", 1, "INFO", "loading weights", Progress(n, 10, "MiB"))
             for n in (0, 3, 6, 10)]
    after = Record(t, "engine:m#0", 1, "INFO", "model m ready in 1.0 s")
    tty = io.StringIO()
    console = Console(tty, "text", tty=True)
    for rec in [*steps, after]:
        console.write(rec)
    out = tty.getvalue()
    assert out.count("\r\x1b[2K") == 4  # three redraws, and clearing before the last line
    assert "[#######-----------------]  30% 3/10 MiB" in out
    final_lines = out.split("\r\x1b[2K")[-1].splitlines()
    assert final_lines[0].endswith("loading weights: 100% (10/10 MiB)")
    assert final_lines[1].endswith("model m ready in 1.0 s")
    piped = io.StringIO()
    console = Console(piped, "text", tty=False)
    for rec in [*steps, after]:
        console.write(rec)
    lines = piped.getvalue().splitlines()
    assert "\r" not in piped.getvalue() and len(lines) == 3  # 0 %, then at most every 5 s
    assert lines[0].endswith("0% (0/10 MiB)") and lines[1].endswith("100% (10/10 MiB)")
    forwarded = io.StringIO()  # a supervised child: its supervisor throttles, not it
    console = Console(forwarded, "text", forwarded=True)
    for rec in steps:
        console.write(rec)
    assert len(forwarded.getvalue().splitlines()) == 4


def test_progress_is_logged_only_for_tasks_that_last():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("test.progress")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    heard: list[tuple] = []
    quick = ProgressLog(log, "quick", 5, "steps", lambda *a: heard.append(a))
    for n in range(6):
        quick.update(n)
    assert records == [] and heard[0] == ("quick", 0, 5, "steps") and heard[-1][1] == 5
    slow = ProgressLog(log, "slow", 3, "steps")
    slow.update(0)
    time.sleep(0.6)  # the task lasts: what is being measured is elapsed time itself
    slow.update(1)
    slow.update(3)
    assert [r.__dict__["progress"].done for r in records] == [1, 3]


def test_status_shows_a_loading_engines_progress():
    loading = {"model": "m", "state": "loading",
               "load_progress": ["loading weights", 40, 93, "MiB"]}
    assert engine_state(loading) == "loading (loading weights: 43%, 40/93 MiB)"
    assert engine_state({"state": "ready", "load_progress": None}) == "ready"
    stats = {"proxy": {"uptime_s": 5, "pid": 1, "in_flight": 0},
             "engines": [{**loading, "active_requests": 0, "generated_tokens_total": 0}]}
    shown = format_status(stats, Path("/run/x/mlxd.sock")).splitlines()
    assert shown[1] == "socket: /run/x/mlxd.sock"
    assert any("loading (loading weights: 43%" in line for line in shown)
    busy = {"model": "m", "state": "ready", "active_requests": 3, "generated_tokens_total": 9,
            "batch_cap": 4, "waiting_requests": 2}
    (row,) = [ln for ln in format_status({**stats, "engines": [busy]}).splitlines()
              if ln.startswith("m ")]
    assert "3/4 +2 waiting" in row  # the cap `--batch auto` chose, and who waits for it
    status = EngineStatus("e", 0, 1, "m", ["m"], "loading",
                          load_progress=("GGUF to MLX", 3, 273, "steps"))
    wire = codec.from_engine()
    assert wire.decode(wire.encode(status)) == status


# ---------------------------------------------------------------- the daemon's own lines

def test_one_line_per_event_in_text_with_each_process_named(tiny_model):
    d = start_daemon(tiny_model, isolate=True, env=SLOW_READ)
    try:
        assert "warmed up in" in d.wait_for_line(READY)
    finally:
        stop_and_check(d)
    lines = [ln for ln in d.lines if ln != "<EOF>"]
    named = [TEXT_LINE.match(ln) for ln in lines]
    assert all(named), [ln for ln, m in zip(lines, named, strict=True) if not m]
    processes = {m.group(1) for m in named if m}
    assert {"supervisor", "proxy#0", "engine:tiny-llama#0", "storage#0"} <= processes
    assert sum(LISTENING in ln for ln in lines) == 1  # said once, by the proxy
    assert sum(READY in ln for ln in lines) == 1  # said once, by the engine
    assert sum(" stopped" in ln for ln in lines) == 1
    assert not any(ln.startswith("mlxd:") for ln in lines)
    # loading took ~1 s (slow reads): plain progress lines, no bar, on a pipe
    progress = [ln for ln in lines if "loading weights: " in ln]
    assert progress and progress[-1].endswith("KiB)") and "100%" in progress[-1]
    assert all("\r" not in ln for ln in lines)


@pytest.mark.parametrize("isolate", [True, False], ids=["isolate", "inprocess"])
def test_json_log_format_reaches_every_process(tiny_model, isolate):
    d = start_daemon(tiny_model, "--log-format", "json", isolate=isolate)
    try:
        d.wait_until(lambda s: s["engines"][0]["pid"], what="the engine's pid")
        d.wait_for_line('"process": "storage#0"')  # its first line may come after ready
        stats = d.stats()
    finally:
        stop_and_check(d)
    records = [json.loads(ln) for ln in d.lines if ln != "<EOF>"]  # every line is one object
    assert all(set(r) >= {"time", "level", "process", "pid", "message"} for r in records)
    by_process = {r["process"]: r["pid"] for r in records}
    if isolate:
        assert set(by_process) == {"supervisor", "proxy#0", "engine:tiny-llama#0",
                                   "storage#0"}
        assert by_process["proxy#0"] == stats["proxy"]["pid"]
        assert by_process["engine:tiny-llama#0"] == stats["engines"][0]["pid"]
        assert by_process["supervisor"] == d.proc.pid
    else:
        assert set(by_process) == {"mlxd", "storage#0"}
        assert by_process["mlxd"] == d.proc.pid
    assert sum(r["message"].startswith("listening on ") for r in records) == 1
    assert sum(" ready in " in r["message"] for r in records) == 1


def test_progress_bar_on_a_terminal(tiny_model):
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))
    RUN_DIRS.append(run_dir)  # the session's end checks that none of its processes is left
    cache_dir = Path(tempfile.mkdtemp(prefix="mlxd-c-", dir="/tmp"))
    serve = pexpect.spawn(CLI[0], [*CLI[1:], "serve", str(tiny_model), "--isolate", "--port",
                                   "0", "--run-dir", str(run_dir), "--cache-dir",
                                   str(cache_dir)],
                          env=env(**SLOW_READ, TERM="xterm", **{TAG_ENV: str(run_dir)}),
                          encoding="utf-8", timeout=120, dimensions=(40, 250))
    try:
        serve.expect_exact("\r\x1b[2K")  # a bar, drawn in place
        serve.expect(r"engine:tiny-llama#0 loading weights \[[#-]{24}\] +\d+% \d+/\d+ KiB")
        serve.expect(r"loading weights: 100% \(\d+/\d+ KiB\)\r\n")  # then its final line
        serve.expect_exact(READY)
        serve.sendintr()  # Ctrl-C in the terminal stops the daemon
        serve.expect(pexpect.EOF)
    finally:
        serve.close(force=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
    assert serve.exitstatus == 0
    assert list(run_dir.iterdir()) == []
    run_dir.rmdir()


# ---------------------------------------------------------------- loading progress in the status

def test_an_engine_reports_its_load_progress_in_its_status(tiny_model, tmp_path):
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))
    RUN_DIRS.append(run_dir)  # the session's end checks that none of its processes is left
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(Endpoints.ipc(run_dir).outputs)
    launch = EngineLaunch(engine_id="e1", epoch=0, model=str(tiny_model), run_dir=str(run_dir),
                          cache_dir=str(tmp_path), ssd_root=None, log_level="info",
                          settings=EngineSettings(),
                          tuning=TuningSettings(faults=SLOW_READ["MLXD_FAULTS"]))
    proc = popen(launch, stderr=subprocess.PIPE, env=env(**{TAG_ENV: str(run_dir)}))
    statuses: list[EngineStatus] = []
    try:
        dec = codec.from_engine()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(s.state == "ready" for s in statuses):
            if pull.poll(1000):
                msg = dec.decode(pull.recv())
                if isinstance(msg, EngineStatus):
                    statuses.append(msg)
    finally:
        proc.terminate()
        proc.wait(30)
        assert proc.stderr is not None
        err = proc.stderr.read()  # a few lines: the pipe never filled
        pull.close(linger=0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    loading = [s.load_progress for s in statuses if s.state == "loading" and s.load_progress]
    assert loading, statuses
    assert all(p[0] == "loading weights" and p[3] == "KiB" and 0 <= p[1] <= p[2]
               for p in loading)
    assert [p[1] for p in loading] == sorted(p[1] for p in loading)
    ready = next(s for s in statuses if s.state == "ready")
    assert ready.load_progress is None
    assert b"loading weights: 100% (" in err  # the engine's own log, forwarded unthrottled


# ---------------------------------------------------------------- the warm-up

def test_warm_up_runs_before_ready_and_leaves_no_trace(tiny_model):
    # Had the warm-up's steps counted for fault points, the engine would exit at its first.
    d = start_daemon(tiny_model, isolate=True, env={"MLXD_FAULTS": "engine.step=exit#0"})
    try:
        assert "warmed up in" in d.wait_for_line("engine:tiny-llama#0 INFO model tiny-llama "
                                                 "ready in ")
        d.wait_until(lambda s: s["engines"][0]["state"] == "ready", what="the proxy's view")
        e = d.stats()["engines"][0]
        assert (e["state"], e["epoch"], e["steps"], e["peak_batch"]) == ("ready", 0, 0, 0)
        assert e["prompt_tokens_total"] == e["generated_tokens_total"] == 0
        c = e["cache"]
        assert c["ram_entries"] == c["ram_hits"] == c["ram_misses"] == c["prompt_tokens"] == 0
        assert c["ssd_blocks_queued"] == c["ssd_blocks_written"] == c["first_tokens"] == 0
    finally:
        stop_and_check(d)


def test_no_warm_up_says_so(tiny_model):
    d = start_daemon(tiny_model, "--no-warm-up", "--ssd-cache", "off")
    try:
        assert "warmed up" not in d.wait_for_line(READY)
    finally:
        stop_and_check(d)


# ---------------------------------------------------------------- the socket path

def socket_of(**extra: str) -> str:
    e = env(**extra)
    if "XDG_RUNTIME_DIR" not in extra:
        e.pop("XDG_RUNTIME_DIR", None)
    out = subprocess.run([*CLI, "socket"], capture_output=True, text=True, env=e, timeout=60)
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform == "darwin", reason="the Linux rule")
def test_socket_path_follows_the_daemons_rule(tmp_path):
    assert socket_of() == f"/tmp/mlxd-{os.getuid()}/mlxd.sock"
    assert socket_of(XDG_RUNTIME_DIR=str(tmp_path)) == f"{tmp_path}/mlxd/mlxd.sock"
    assert socket_of(XDG_RUNTIME_DIR=str(tmp_path / "gone")) == \
        f"/tmp/mlxd-{os.getuid()}/mlxd.sock"  # set but unusable: as if unset


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_over_the_printed_socket(tiny_model):
    xdg = Path(tempfile.mkdtemp(prefix="mlxd-x-", dir="/tmp"))
    d = start_daemon(tiny_model, "--ssd-cache", "off", run_dir=xdg / "mlxd",
                     env={"XDG_RUNTIME_DIR": str(xdg)})
    try:
        e = env(XDG_RUNTIME_DIR=str(xdg))
        sock = subprocess.run([*CLI, "socket"], capture_output=True, text=True, env=e,
                              timeout=60)
        assert sock.returncode == 0 and sock.stdout.strip() == d.socket
        status = subprocess.run([*CLI, "status"], capture_output=True, text=True, env=e,
                                timeout=60)
        assert f"socket: {d.socket}" in status.stdout.splitlines()[:3]
        curl = subprocess.run(["curl", "-s", "--unix-socket", sock.stdout.strip(),
                               "http://localhost/v1/models"], capture_output=True, text=True,
                              timeout=60)
        assert [m["id"] for m in json.loads(curl.stdout)["data"]] == ["tiny-llama"]
    finally:
        stop_and_check(d)
        shutil.rmtree(xdg, ignore_errors=True)


# ---------------------------------------------------------------- service secrets

@pytest.mark.parametrize("platform", ["linux", "macos"])
@pytest.mark.parametrize("given", ["flag", "env"])
def test_service_install_keeps_the_api_key_out_of_every_service_file(tmp_path, platform,
                                                                      given):
    home = tmp_path / "home"
    home.mkdir()
    no_tools = tmp_path / "bin"  # no systemctl or launchctl: the files are written, then
    no_tools.mkdir()  # starting the service fails, which does not matter here
    e = env(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), PATH=str(no_tools),
            **({"MLXD_API_KEY": KEY} if given == "env" else {}))
    key_flag = ["--api-key", KEY] if given == "flag" else []
    argv = [*CLI, "service", "install", "--platform", platform, "--model-pool", "2",
            *key_flag]
    dry = subprocess.run([*argv, "--dry-run"], capture_output=True, text=True, env=e,
                         timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert KEY not in dry.stdout + dry.stderr
    key_file = home / ".config" / "mlxd" / "api_key"
    assert f"write {key_file} (mode 0600)" in dry.stdout and not key_file.exists()
    done = subprocess.run(argv, capture_output=True, text=True, env=e, timeout=60)
    assert KEY not in done.stdout + done.stderr
    assert key_file.read_text().strip() == KEY
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    if platform == "linux":
        unit = (home / ".config" / "systemd" / "user" / "mlxd.service").read_text()
        assert KEY not in unit
        exec_start = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
        assert f'"--api-key-file" "{key_file}"' in exec_start and '"--api-key"' not in unit
    else:
        path = home / "Library" / "LaunchAgents" / "dev.mlxd.plist"
        assert KEY not in path.read_text()
        args = plistlib.loads(path.read_bytes())["ProgramArguments"]
        assert args[args.index("--api-key-file") + 1] == str(key_file)
        assert "--api-key" not in args and not any(KEY in a for a in args)
    # every file the install wrote, the key file aside, is free of the key
    written = [p for p in home.rglob("*") if p.is_file() and p != key_file]
    assert written and not any(KEY in p.read_text() for p in written)


def test_the_daemon_reads_its_key_from_the_file_and_no_command_line_holds_it(tiny_model,
                                                                             tmp_path):
    key_file = tmp_path / "api_key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    loose = subprocess.run([*CLI, "config", "show", "--api-key-file", str(key_file)],
                           capture_output=True, text=True, env=env(), timeout=60)
    assert loose.returncode != 0 and "can be read by others (mode 644)" in loose.stderr
    key_file.chmod(0o600)
    shown = subprocess.run([*CLI, "config", "show", "--json", "--api-key-file", str(key_file)],
                           capture_output=True, text=True, env=env(), timeout=60)
    api_key = json.loads(shown.stdout)["api_key"]
    assert api_key == {"value": "(set)", "source": f"file {key_file}"}
    d = start_daemon(tiny_model, "--ssd-cache", "off", "--api-key-file", str(key_file),
                     isolate=True)
    try:
        with d.http() as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}
                         ).status_code == 200
        procs = [psutil.Process(d.proc.pid), *d.descendants.values()]
        assert len(procs) == 3 and not any(KEY in " ".join(p.cmdline()) for p in procs)
    finally:
        stop_and_check(d)


def test_launch_structs_carry_the_log_format():
    from mlxd.cli.main import _resolve, _serve_namespace
    from mlxd.daemon.launch import engine_launch, proxy_launch, storage_launch
    cfg = _resolve(_serve_namespace(["--log-format", "json"])).config
    for launch in (engine_launch(cfg, "e", "m", 0), proxy_launch(cfg, 0),
                   storage_launch(cfg, 0, supervised=True)):
        assert launch.log_format == "json"
        assert msgspec.msgpack.decode(codec.encode_launch(launch), type=type(launch)) == launch


# ---------------------------------------------------------------- the README's set-up

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command_and_set_up_shows_progress():
    readme = ROOT.joinpath("README.md").read_text()
    setup = readme.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n", 1)[1].strip() for b in setup.split("```sh")[1:]]
    commands = [b.split("```", 1)[0].strip() for b in blocks[:2]]
    assert commands[0].endswith(".venv/bin/mlxd serve")
    assert commands[1].endswith(".venv/bin/python -m pytest -n 2 --dist loadfile")
    assert ROOT.joinpath(".ci", "run").read_text().strip().splitlines()[-1] == commands[1]
    for command in commands:  # pip talks; the silent venv creation is announced first
        assert " -q " not in command and command.startswith("echo ")
    assert "pip install openai" in setup  # the OpenAI example's package
    assert '--unix-socket "$(.venv/bin/mlxd socket)"' in setup


@pytest.mark.parametrize("isolate", [False, True], ids=["inprocess", "isolate"])
def test_serve_says_something_within_5_s(tiny_model, isolate):
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))
    RUN_DIRS.append(run_dir)  # the session's end checks that none of its processes is left
    t0 = time.monotonic()
    proc = subprocess.Popen([*CLI, "serve", str(tiny_model), "--port", "0", "--run-dir",
                             str(run_dir), "--ssd-cache", "off",
                             *(["--isolate"] if isolate else [])],
                            stderr=subprocess.PIPE, text=True,
                            env=env(**{TAG_ENV: str(run_dir)}))
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        took = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert "INFO starting: model tiny-llama, run dir " in first and took < 5, (took, first)
