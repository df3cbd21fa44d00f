"""transformers' import index kept on disk (engine/load/transformers_index.py): a later process
reads it instead of scanning transformers' files, a corrupt entry is scanned and written anew,
and the key follows the installed files. Each import runs in a fresh interpreter (an index is
built only where transformers has not been imported yet)."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

from mlxd.engine.load.transformers_index import INDEX_DIR, entry_key, install

IMPORT = """
import json, sys
from pathlib import Path
from mlxd.engine.load import transformers_index
assert transformers_index.install(Path(sys.argv[1]))
from mlx_lm.utils import load_tokenizer
tok = load_tokenizer(Path(sys.argv[2]))
from transformers.utils import import_utils
print(json.dumps({"scans": import_utils.create_import_structure_from_path.cache_info().misses,
                  "ids": list(tok.encode("hello world"))}))
"""


def run_import(cache: Path, model: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", IMPORT, str(cache), str(model)], check=True,
                         capture_output=True, text=True, env={**os.environ}, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_later_process_reads_the_index_instead_of_scanning(tmp_path, tiny_model):
    first = run_import(tmp_path, tiny_model)
    entries = sorted((tmp_path / INDEX_DIR).glob("*.marshal"))
    assert first["scans"] > 100 and entries  # transformers read its model files, once
    second = run_import(tmp_path, tiny_model)
    assert second["scans"] == 0 and second["ids"] == first["ids"]  # read back, same tokenizer
    assert sorted((tmp_path / INDEX_DIR).glob("*.marshal")) == entries

    for damage in (b"\x00not marshal", marshal.dumps(7)):  # unreadable; readable, not an index
        for entry in entries:  # a damaged index is scanned again and written whole
            entry.write_bytes(damage)
        again = run_import(tmp_path, tiny_model)
        assert again["scans"] > 100 and again["ids"] == first["ids"]
        assert run_import(tmp_path, tiny_model)["scans"] == 0
    assert not list((tmp_path / INDEX_DIR).glob("*.tmp"))


def test_the_key_follows_the_installed_files(tmp_path):
    package = tmp_path / "transformers"
    (package / "utils").mkdir(parents=True)
    (package / "models").mkdir()
    (package / "__init__.py").write_text("")
    utils = package / "utils" / "import_utils.py"
    utils.write_text("x = 1\n")
    key = entry_key(package / "models", "models", str(utils))
    assert key is not None and key == entry_key(package / "models", "models", str(utils))
    assert entry_key(package / "models", None, str(utils)) != key  # another prefix
    utils.write_text("x = 22\n")  # an upgrade rewrote it
    assert entry_key(package / "models", "models", str(utils)) != key
    key = entry_key(package / "models", "models", str(utils))
    (package / "models" / "new_model").mkdir()  # a model added: the folder's time moves
    os.utime(package / "models", ns=(1, 1))
    assert entry_key(package / "models", "models", str(utils)) != key
    assert entry_key(tmp_path / "gone", "models", str(utils)) is None


def test_installing_after_transformers_is_imported_does_nothing(tmp_path):
    import transformers  # noqa: F401  (this test process has it already, or has it now)
    assert install(tmp_path) is False
    assert not (tmp_path / INDEX_DIR).exists()
