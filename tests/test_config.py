"""Configuration (flags > MLXD_* > TOML file > defaults), the contract between the section
Structs, the settings table and the launch structs, `mlxd config show`, service files
(`mlxd service install --dry-run` parsed), and the sd_notify client. No daemon is started."""

from __future__ import annotations

import argparse
import configparser
import json
import os
import plistlib
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from mlxd.daemon import launch
from mlxd.daemon.config import add_serve_arguments, resolve
from mlxd.daemon.sd_notify import Notifier
from mlxd.daemon.settings import SECTIONS, SETTINGS, ConfigError
from mlxd.protocol import codec, exit_codes
from mlxd.protocol.settings import EngineLaunch, ProxyLaunch, StorageLaunch


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mlxd.toml"
    path.write_text(text)
    return path


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path):
    cfg_file = _toml(tmp_path, 'batch = 3\nport = 9100\ntemp = 0.7\nresume = false\n'
                               '[model_alias]\nsmall = "/models/small"\n')
    env = {"MLXD_PORT": "9200", "MLXD_TEMP": "0.5", "MLXD_CORS_ORIGIN": "https://a.example,"
           "https://b.example"}
    r = resolve(_args("--config", str(cfg_file), "--temp", "0.2"), env)
    c, src = r.config, r.sources
    assert (c.engine.batch, src["batch"]) == (3, f"file {cfg_file}")
    assert (c.proxy.port, src["port"]) == (9200, "env MLXD_PORT")
    assert (c.proxy.temp, src["temp"]) == (0.2, "flag --temp")
    assert (c.proxy.resume, src["resume"]) == (False, f"file {cfg_file}")
    assert c.proxy.model_alias == {"small": "/models/small"}
    assert c.proxy.cors_origin == ["https://a.example", "https://b.example"]
    assert (c.proxy.top_k, src["top_k"]) == (0, "default")
    assert r.config_file == cfg_file
    # derived paths follow the directories they live in
    r2 = resolve(_args("--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c")), {})
    assert r2.config.socket == tmp_path / "run" / "mlxd.sock"
    assert r2.config.ssd_cache == tmp_path / "c" / "kv"
    assert resolve(_args("--socket", "off", "--ssd-cache", "off"), {}).config.socket is None
    # `off` is a word only for the socket and the SSD tier; for the dirs it is a folder name
    r3 = resolve(_args("--run-dir", "off", "--cache-dir", "off"), {}).config
    assert (r3.run_dir, r3.cache_dir) == (Path("off").absolute(), Path("off").absolute())
    assert r3.socket == Path("off").absolute() / "mlxd.sock"


def test_every_section_field_is_a_setting_users_can_set():
    """The contract: a field declared in a section Struct is a TOML key, a flag and an MLXD_*
    variable, with its Struct's default, and reaches the ServeConfig section that owns it."""
    declared = {(name, key) for name, struct in SECTIONS.items()
                for key in struct.__struct_fields__}
    assert {(s.section, s.key) for s in SETTINGS} == declared
    assert len(SETTINGS) == len(declared)  # no key declared in two sections
    assert len({s.flag for s in SETTINGS}) == len({s.env for s in SETTINGS}) == len(SETTINGS)
    ap = argparse.ArgumentParser()
    add_serve_arguments(ap)
    flags = {opt for action in ap._actions for opt in action.option_strings}
    defaults = resolve(_args(), {}).config
    for s in SETTINGS:
        assert s.flag in flags and s.env == "MLXD_" + s.key.upper() and s.help
        default = getattr(SECTIONS[s.section](), s.key)
        assert s.default == default
        if s.key not in ("run_dir", "cache_dir", "socket", "ssd_cache"):  # derived paths
            assert defaults.value(s.key) == default


