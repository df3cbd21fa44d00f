"""The lint configured in pyproject.toml holds: `ruff check` and `mypy` over the package, the
tests and the benchmarks, run as subprocesses (so the README's test command, which CI runs, is
what enforces them). A failure prints the tool's own report."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Paths (files or folders, relative to the repository root) left out of the lint: none now; an
# entry here needs a reason beside it and an issue that removes it.
NOT_YET: set[str] = set()


def package_dirs() -> dict[str, Path]:
    """`mlxd.*` package names and their folders, as pyproject.toml maps them for setuptools."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in table["package-dir"].items()}


def linted(folder: str) -> list[Path]:
    """The Python files of a repository folder that are not in NOT_YET."""
    return sorted(p for p in (ROOT / folder).rglob("*.py")
                  if not {str(p.relative_to(ROOT)), *map(str, p.relative_to(ROOT).parents)}
                  & NOT_YET)


def source_files() -> list[Path]:
    folders = [str(d.relative_to(ROOT)) for d in package_dirs().values()]
    return [p for f in [*folders, "tests", "benchmarks"] for p in linted(f)]


def mlxd_tree(dest: Path) -> Path:
    """A folder `mlxd` of symlinks laid out as the installed package. mypy cannot follow the
    editable install's import hook, so it reads the sources through this tree. Its place stays
    the same from run to run: mypy's cache remembers the paths of the errors it reported."""
    dirs = package_dirs()
    top = dest / "mlxd"
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir(parents=True)
    for f in dirs.pop("mlxd").glob("*.py"):
        (top / f.name).symlink_to(f)
    for name, folder in sorted(dirs.items()):
        link = top.joinpath(*name.split(".")[1:])
        if link.resolve() == folder.resolve():
            continue  # a subpackage in its parent's folder: there through the parent's link
        link.symlink_to(folder, target_is_directory=True)
    return top


def run(tool: list[str]) -> str:
    """Run a tool from this venv at the repository root; its output if it failed, else ''."""
    done = subprocess.run([sys.executable, "-m", *tool], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_ruff():
    files = [str(p.relative_to(ROOT)) for p in source_files()]
    report = run(["ruff", "check", "--no-fix", "--output-format", "concise", *files])
    assert not report, report


def test_mypy():
    tree = mlxd_tree(ROOT / ".mypy_cache" / "mlxd-tree").relative_to(ROOT)
    outside = [str(p.relative_to(ROOT)) for p in source_files()
               if p.parts[len(ROOT.parts)] in ("tests", "benchmarks")]
    report = run(["mypy", str(tree), *outside])
    # name the files as they are in the repository, subpackages before the root
    for name, folder in sorted(package_dirs().items(), key=lambda item: -len(item[0])):
        report = report.replace(f"{tree.parent.joinpath(*name.split('.'))}/",
                                f"{folder.relative_to(ROOT)}/")
    assert not report, report
