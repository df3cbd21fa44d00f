"""The effective `mlxd serve` configuration, resolved in one place: flags > `MLXD_*`
environment variables > the TOML file > defaults. Each value remembers where it came from."""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

from mlxd.daemon.paths import default_cache_dir, default_run_dir
from mlxd.daemon.settings import (
    BY_KEY,
    ENV_NAMES,
    OTHER_ENV,
    SETTINGS,
    ConfigError,
    parse_text,
    parse_toml,
    validate,
)
from mlxd.protocol.models import adapter_problem, canonical_spec, engine_id_for, parse_adapter
from mlxd.protocol.settings import (
    DaemonSettings,
    EngineSettings,
    ProxySettings,
    StorageSettings,
    TuningSettings,
)
from mlxd.protocol.volatile_lines import compile_patterns

LOOPBACK_HOSTS = {"127.0.0.1", "::1", "localhost"}
# Daemon settings that name a path: ServeConfig holds each resolved (defaults filled in).
DERIVED_PATHS = ("run_dir", "cache_dir", "socket", "ssd_cache")
S = TypeVar("S", DaemonSettings, ProxySettings, EngineSettings, StorageSettings,
            TuningSettings)


@dataclass(frozen=True)
class ServeConfig:
    """The resolved settings, one Struct per owning process, and the paths derived from them
    (absolute; None where the user said `off`)."""
    daemon: DaemonSettings
    proxy: ProxySettings
    engine: EngineSettings
    storage: StorageSettings
    tuning: TuningSettings  # hidden switches for comparisons and tests; every child gets them
    run_dir: Path
    cache_dir: Path
    socket: Path | None  # None: no Unix socket
    ssd_cache: Path | None  # None: no SSD tier

    def engines(self) -> dict[str, str]:
        """Engine id -> model spec for the engines started with the daemon."""
        return {engine_id_for(self.daemon.model): self.daemon.model}

    def value(self, key: str) -> Any:
        """A setting's effective value: a derived path, or its section's field."""
        if key in DERIVED_PATHS:
            return getattr(self, key)
        return getattr(getattr(self, BY_KEY[key].section), key)


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
        kw: dict[str, Any] = {"default": None, "dest": s.key,
                              "help": argparse.SUPPRESS if s.hidden else s.help}
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
        values[s.key] = validate(s, values[s.key], sources[s.key])
    _read_api_key_file(values, sources)
    _check_together(values, sources)
    _check_adapters(values, sources)
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


def _read_api_key_file(values: dict[str, Any], sources: dict[str, str]) -> None:
    """The key from `api_key_file`, which must be the user's alone (like an ssh key)."""
    if values["api_key_file"] is None:
        return
    where = sources["api_key_file"]
    if values["api_key"] is not None:
        raise ConfigError(f"api_key_file ({where}): an API key is also given "
                          f"({sources['api_key']}); give one or the other")
    path = Path(values["api_key_file"]).expanduser()
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"api_key_file ({where}): {path}: {e.strerror}") from None
    if mode & 0o077:
        raise ConfigError(f"api_key_file ({where}): {path} can be read by others (mode "
                          f"{mode & 0o777:o}); chmod 600 it")
    values["api_key"] = key
    sources["api_key"] = f"file {path}"


def _check_together(values: dict[str, Any], sources: dict[str, str]) -> None:
    host = values["host"]
    if host not in LOOPBACK_HOSTS and not host.startswith("127.") and not values["api_key"]:
        raise ConfigError(f"host ({sources['host']}): {host!r} is not a loopback address; "
                          "serving beyond this machine needs --api-key (or MLXD_API_KEY)")
    if values["api_key"] is not None and len(values["api_key"]) < 8:
        raise ConfigError(f"api_key ({sources['api_key']}): use at least 8 characters")
    if values["shard"] and not values["isolate"]:  # rank 0 starts its followers as a child
        raise ConfigError(f"shard ({sources['shard']}): a sharded engine runs only with "
                          "--isolate")
    try:
        compile_patterns(values["volatile_line"])
    except re.error as e:
        raise ConfigError(f"volatile_line ({sources['volatile_line']}): not a regular "
                          f"expression: {e}") from e
    if values["kv_group_size"] not in (32, 64, 128):  # the group sizes mx.quantize takes
        raise ConfigError(f"kv_group_size ({sources['kv_group_size']}): "
                          f"{values['kv_group_size']} is not one of 32, 64, 128")


def _check_adapters(values: dict[str, Any], sources: dict[str, str]) -> None:
    """Every `--adapter NAME=BASE:DIR` names a readable mlx-lm LoRA directory, on a base this
    daemon can serve, under a name no alias takes (whether its weights fit the base is known
    only once the base is loaded: its engine then fails with the reason)."""
    where = sources["adapter"]
    resolved = {}
    for name, value in values["adapter"].items():
        try:
            base, adapter_dir = parse_adapter(value)
        except ValueError as e:
            raise ConfigError(f"adapter ({where}): {name}: {e}") from None
        problem = adapter_problem(adapter_dir)
        if problem is not None:
            raise ConfigError(f"adapter ({where}): {name}: {problem}")
        if name in values["model_alias"]:
            raise ConfigError(f"adapter ({where}): {name} is also a model alias "
                              f"({sources['model_alias']})")
        if not values["isolate"] and canonical_spec(base) != canonical_spec(values["model"]):
            raise ConfigError(f"adapter ({where}): {name}: its base {base!r} is not the model "
                              "served; without --isolate adapters apply to --model only")
        # absolute, as every process (started anywhere) must read the same directory
        resolved[name] = f"{canonical_spec(base)}:{Path(adapter_dir).expanduser().resolve()}"
    values["adapter"] = resolved


def _path(text: str | None) -> Path | None:
    return None if text is None else Path(text).expanduser().absolute()


def _path_or_off(text: str | None, default: Path) -> Path | None:
    """None where the user said `off`, the default where they said nothing."""
    return None if text == "off" else (_path(text) or default)


def _section(struct: type[S], v: dict[str, Any]) -> S:
    return struct(**{k: v[k] for k in struct.__struct_fields__})


def _build(v: dict[str, Any]) -> ServeConfig:
    """The one place flat resolved values become the section Structs."""
    run_dir = _path(v["run_dir"]) or default_run_dir().absolute()
    cache_dir = _path(v["cache_dir"]) or default_cache_dir().absolute()
    return ServeConfig(
        daemon=_section(DaemonSettings, v), proxy=_section(ProxySettings, v),
        engine=_section(EngineSettings, v), storage=_section(StorageSettings, v),
        tuning=_section(TuningSettings, v), run_dir=run_dir, cache_dir=cache_dir,
        socket=_path_or_off(v["socket"], run_dir / "mlxd.sock"),
        ssd_cache=_path_or_off(v["ssd_cache"], cache_dir / "kv"))


def describe(resolved: Resolved) -> list[tuple[str, Any, str, str]]:
    """(key, value, shown, source) rows for `mlxd config show`; secrets masked."""
    rows = []
    for s in SETTINGS:
        value = resolved.config.value(s.key)
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