def test_bounds_come_from_the_structs_in_the_tables_words(tmp_path):
    """Each bad value is refused with the rule its field's Meta declares."""
    for text, message in [("batch = 0\n", "batch (file {}): 0 must be >= 1"),
                          ("top_p = 1.5\n", "top_p (file {}): 1.5 must be in (0, 1]"),
                          ("port = 70000\n", "port (file {}): 70000 must be 0..65535"),
                          ("ssd_cache_max = 0\n", "ssd_cache_max (file {}): 0.0 must be > 0"),
                          ("prefill_step = 8\n", "prefill_step (file {}): 8 must be >= 16"),
                          ("dtype = 'float8'\n", "dtype (file {}): 'float8' is not one of "
                                                  "auto, native, float32, float16, bfloat16")]:
        path = _toml(tmp_path, text)
        with pytest.raises(ConfigError) as e:
            resolve(_args("--config", str(path)), {})
        assert str(e.value) == message.format(path)
    with pytest.raises(ConfigError, match=re.escape("temp (flag --temp): 2.5 must be 0..2")):
        resolve(_args("--temp", "2.5"), {})
    with pytest.raises(ConfigError, match=re.escape(
            "kv_bits (flag --kv-bits): 5 must be 4..8, a multiple of 4")):
        resolve(_args("--kv-bits", "5"), {})
    with pytest.raises(ConfigError, match=re.escape(
            "kv_group_size (env MLXD_KV_GROUP_SIZE): 96 is not one of 32, 64, 128")):
        resolve(_args(), {"MLXD_KV_GROUP_SIZE": "96"})
    assert resolve(_args("--kv-bits", "8", "--kv-group-size", "32"), {}).config.engine.kv_bits == 8
    with pytest.raises(ConfigError, match=re.escape(
            "shard (flag --shard): a sharded engine runs only with --isolate")):
        resolve(_args("--shard", "big=tensor:2"), {})
    assert resolve(_args("--shard", "big=tensor:2", "--isolate"), {}).config.engine.shard
    # a value its pattern refuses is named in words, never as the pattern's regex
    for argv, env, message in [
            (["--shard", "big=tensor:2", "--shard", "small=tensor"], {},
             "shard (flag --shard): 'small=tensor': expected NAME=tensor:N or NAME=pipeline:N, "
             "N a whole number from 1"),
            ([], {"MLXD_SHARD": "big=pipeline:0"},
             "shard (env MLXD_SHARD): 'big=pipeline:0': expected NAME=tensor:N or "
             "NAME=pipeline:N, N a whole number from 1"),
            ([], {"MLXD_BURST_WINDOW": "3;30"},
             "burst_window (env MLXD_BURST_WINDOW): '3;30': expected "
             "QUIET_MS,WINDOW_MS[,PREPARE_MS], each a number of milliseconds")]:
        with pytest.raises(ConfigError) as e:
            resolve(_args("--isolate", *argv), env)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=re.escape(
            "log_level (env MLXD_LOG_LEVEL): 'loud' is not one of debug, info, warning, error")):
        resolve(_args(), {"MLXD_LOG_LEVEL": "loud"})


def test_launch_structs_round_trip_through_the_codec(tmp_path):
    cfg_file = _toml(tmp_path, 'batch = 3\nssd_cache_max = 2.5\ncors_origin = ["app://x"]\n'
                               '[model_alias]\nsmall = "/models/small"\n')
    cfg = resolve(_args("--config", str(cfg_file), "--run-dir", str(tmp_path / "run"),
                        "--dtype", "float16", "--ssd-cache-verify", "off"),
                  {"MLXD_API_KEY": "k" * 16}).config
    eid, spec = next(iter(cfg.engines().items()))
    engine = launch.engine_launch(cfg, eid, spec, epoch=4)
    proxy = launch.proxy_launch(cfg, epoch=2)
    storage = launch.storage_launch(cfg, epoch=1, supervised=True)
    assert codec.decode_launch(codec.encode_launch(engine), EngineLaunch) == engine
    assert codec.decode_launch(codec.encode_launch(proxy), ProxyLaunch) == proxy
    assert codec.decode_launch(codec.encode_launch(storage), StorageLaunch) == storage
    assert (engine.epoch, engine.model, engine.run_dir) == (4, spec, str(tmp_path / "run"))
    assert engine.settings == cfg.engine and engine.settings.batch == 3
    assert (engine.settings.dtype, engine.settings.ssd_cache_verify) == ("float16", False)
    assert engine.ssd_root == str(cfg.ssd_cache) and proxy.engines == {eid: spec}
    assert proxy.settings.model_alias == {"small": "/models/small"}
    assert proxy.socket == str(tmp_path / "run" / "mlxd.sock") and proxy.engine.batch == 3
    assert storage.settings.ssd_cache_max == 2.5 and storage.root == str(cfg.ssd_cache)
    # the API key never travels in a launch struct
    assert b"k" * 16 not in b"".join(codec.encode_launch(x) for x in (engine, proxy, storage))
    # a child checks the bounds again when it decodes
    bad = msgspec.structs.replace(engine, settings=msgspec.structs.replace(engine.settings,
                                                                           batch=0))
    with pytest.raises(msgspec.ValidationError, match="batch"):
        codec.decode_launch(codec.encode_launch(bad), EngineLaunch)


