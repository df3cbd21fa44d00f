"""Whether a model spec can be loaded, decided before the pool evicts anyone for it: a local
directory must hold a model, a Hugging Face repo id must be in the local cache or on the Hub.
A typo'd or unreachable name costs the caller an error, never a resident model. Runs in the
proxy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from mlxd.protocol.models import DEFAULT_MODEL
from mlxd.proxy.errors import APIError, unavailable

HUB_TIMEOUT = 10.0  # seconds to ask the Hub whether a repo exists


def local_model_problem(path: Path) -> str | None:
    """Why `path` is not a loadable model directory, or None if it looks like one."""
    try:
        if not path.is_dir():
            return "no such directory"
        if not (path / "config.json").is_file():
            return "the directory has no config.json"
        if not any(path.glob("*.safetensors")):
            return "the directory has no *.safetensors weights"
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    return None


def _repo_in_local_cache(repo: str) -> bool:
    from huggingface_hub import try_to_load_from_cache
    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed cache or id: not cached
        return False


def _repo_on_hub(repo: str) -> str | None:
    """None if the Hub has the repo, else why it cannot be used (runs on a worker thread)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        return "the repo is gated: accept its terms and log in with `hf auth login` first"
    except RepositoryNotFoundError:
        return "no such repo on the Hugging Face Hub"
    except Exception as e:  # noqa: BLE001 - network, DNS, TLS, rate limits
        return f"not in the local Hugging Face cache, and the Hub could not be reached ({e})"[:300]
    return None


class LoadableCache:
    """Remembers specs known to be loadable, so the Hub is asked once per repo."""

    def __init__(self) -> None:
        self._ok: set[str] = set()

    async def check(self, spec: str) -> None:
        """Raise a 404 (no such model) or 503 (the Hub is unreachable) unless `spec` loads."""
        if spec in self._ok or spec == DEFAULT_MODEL:
            return
        if os.path.isabs(spec) or spec.startswith((".", "~")):
            problem = local_model_problem(Path(spec).expanduser())
            if problem is not None:
                raise APIError(404, f"the model {spec!r} cannot be loaded: {problem}",
                               code="model_not_found", param="model")
        elif not await asyncio.to_thread(_repo_in_local_cache, spec):
            problem = await asyncio.to_thread(_repo_on_hub, spec)
            if problem is not None:
                if "could not be reached" in problem:
                    raise unavailable(f"the model {spec!r} cannot be loaded: {problem}",
                                      "model_unreachable", retry_after=30)
                raise APIError(404, f"the model {spec!r} cannot be loaded: {problem}",
                               code="model_not_found", param="model")
        self._ok.add(spec)

    def forget(self, spec: str) -> None:
        self._ok.discard(spec)
