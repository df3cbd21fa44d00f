"""The effective `mlxd serve` configuration, resolved in one place: flags > `MLXD_*`
environment variables > the TOML file > defaults. Each value remembers where it came from."""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from mlxd.daemon.paths import default_cache_dir, default_run_dir
from mlxd.daemon.settings import (BY_KEY, ENV_NAMES, OTHER_ENV, SETTINGS, ConfigError,
                                  parse_text, parse_toml, validate)
from mlxd.protocol.models import DEFAULT_MODEL, engine_id_for

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}


@dataclass
class ServeConfig:
    model: str = DEFAULT_MODEL
    isolate: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    socket: Path | None = None  # None: no Unix socket
    api_key: str | None = None
    allowed_host: list[str] = field(default_factory=list)
    cors_origin: list[str] = field(default_factory=list)
    max_body: int = 16 * 1024 * 1024
    max_header: int = 8190
    run_dir: Path = Path()
    cache_dir: Path = Path()
    log_level: str = "info"
    batch: int = 8
    prefill_step: int = 512
    dtype: str = "auto"
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    load_wait: float = 120.0
    shutdown_timeout: float = 15.0
    model_pool: int = 1
    model_alias: dict[str, str] = field(default_factory=dict)
    hang_timeout: float = 60.0
    idle_unload: float = 0.0
    crash_cooldown: float = 300.0
    pool_wait: float = 60.0
    pool_queue: int = 32
    restart_backoff: float = 0.5
    resume: bool = True
    prompt_cache: float = 4.0  # GB
    ssd_cache: Path | None = None  # None: off
    ssd_cache_max: float = 20.0  # GB
    ssd_cache_verify: bool = True
    block_tokens: int = 256
    kv_slots: int = 16
    generation_checkpoint: int = 0

    def engine_flags(self) -> list[str]:
        """Engine settings as `python -m mlxd.engine` flags (one place for both modes)."""
        flags = ["--cache-dir", str(self.cache_dir), "--batch", str(self.batch),
                 "--prefill-step", str(self.prefill_step), "--dtype", self.dtype,
                 "--prompt-cache", str(self.prompt_cache),
                 "--block-tokens", str(self.block_tokens), "--kv-slots", str(self.kv_slots),
                 "--ssd-verify", "on" if self.ssd_cache_verify else "off",
                 "--generation-checkpoint", str(self.generation_checkpoint)]
        if self.ssd_cache is not None:
            flags += ["--ssd-cache", str(self.ssd_cache)]
        return flags

    def storage_argv(self, supervised: bool) -> list[str]:
        argv = [sys.executable, "-m", "mlxd.storage_worker", "--run-dir", str(self.run_dir),
                "--root", str(self.ssd_cache), "--max-gb", str(self.ssd_cache_max),
                "--log-level", self.log_level]
        return argv + (["--supervised"] if supervised else [])

    def engines(self) -> dict[str, str]:
        """Engine id -> model spec for the engines started with the daemon."""
        return {engine_id_for(self.model): self.model}


@dataclass
class Resolved:
    config: ServeConfig
    sources: dict[str, str]  # key -> "default" | "file PATH" | "env MLXD_X" | "flag --x"
    config_file: Path | None


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir("mlxd")) / "mlxd.toml"


def add_serve_arguments(ap: argparse.ArgumentParser) -> None:
    """Flags from the settings table. Every default is None so that resolution can tell a
    flag given from one left out."""
    ap.add_argument("model_pos", nargs="?", metavar="MODEL", help=BY_KEY["model"].help)
    ap.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help=f"TOML config file (default {default_config_file()} if it exists, "
                         "or $MLXD_CONFIG)")
    for s in SETTINGS:
        kw: dict[str, Any] = {"default": None, "help": s.help, "dest": s.key}
        if s.metavar:
            kw["metavar"] = s.metavar
        if s.kind == "switch":
            ap.add_argument(s.flag, action=argparse.BooleanOptionalAction, **kw)
        elif s.kind == "onoff":
            ap.add_argument(s.flag, choices=["on", "off"], **kw)
        elif s.kind in ("list", "map"):
            ap.add_argument(s.flag, action="append", **kw)
        else:
            if s.choices:
                kw["choices"] = s.choices
            ap.add_argument(s.flag, **kw)


