"""Whether a model spec can be loaded, decided before the pool evicts anyone for it: a local
directory must hold a model, a Hugging Face repo id must be in the local cache or on the Hub.
A typo'd or unreachable name costs the caller an error, never a resident model. Runs in the
proxy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from mlxd.protocol.models import DEFAULT_MODEL
from mlxd.proxy.bounds import clip
from mlxd.proxy.errors import APIError

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
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        return "the repo is gated: accept its terms and log in with `hf auth login` first"
    except RepositoryNotFoundError:
        return "no such repo on the Hugging Face Hub"
    except HFValidationError:  # asked before any network: not the Hub's fault
        return "not a Hugging Face repo id (namespace/name, letters, digits, '-', '_', '.')"
    except Exception as e:  # noqa: BLE001 - network, DNS, TLS, rate limits
        return ("not in the local Hugging Face cache, and the Hugging Face Hub could not be "
                f"reached (offline? {type(e).__name__})")
    return None


class LoadableCache:
    """Remembers specs known to be loadable, so the Hub is asked once per repo."""

    def __init__(self) -> None:
        self._ok: set[str] = set()

    async def check(self, spec: str, name: str | None = None) -> None:
        """Raise a 404 `model_not_found` naming why unless `spec` loads: no such directory or
        repo, or a repo neither cached nor fetchable (offline). Not a retryable 503: clients
        (and SDKs) retry those, and Ollama and the Hub answer "not found". The message names
        the model as the client did (`name`), never the path an alias stands for."""
        if spec in self._ok or spec == DEFAULT_MODEL:
            return
        problem = await self.problem(spec)
        if problem is not None:
            raise APIError(404, f"the model {clip(name or spec)!r} cannot be loaded: {problem}",
                           code="model_not_found", param="model")
        self._ok.add(spec)

    async def problem(self, spec: str) -> str | None:
        """Why `spec` cannot be loaded as it is now, or None."""
        if spec in self._ok or spec == DEFAULT_MODEL:
            return None
        if os.path.isabs(spec) or spec.startswith((".", "~")):
            return local_model_problem(Path(spec).expanduser())
        if await asyncio.to_thread(_repo_in_local_cache, spec):
            return None
        return await asyncio.to_thread(_repo_on_hub, spec)

    async def present(self, spec: str) -> bool:
        """Whether `spec` loads without fetching anything."""
        if spec in self._ok or spec == DEFAULT_MODEL:
            return True
        if os.path.isabs(spec) or spec.startswith((".", "~")):
            return local_model_problem(Path(spec).expanduser()) is None
        return await asyncio.to_thread(_repo_in_local_cache, spec)

    def forget(self, spec: str) -> None:
        self._ok.discard(spec)