def test_a_child_refuses_a_bad_launch_struct_without_retry(tmp_path):
    """A real child process reads its launch on stdin; garbage there is a config error (78:
    the supervisor does not restart it), said on stderr."""
    proc = subprocess.run([sys.executable, "-m", "mlxd.storage_worker"], input=b"\x93garbage",
                          capture_output=True, timeout=60)
    assert proc.returncode == exit_codes.CONFIG_ERROR
    assert b"bad StorageLaunch on stdin" in proc.stderr


@pytest.mark.parametrize("text, message", [
    ("bacth = 3\n", "bacth (file"),  # a typo is an unknown key, not silently ignored
    ("batch = 'three'\n", "batch (file"),
    ("batch = 0\n", "batch (file"),
    ("top_p = 1.5\n", "top_p (file"),
    ("isolate = 'yes'\n", "isolate (file"),
    ("dtype = 'float8'\n", "dtype (file"),
    ("cors_origin = 'x'\n", "cors_origin (file"),
    ("batch = true\n", "batch (file"),
    ("batch = [\n", "config file"),  # not TOML
])
def test_bad_file_values_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(_args("--config", str(_toml(tmp_path, text))), {})


@pytest.mark.parametrize("env, message", [
    ({"MLXD_BACH": "3"}, "MLXD_BACH"),
    ({"MLXD_BATCH": "many"}, "batch (env MLXD_BATCH)"),
    ({"MLXD_ISOLATE": "maybe"}, "isolate (env MLXD_ISOLATE)"),
    ({"MLXD_MODEL_ALIAS": "noequals"}, "model_alias (env"),
])
def test_bad_env_values_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(_args(), env)


def test_tuning_switches_are_hidden_settings_that_reach_every_child():
    """The switches benchmarks compare (and the stage clock, the tests' fault points) are
    settings of a hidden section: accepted from MLXD_* like any other, refused when bad, left
    out of --help, and carried to every child in its launch struct."""
    from mlxd.daemon.settings import BY_KEY, OTHER_ENV
    assert OTHER_ENV == {"MLXD_CONFIG"}
    env = {"MLXD_PROMPT_BATCH": "0", "MLXD_BURST_WINDOW": "5,40", "MLXD_GIL_SWITCH_US": "5000",
           "MLXD_STAGE_TRACE": "/tmp/trace", "MLXD_FAULTS": "engine.step=delay@1"}
    cfg = resolve(_args(), env).config
    t = cfg.tuning
    assert (t.prompt_batch, t.burst_window, t.gil_switch_us, t.stage_trace, t.faults) == (
        False, "5,40", 5000.0, "/tmp/trace", "engine.step=delay@1")
    for bad in ({"MLXD_BURST_WINDOW": "fast"}, {"MLXD_GIL_SWITCH_US": "-3"},
                {"MLXD_SSD_STAGING": "disk"}):
        with pytest.raises(ConfigError, match=next(iter(bad)).removeprefix("MLXD_").lower()):
            resolve(_args(), bad)
    assert BY_KEY["prompt_batch"].hidden and not BY_KEY["batch"].hidden
    ap = argparse.ArgumentParser()
    add_serve_arguments(ap)
    shown = ap.format_help()
    assert "--burst-window" not in shown and "--engine-memory" in shown
    for made in (launch.engine_launch(cfg, "e", "m", 0), launch.proxy_launch(cfg, 0),
                 launch.storage_launch(cfg, 0, supervised=True)):
        assert made.tuning == t


def test_engine_memory_is_a_documented_setting():
    cfg = resolve(_args("--engine-memory", "12.5"), {}).config
    assert cfg.engine.engine_memory == 12.5
    with pytest.raises(ConfigError, match="engine_memory"):
        resolve(_args("--engine-memory", "0"), {})


def test_missing_explicit_config_file_fails(tmp_path):
    with pytest.raises(ConfigError, match="config file"):
        resolve(_args("--config", str(tmp_path / "nope.toml")), {})
    with pytest.raises(ConfigError, match="config file"):
        resolve(_args(), {"MLXD_CONFIG": str(tmp_path / "nope.toml")})


