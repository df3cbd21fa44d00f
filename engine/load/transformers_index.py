"""transformers' import index, kept on disk between engine processes.

transformers 5 builds, in every process that imports it, an index of what each of its ~3,400
model files exports, by reading them all (`utils.import_utils.define_import_structure`): 1.1-1.3
s of an engine's 2.7 s start on the 2-core development machine, paid again by every engine
restarted after a crash (an engine imports transformers for its tokenizer, through mlx-lm).
The index depends only on the installed files, so the first process writes it under the cache
dir and later ones read it back (marshal: dicts, frozensets, sets and strings).

An entry is keyed by the scanned path and prefix, the Python and marshal versions, and the
modification times and sizes of transformers' `__init__.py`, its `utils/import_utils.py` and the
scanned folder (a reinstall or upgrade rewrites the first two; adding or removing a model
folder changes the folder's time; a file edited in place inside a model folder, as a developer
of transformers might, is not seen: remove the index then). Anything unexpected (a
transformers without that function, an unreadable or corrupt entry, a full disk) falls back
to transformers' own scan, so a wrong guess costs time, never an import. Install it before
transformers is first imported (`install`); after, it does nothing.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import logging
import marshal
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger("mlxd.engine")

INDEX_DIR = "transformers-index"
TARGET = "transformers.utils.import_utils"


def install(cache_dir: Path) -> bool:
    """Keep the index under `cache_dir`; False where it is too late (transformers imported)
    or already installed."""
    if "transformers" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder(Path(cache_dir) / INDEX_DIR))
    return True


def entry_key(module_path: Any, prefix: str | None, import_utils_file: str) -> str | None:
    """The entry's name for this scan of the installed files, or None when they cannot be
    read (no entry is used then)."""
    utils = Path(import_utils_file)
    package = utils.parent.parent
    try:
        stamps = [(p, os.stat(p).st_mtime_ns, os.stat(p).st_size)
                  for p in (package / "__init__.py", utils, Path(module_path))]
    except OSError:
        return None
    text = repr((str(module_path), prefix, sys.version, marshal.version, stamps))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_scan(own: Callable[..., Any], index_dir: Path,
                import_utils_file: str) -> Callable[..., Any]:
    """transformers' `define_import_structure`, read from `index_dir` where an entry is."""
    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        key = entry_key(module_path, prefix, import_utils_file)
        if key is None:
            return own(module_path, prefix)
        entry = index_dir / f"{key}.marshal"
        try:
            structure = marshal.loads(entry.read_bytes())
            if isinstance(structure, dict):  # (damaged bytes may still read as something)
                return structure
        except (OSError, ValueError, EOFError, TypeError):
            pass
        structure = own(module_path, prefix)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        try:
            data = marshal.dumps(structure)
            index_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, entry)  # readers see a whole entry or none
        except (OSError, ValueError) as e:  # a full disk, a structure marshal cannot write
            log.debug("transformers' import index not kept: %s", e)
            tmp.unlink(missing_ok=True)
        return structure
    return define_import_structure


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, index_dir: Path) -> None:
        self.inner = inner
        self.index_dir = index_dir

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        own = getattr(module, "define_import_structure", None)
        where = getattr(module, "__file__", None)
        if callable(own) and where:  # transformers/__init__ binds it right after this
            module.define_import_structure = cached_scan(  # type: ignore[attr-defined]
                own, self.index_dir, where)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, index_dir: Path) -> None:
        self.index_dir = index_dir

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self.index_dir)
        return spec