def resolve(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Resolved:
    """Raises ConfigError naming the key (and where it came from) for anything unusable."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {s.key: s.default for s in SETTINGS}
    sources = {s.key: "default" for s in SETTINGS}

    path, explicit = _config_path(args, env)
    if path is not None and (explicit or path.exists()):
        for key, value in _read_toml(path).items():
            s = BY_KEY.get(key)
            if s is None:
                raise ConfigError(f"{key} (file {path}): unknown setting")
            values[key] = parse_toml(s, value, f"file {path}")
            sources[key] = f"file {path}"
    else:
        path = None

    for name, text in env.items():
        if not name.startswith("MLXD_") or name in OTHER_ENV:
            continue
        s = ENV_NAMES.get(name)
        if s is None:
            raise ConfigError(f"{name} (environment): unknown setting")
        values[s.key] = parse_text(s, text, f"env {name}")
        sources[s.key] = f"env {name}"

    if args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            raise ConfigError("model: give it either as MODEL or as --model, not both")
        args.model = args.model_pos
    for s in SETTINGS:
        given = getattr(args, s.key, None)
        if given is None:
            continue
        if s.kind == "onoff":
            given = given == "on"
        elif s.kind in ("int", "float"):
            given = parse_text(s, given, f"flag {s.flag}")
        elif s.kind == "map":
            given = parse_text(s, ",".join(given), f"flag {s.flag}")
        values[s.key] = given
        sources[s.key] = f"flag {s.flag}"

    for s in SETTINGS:
        validate(s, values[s.key], sources[s.key])
    _check_together(values, sources)
    return Resolved(_build(values), sources, path)


def _config_path(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Path | None, bool]:
    if getattr(args, "config", None) is not None:
        return args.config.expanduser(), True
    if env.get("MLXD_CONFIG"):
        return Path(env["MLXD_CONFIG"]).expanduser(), True
    return default_config_file(), False


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    return data


def _check_together(values: dict[str, Any], sources: dict[str, str]) -> None:
    host = values["host"]
    if host not in LOOPBACK_HOSTS and not host.startswith("127.") and not values["api_key"]:
        raise ConfigError(f"host ({sources['host']}): {host!r} is not a loopback address; "
                          "serving beyond this machine needs --api-key (or MLXD_API_KEY)")
    if values["api_key"] is not None and len(values["api_key"]) < 8:
        raise ConfigError(f"api_key ({sources['api_key']}): use at least 8 characters")


def _path_or_off(text: str | None) -> Path | None | str:
    if text is None:
        return None
    if text == "off":
        return "off"
    return Path(text).expanduser().absolute()


def _build(v: dict[str, Any]) -> ServeConfig:
    run_dir = _path_or_off(v["run_dir"]) or default_run_dir().absolute()
    cache_dir = _path_or_off(v["cache_dir"]) or default_cache_dir().absolute()
    socket = _path_or_off(v["socket"])
    ssd = _path_or_off(v["ssd_cache"])
    derived = {
        "run_dir": run_dir, "cache_dir": cache_dir,
        "socket": None if socket == "off" else (socket or run_dir / "mlxd.sock"),
        "ssd_cache": None if ssd == "off" else (ssd or cache_dir / "kv"),
    }
    names = {f.name for f in fields(ServeConfig)}
    kwargs = {k: derived.get(k, val) for k, val in v.items() if k in names}
    return ServeConfig(**kwargs)


def describe(resolved: Resolved) -> list[tuple[str, Any, str, str]]:
    """(key, value, shown, source) rows for `mlxd config show`; secrets masked."""
    rows = []
    for s in SETTINGS:
        value = getattr(resolved.config, s.key)
        if s.secret and value:
            value = shown = "(set)"
        elif isinstance(value, list):
            shown = ",".join(value) or "-"
        elif isinstance(value, dict):
            shown = ",".join(f"{k}={x}" for k, x in value.items()) or "-"
        elif isinstance(value, bool):
            shown = "on" if value else "off"
        elif value is None:
            shown = "off" if s.key in ("socket", "ssd_cache") else "-"
        else:
            shown = str(value)
        if isinstance(value, Path):
            value = str(value)
        rows.append((s.key, value, shown, resolved.sources[s.key]))
    return rows