def test_non_loopback_host_needs_an_api_key():
    with pytest.raises(ConfigError, match="host .*api-key"):
        resolve(_args("--host", "0.0.0.0"), {})
    c = resolve(_args("--host", "0.0.0.0"), {"MLXD_API_KEY": "k" * 16}).config
    assert c.proxy.host == "0.0.0.0" and c.daemon.api_key == "k" * 16
    with pytest.raises(ConfigError, match="api_key"):
        resolve(_args("--api-key", "short"), {})
    assert resolve(_args("--host", "::1"), {}).config.proxy.host == "::1"


def _mlxd(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    return subprocess.run([sys.executable, "-m", "mlxd", *argv], capture_output=True, text=True,
                          env={**clean, "MLXD_CONFIG": os.devnull, **(env or {})}, timeout=60)


def test_config_show_prints_values_and_sources(tmp_path):
    cfg_file = _toml(tmp_path, 'batch = 5\napi_key = "sekret-key-123"\n')
    out = _mlxd("config", "show", "--json", "--config", str(cfg_file), "--port", "9300",
                env={"MLXD_PREFILL_STEP": "64"})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["batch"] == {"value": 5, "source": f"file {cfg_file}"}
    assert shown["port"] == {"value": 9300, "source": "flag --port"}
    assert shown["prefill_step"] == {"value": 64, "source": "env MLXD_PREFILL_STEP"}
    assert shown["api_key"]["value"] == "(set)"  # never printed
    assert list(shown) == [s.key for s in SETTINGS]  # every setting of every section
    assert "sekret" not in out.stdout
    table = _mlxd("config", "show", "--config", str(cfg_file))
    assert table.returncode == 0
    assert any(line.split()[:3] == ["batch", "5", "file"] for line in table.stdout.splitlines())
    bad = _mlxd("serve", "--config", str(_toml(tmp_path, "nonsense = 1\n")))
    assert bad.returncode != 0 and "nonsense" in bad.stderr


def _sections(dry_run: str) -> tuple[str, list[str]]:
    """(file content, commands) from `--dry-run` output."""
    lines = dry_run.splitlines()
    assert lines[0].startswith("# mlxd service install: write ")
    body = [ln for ln in lines[1:] if not ln.startswith("# run: ") and
            not ln.startswith("# note: ")]
    commands = [ln[len("# run: "):] for ln in lines if ln.startswith("# run: ")]
    return "\n".join(body), commands


class CaseSensitiveParser(configparser.ConfigParser):
    """systemd unit keys are case-sensitive; ConfigParser lowercases them by default."""

    def optionxform(self, optionstr: str) -> str:
        return optionstr


def test_service_install_dry_run_launchd():
    out = _mlxd("service", "install", "--dry-run", "--platform", "macos", "--port", "9400",
                "--model-pool", "2", "--shutdown-timeout", "30")
    assert out.returncode == 0, out.stderr
    content, commands = _sections(out.stdout)
    plist = plistlib.loads(content.encode())
    home = Path.home()
    assert plist["Label"] == "dev.mlxd"
    args = plist["ProgramArguments"]
    assert args[0] == sys.executable and Path(args[0]).is_absolute()
    assert args[1:4] == ["-m", "mlxd", "serve"]
    assert "--isolate" in args and args[args.index("--port") + 1] == "9400"
    assert args[args.index("--model-pool") + 1] == "2"
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 5
    assert plist["ExitTimeOut"] > 30
    assert plist["StandardErrorPath"] == str(home / "Library/Logs/mlxd/mlxd.log")
    assert out.stdout.splitlines()[0].endswith(str(home / "Library/LaunchAgents/dev.mlxd.plist"))
    assert any(c.startswith(f"launchctl bootstrap gui/{os.getuid()} ") for c in commands)


def test_service_install_dry_run_systemd(tmp_path):
    out = _mlxd("service", "install", "--dry-run", "--platform", "linux", "--port", "9400")
    assert out.returncode == 0, out.stderr
    content, commands = _sections(out.stdout)
    unit = CaseSensitiveParser(interpolation=None, strict=False)
    unit.read_string(content)
    svc = unit["Service"]
    assert svc["Type"] == "notify" and svc["Restart"] == "on-failure"
    assert svc["KillMode"] == "mixed"  # SIGTERM to the supervisor only: it drains in order
    assert int(svc["TimeoutStopSec"]) > 15 and int(svc["RestartSec"]) >= 5
    assert svc["ExecStart"].startswith(f'"{sys.executable}" "-m" "mlxd" "serve" "--isolate"')
    assert '"--port" "9400"' in svc["ExecStart"]
    assert unit["Install"]["WantedBy"] == "default.target"
    assert int(unit["Unit"]["StartLimitBurst"]) >= 1
    assert commands == ["systemctl --user daemon-reload",
                        "systemctl --user enable --now mlxd.service"]
    if shutil.which("systemd-analyze"):  # systemd's own parser, where the machine has it
        unit_file = tmp_path / "mlxd.service"
        unit_file.write_text(content)
        check = subprocess.run(["systemd-analyze", "verify", str(unit_file)],
                               capture_output=True, text=True)
        assert check.returncode == 0 and "Unknown" not in check.stderr \
            and "Invalid" not in check.stderr, check.stderr


def test_service_install_rejects_bad_flags_and_uninstall_dry_run():
    bad = _mlxd("service", "install", "--dry-run", "--platform", "linux", "--batch", "0")
    assert bad.returncode != 0 and "batch" in bad.stderr
    out = _mlxd("service", "uninstall", "--dry-run", "--platform", "linux")
    assert out.returncode == 0
    assert "systemctl --user disable --now mlxd.service" in out.stdout
    assert "remove" in out.stdout


def test_sd_notify_sends_datagrams(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(5)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000",
                      "WATCHDOG_PID": str(os.getpid())})
        assert n.enabled and n.watchdog_interval == 2.0
        assert n.notify(READY=1, STATUS="listening")
        assert server.recv(1024) == b"READY=1\nSTATUS=listening"
    off = Notifier({})
    assert not off.enabled and not off.notify(READY=1) and off.watchdog_interval is None
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None  # the watchdog is some other process's


