"""The table of `mlxd serve` settings users see: TOML key, flag (`--key-name`), environment
variable (`MLXD_KEY_NAME`), kind, default, bounds and help. Derived from the section Structs of
`protocol/settings.py`, where each setting is declared once; `config.py` resolves them."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from msgspec import inspect as mi

from mlxd.protocol.settings import (
    DaemonSettings,
    EngineSettings,
    ProxySettings,
    StorageSettings,
    TuningSettings,
)

# kind: how a value is written on a command line / in the environment / in TOML.
#   str, int, float, path
#   switch   bool; --key / --no-key; env 1/0/true/false/on/off/yes/no; TOML true/false
#   onoff    bool; --key on|off; otherwise as switch
#   list     repeatable flag; env comma-separated; TOML array of strings
#   map      repeatable NAME=VALUE flag; env comma-separated NAME=VALUE; TOML table
Kind = Literal["str", "int", "float", "path", "switch", "onoff", "list", "map"]

# Section name (the `ServeConfig` attribute holding it) -> its Struct.
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "daemon": DaemonSettings, "proxy": ProxySettings, "engine": EngineSettings,
    "storage": StorageSettings, "tuning": TuningSettings}
HIDDEN_SECTIONS = frozenset({"tuning"})  # not in --help: switches for comparisons and tests

# The order of `--help` and `mlxd config show`, as users know it. A setting not named here is
# listed after these, in section order: a new setting needs no line here.
SHOWN_ORDER = (
    "model", "isolate", "host", "port", "socket", "api_key", "allowed_host", "cors_origin",
    "max_body", "max_header", "run_dir", "cache_dir", "log_level", "batch", "prefill_step",
    "dtype", "temp", "top_p", "top_k", "max_tokens", "load_wait", "shutdown_timeout",
    "model_pool", "model_alias", "hang_timeout", "idle_unload", "crash_cooldown", "pool_wait",
    "pool_queue", "restart_backoff", "resume", "prompt_cache", "ssd_cache", "ssd_cache_max",
    "ssd_cache_verify", "block_tokens", "kv_slots", "generation_checkpoint")

_KIND_OF: dict[type, Kind] = {
    mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "switch", mi.StrType: "str",
    mi.LiteralType: "str", mi.ListType: "list", mi.DictType: "map"}


@dataclass(frozen=True)
class Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    multiple_of: float | None = None

    def __bool__(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt,
                                           self.multiple_of))

    @property
    def rule(self) -> str:
        """What the bounds demand, as the error message says it: `0..65535`, `in (0, 1]`,
        `>= 1`, `> 0`; `4..8, a multiple of 4`."""
        step = "" if self.multiple_of is None else f", a multiple of {_num(self.multiple_of)}"
        return self._range() + step

    def _range(self) -> str:
        low, high = _num(self.ge if self.gt is None else self.gt), \
            _num(self.le if self.lt is None else self.lt)
        if low is not None and high is not None:
            if self.ge is not None and self.le is not None:
                return f"{low}..{high}"
            return (f"in {'[' if self.gt is None else '('}{low}, "
                    f"{high}{']' if self.lt is None else ')'}")
        if low is not None:
            return f"{'>=' if self.gt is None else '>'} {low}"
        return f"{'<=' if self.lt is None else '<'} {high}"


def _num(n: float | None) -> str | None:
    return None if n is None else str(n)


@dataclass(frozen=True)
class Setting:
    key: str
    section: str  # the SECTIONS name whose Struct declares it
    kind: Kind
    default: Any
    help: str
    type: Any  # the field's annotated type: converting with it applies the bounds
    bounds: Bounds = Bounds()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    secret: bool = False  # never printed, never sent to a child
    words: tuple[str, ...] = ()  # words accepted instead of a value of `kind` (batch: "auto")
    expect: str | None = None  # what a value must look like, in words (a pattern's, say)
    hidden: bool = False  # not in --help (a tuning switch)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return "MLXD_" + self.key.upper()


def _from_field(section: str, f: mi.Field, annotated: Any) -> Setting:
    t, extra, help_ = f.type, {}, ""
    if isinstance(t, mi.Metadata):
        extra = t.extra or {}
        help_ = (t.extra_json_schema or {}).get("description", "")
        t = t.type
    words: tuple[str, ...] = ()
    # `X | None`: an optional X; `Literal[words...] | X`: an X or one of the words
    if isinstance(t, mi.UnionType):
        members = [u for u in t.types if not isinstance(u, mi.NoneType)]
        others = [u for u in members if not isinstance(u, mi.LiteralType)]
        if others and len(others) < len(members):
            words = tuple(str(v) for u in members if isinstance(u, mi.LiteralType)
                          for v in u.values)
        t = others[0] if others else members[0]
    default = f.default_factory() if f.default is mi.NODEFAULT else f.default
    return Setting(
        key=f.name, section=section, kind=extra.get("kind", _KIND_OF[type(t)]),
        default=default, help=help_, type=annotated,
        bounds=Bounds(*(getattr(t, b, None) for b in ("ge", "gt", "le", "lt", "multiple_of"))),
        choices=_literal_values(annotated) if isinstance(t, mi.LiteralType) else None,
        metavar=extra.get("metavar"), secret=bool(extra.get("secret", False)), words=words,
        expect=extra.get("expect"),
        hidden=section in HIDDEN_SECTIONS)


def _literal_values(annotated: Any) -> tuple[str, ...]:
    """As declared (msgspec's LiteralType sorts them)."""
    while typing.get_origin(annotated) is typing.Annotated:
        annotated = typing.get_args(annotated)[0]
    return typing.get_args(annotated)


def _derive() -> tuple[Setting, ...]:
    found = {}
    for section, struct in SECTIONS.items():
        hints = typing.get_type_hints(struct, include_extras=True)
        info = mi.type_info(struct)
        assert isinstance(info, mi.StructType)
        for f in info.fields:
            if f.name in found:
                raise TypeError(f"setting {f.name} is declared in two sections")
            found[f.name] = _from_field(section, f, hints[f.name])
    order = [k for k in SHOWN_ORDER if k in found] + [k for k in found if k not in SHOWN_ORDER]
    return tuple(found[k] for k in order)


SETTINGS: tuple[Setting, ...] = _derive()
BY_KEY = {s.key: s for s in SETTINGS}
ENV_NAMES = {s.env: s for s in SETTINGS}
# MLXD_* variables that are not settings: the config file itself. Everything else a process
# reads is a setting, and reaches each child in its launch struct.
OTHER_ENV = {"MLXD_CONFIG"}

TRUE = {"1", "true", "on", "yes"}
FALSE = {"0", "false", "off", "no"}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and where it came from."""


def parse_text(s: Setting, text: str, where: str) -> Any:
    """A value as written on a command line or in an environment variable."""
    if text.strip().lower() in s.words:
        return text.strip().lower()
    try:
        if s.kind == "int":
            return int(text)
        if s.kind == "float":
            return float(text)
        if s.kind in ("switch", "onoff"):
            low = text.strip().lower()
            if low in TRUE | FALSE:
                return low in TRUE
            raise ValueError("expected on/off, true/false, 1/0 or yes/no")
        if s.kind == "list":
            return [p.strip() for p in text.split(",") if p.strip()]
        if s.kind == "map":
            return _pairs([p.strip() for p in text.split(",") if p.strip()], s, where)
        return text
    except ValueError as e:
        if s.words:
            raise ConfigError(f"{s.key} ({where}): bad value {text!r}: expected "
                              f"{' or '.join(s.words)} or {_A_KIND.get(s.kind, s.kind)}") from None
        raise ConfigError(f"{s.key} ({where}): bad value {text!r}: {e}") from None


_A_KIND = {"int": "an integer", "float": "a number"}


_TOML_TYPES: dict[Kind, type | tuple[type, ...]] = {
    "str": str, "path": str, "int": int, "float": (int, float), "switch": bool, "onoff": bool}


def parse_toml(s: Setting, value: Any, where: str) -> Any:
    """A value as TOML gives it: native types, checked strictly (no silent coercion)."""
    if isinstance(value, str) and value in s.words:
        return value
    if s.kind == "list":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ConfigError(f"{s.key} ({where}): expected an array of strings, got {value!r}")
    if s.kind == "map":
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return dict(value)
        raise ConfigError(f"{s.key} ({where}): expected a table of NAME = \"MODEL\", "
                          f"got {value!r}")
    if isinstance(value, bool) and s.kind in ("int", "float"):
        raise ConfigError(f"{s.key} ({where}): expected a number, got {value!r}")
    native = isinstance(value, _TOML_TYPES[s.kind])  # a flag: `value` keeps its Any type
    if not native:
        either = "".join(f'"{w}" or ' for w in s.words)
        raise ConfigError(f"{s.key} ({where}): expected {either}{s.kind}, got {value!r}")
    return float(value) if s.kind == "float" else value


def _pairs(items: list[str], s: Setting, where: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value:
            raise ConfigError(f"{s.key} ({where}): expected NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def validate(s: Setting, value: Any, where: str) -> Any:
    """The value converted by its field's own type, or ConfigError in the table's words."""
    try:
        return msgspec.convert(value, s.type)
    except msgspec.ValidationError as e:
        if s.choices is not None:
            raise ConfigError(f"{s.key} ({where}): {value!r} is not one of "
                              f"{', '.join(s.choices)}") from None
        if s.bounds:
            raise ConfigError(f"{s.key} ({where}): {value!r} must be {s.bounds.rule}") from None
        if s.expect is not None:
            raise ConfigError(f"{s.key} ({where}): {_refused(s, value)}: expected "
                              f"{s.expect}") from None
        raise ConfigError(f"{s.key} ({where}): {e}") from None


def _refused(s: Setting, value: Any) -> str:
    """The part of a value its type refuses, as its user wrote it: a map's bad NAME=VALUE
    items."""
    if not isinstance(value, dict):
        return repr(value)
    bad = []
    for k, v in value.items():
        try:
            msgspec.convert({k: v}, s.type)
        except msgspec.ValidationError:
            bad.append(f"{k}={v}")
    return repr(", ".join(bad))