@pytest.mark.parametrize("argv, env, toml, expected", [
    ((), {}, None, "auto"),  # the default: sized to the machine
    (("--batch", "auto"), {}, None, "auto"),
    (("--batch", "16"), {}, None, 16),
    ((), {"MLXD_BATCH": "auto"}, None, "auto"),
    ((), {"MLXD_BATCH": "12"}, None, 12),
    ((), {}, 'batch = "auto"\n', "auto"),
    ((), {}, "batch = 16\n", 16),
    (("--batch", "4"), {"MLXD_BATCH": "auto"}, 'batch = "auto"\n', 4),  # flag wins
])
def test_batch_is_auto_or_a_count(tmp_path, argv, env, toml, expected):
    extra = ("--config", str(_toml(tmp_path, toml))) if toml else ()
    cfg = resolve(_args(*argv, *extra), env).config
    assert cfg.engine.batch == expected
    # and it reaches the engine and the proxy (whose pool reads it) unchanged, through msgpack
    engine, proxy = launch.engine_launch(cfg, "e", "m", 0), launch.proxy_launch(cfg, 0)
    assert codec.decode_launch(codec.encode_launch(engine), EngineLaunch).settings.batch \
        == expected
    assert codec.decode_launch(codec.encode_launch(proxy), ProxyLaunch).engine.batch == expected


@pytest.mark.parametrize("argv, env, toml, message", [
    (("--batch", "0"), {}, None, "batch (flag --batch): 0 must be >= 1"),
    (("--batch", "lots"), {}, None,
     "batch (flag --batch): bad value 'lots': expected auto or an integer"),
    ((), {"MLXD_BATCH": "-3"}, None, "batch (env MLXD_BATCH): -3 must be >= 1"),
    ((), {}, 'batch = "lots"\n', 'expected "auto" or int'),
    ((), {}, "batch = 2.5\n", 'expected "auto" or int'),
])
def test_bad_batch_values_are_clear_errors(tmp_path, argv, env, toml, message):
    extra = ("--config", str(_toml(tmp_path, toml))) if toml else ()
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(_args(*argv, *extra), env)


def test_the_engine_gil_switch_interval_and_its_override():
    """The engine's process hands the GIL back within 200 µs, not CPython's 5 ms (a thread
    returning from a device wait would otherwise queue behind a busy one)."""
    from mlxd.engine.load import gil_switch
    cfg = resolve(_args(), {}).config
    assert cfg.tuning.gil_switch_us == 200.0
    before = sys.getswitchinterval()
    try:
        gil_switch.apply(cfg.tuning.gil_switch_us)
        assert sys.getswitchinterval() == pytest.approx(200e-6)
    finally:
        sys.setswitchinterval(before)
