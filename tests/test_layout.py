"""The seams stay where docs/architecture.md says they are: the top-level layout, processes that
import each other only through `protocol/`, the `mlxd` command's user side (`cli/`) that nothing
imports, the proxy's sub-packages and the direction of their imports, settings declared once,
and wire messages whose every field is typed (no bare dict or list crossing a process
boundary)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from mlxd.protocol import messages

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = ("daemon", "proxy", "engine", "storage_worker")
PRODUCT = ("cli", *PROCESSES, "protocol", "_pkg")


def test_the_top_level_layout():
    for folder in ("cli", *PROCESSES, "protocol", "tests", "deploy", "benchmarks"):
        assert (ROOT / folder).is_dir(), folder


def _mlxd_imports(path: Path) -> set[str]:
    """The mlxd subpackages a file imports (`mlxd.engine.x` -> `engine`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "mlxd" and len(parts) > 1:
                found.add(parts[1])
    return found


def _mlxd_modules(path: Path) -> set[str]:
    """Every `mlxd...` name a file imports, `from a import b` read as `a.b`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("mlxd.")}


@pytest.mark.parametrize("process", ["proxy", "engine", "storage_worker", "protocol"])
def test_processes_import_each_other_only_through_protocol(process):
    for path in (ROOT / process).rglob("*.py"):
        foreign = _mlxd_imports(path) - {process, "protocol"}
        assert not foreign, f"{path.relative_to(ROOT)} imports mlxd.{sorted(foreign)}"


def test_the_command_imports_only_the_daemon_and_protocol():
    """`cli/` runs in the user's `mlxd ...` process; `mlxd serve` hands over to `mlxd.daemon`."""
    for path in (ROOT / "cli").rglob("*.py"):
        foreign = _mlxd_imports(path) - {"cli", "daemon", "protocol"}
        assert not foreign, f"{path.relative_to(ROOT)} imports mlxd.{sorted(foreign)}"


def test_nothing_imports_the_command():
    """The daemon and its children never import the user-side command; only `python -m mlxd`
    (`_pkg/__main__.py`) is the command itself."""
    for folder in PRODUCT:
        if folder == "cli":
            continue
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "_pkg/__main__.py":
                continue
            assert not any(m.split(".")[1] == "cli" for m in _mlxd_modules(path)), \
                path.relative_to(ROOT)


def _proxy_imports(path: Path) -> set[str]:
    """The parts of the proxy a file imports: `mlxd.proxy.core.x` -> `core`,
    `mlxd.proxy.dialects.openai.x` -> `dialects`, a module at the proxy's root -> `root`."""
    found = set()
    for name in _mlxd_modules(path):
        parts = name.split(".")
        if parts[1] == "proxy" and len(parts) > 2:
            found.add(parts[2] if (ROOT / "proxy" / parts[2]).is_dir() else "root")
    return found


@pytest.mark.parametrize(("folder", "never"), [
    ("core", {"dialects"}),  # core serves every dialect and talks to engines through engines/
    ("engines", {"core", "dialects"}),  # the engine side knows no request shape
])
def test_the_proxy_sub_packages_import_one_way(folder, never):
    for path in (ROOT / "proxy" / folder).rglob("*.py"):
        wrong = _proxy_imports(path) & never
        assert not wrong, f"{path.relative_to(ROOT)} imports proxy/{sorted(wrong)}"


def test_no_dialect_imports_another():
    for package in (ROOT / "proxy" / "dialects").iterdir():
        if not package.is_dir() or package.name == "__pycache__":
            continue
        for path in package.rglob("*.py"):
            other = {m for m in _mlxd_modules(path) if m.startswith("mlxd.proxy.dialects.")
                     and m.split(".")[3] != package.name}
            assert not other, f"{path.relative_to(ROOT)} imports {sorted(other)}"


def test_no_folder_of_the_proxy_holds_more_than_15_modules():
    for folder in [ROOT / "proxy", *(p for p in (ROOT / "proxy").rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        modules = list(folder.glob("*.py"))
        assert len(modules) <= 15, f"{folder.relative_to(ROOT)}: {len(modules)} modules"


def test_the_supervisor_runs_the_proxy_and_engine_only_in_the_one_process_mode():
    for path in (ROOT / "daemon").rglob("*.py"):
        if path.name == "inprocess.py":
            continue
        assert not _mlxd_imports(path) & {"proxy", "engine", "storage_worker"}, path.name


def test_only_the_mlxd_command_declares_flags():
    """Settings are fields of protocol/settings.py; children read a launch struct on stdin."""
    for process in PROCESSES[1:]:
        for path in (ROOT / process).rglob("*.py"):
            assert "add_argument(" not in path.read_text(), path.relative_to(ROOT)


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def test_engine_settings_are_never_built_with_restated_defaults():
    """Each EngineSettings field is declared once, with its default; nothing in the product
    builds the settings or an engine's launch from literals again (issue 13 found six places
    that did)."""
    for process in PRODUCT:
        for path in (ROOT / process).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "protocol/settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and _called_name(node) in (
                        "EngineSettings", "EngineLaunch"):
                    literal = [k.arg for k in node.keywords if isinstance(k.value, ast.Constant)]
                    literal += ["positional" for a in node.args if isinstance(a, ast.Constant)]
                    assert not literal, f"{path.relative_to(ROOT)} builds settings from {literal}"


def _untyped(tp: object) -> bool:
    """A bare dict / list / Any anywhere in an annotation."""
    if tp in (dict, list, typing.Any):
        return True
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (dict, list) and not args:
        return True
    return any(_untyped(a) for a in args if a is not Ellipsis)


@pytest.mark.parametrize("struct", [messages.EngineStatus, messages.EngineStats,
                                    messages.StoreBlocks])
def test_wire_messages_carry_no_untyped_dict_or_list(struct):
    hints = typing.get_type_hints(struct, include_extras=False)
    for name, tp in hints.items():
        assert not _untyped(tp), f"{struct.__name__}.{name}: {tp}"


# ---------------------------------------------------------------------- the engine's rooms


def test_no_folder_of_the_engine_holds_more_than_15_modules():
    for folder in [ROOT / "engine", *(p for p in (ROOT / "engine").rglob("*") if p.is_dir())]:
        if folder.name == "__pycache__":
            continue
        modules = list(folder.glob("*.py"))
        assert len(modules) <= 15, f"{folder.relative_to(ROOT)}: {len(modules)} modules"


FEATURES = ("mlxd.engine.speculative", "mlxd.engine.grammar", "mlxd.engine.kv",
            "mlxd.engine.embeddings", "mlxd.engine.kinds.text", "mlxd.engine.kinds.vision",
            "mlxd.engine.kinds.group", "mlxd.engine.kinds.embedding", "mlxd.engine.generating")


def test_the_engine_service_keeps_the_lifecycle_and_threads_only():
    """What differs between kinds of engine is theirs (`engine/kinds/`): the service is short,
    imports no feature, holds no `Any`-typed feature slot and tests no feature by getattr."""
    path = ROOT / "engine" / "service.py"
    text = path.read_text()
    assert len(text.splitlines()) < 250
    features = {m for m in _mlxd_modules(path) if m.startswith(FEATURES)}
    assert not features, sorted(features)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
            assert "Any" not in ast.unparse(node.annotation), ast.unparse(node)
        if isinstance(node, ast.Call) and _called_name(node) == "getattr" and node.args:
            assert ast.unparse(node.args[0]) != "self", ast.unparse(node)


# mlx-lm's private names the engine uses: they appear in `engine/mlx_lm_internals.py` only
MLX_LM_PRIVATE = {"_step", "_next_tokens", "_next_logprobs", "_generation_batch",
                  "_prompt_batch", "_unprocessed_sequences", "_num_tokens", "_matchers",
                  "_counters", "_tokenizer", "_get_classes", "_download", "_BaseCache"}
DOOR = "engine/mlx_lm_internals.py"


def _product_files() -> list[Path]:
    return [p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")]


def test_mlx_lms_internals_are_read_and_patched_in_one_module():
    for path in _product_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == DOOR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in MLX_LM_PRIVATE, f"{rel}: .{node.attr}"
                if isinstance(node.ctx, ast.Store):  # a module's `mx` swapped, a method patched
                    assert node.attr != "mx", f"{rel}: {ast.unparse(node)} assigned"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{rel} imports {private} from {node.module}"
            if isinstance(node, ast.Name):
                assert node.id not in MLX_LM_PRIVATE, f"{rel}: {node.id}"


def test_the_door_refuses_an_mlx_lm_it_was_not_written_for_in_one_line():
    from mlxd.engine import mlx_lm_internals as door
    low, high = door.TESTED_RANGE
    door.check_version(low)
    for found in ("0.32.1", high, "0.40.0", "1.0"):
        with pytest.raises(door.UnsupportedMlxLm) as e:
            door.check_version(found)
        message = str(e.value)
        assert "\n" not in message and found in message and f"mlx-lm>={low},<{high}" in message


# The files that read MLXD_* variables: the daemon's configuration (flags > MLXD_* > TOML),
# and the proxy reading its API key, which the supervisor hands it in its environment (a
# secret never travels in a launch struct).
ENV_READERS = {"daemon/config.py", "proxy/__main__.py"}
ENVIRON = {"os.environ", "environ"}


def _environment_reads(tree: ast.AST) -> list[str]:
    """The names a module reads from its environment: `os.environ.get(X)`, `os.getenv(X)`,
    `os.environ[X]`, `X in os.environ`, with X a literal or a module constant."""
    consts = {target.id: node.value.value for node in ast.walk(tree)
              if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)
              for target in node.targets if isinstance(target, ast.Name)}

    def name(expr: ast.expr) -> str:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        return consts.get(expr.id, "") if isinstance(expr, ast.Name) else ""

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = ast.unparse(node.func)
            if f in {"os.getenv", *(f"{e}.{m}" for e in ENVIRON for m in ("get", "pop"))}:
                out.append(name(node.args[0]))
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ENVIRON \
                and isinstance(node.ctx, ast.Load):
            out.append(name(node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(o, ast.In) for o in node.ops) \
                and any(ast.unparse(c) in ENVIRON for c in node.comparators):
            out.append(name(node.left))
    out += [v for v in consts.values() if v.startswith("MLXD_")]  # a name kept to read later
    return [n for n in out if n.startswith("MLXD_")]


def test_no_mlxd_variable_is_read_outside_the_settings_and_launch_code():
    """Every switch is a setting (a hidden tuning one if it is for comparisons) that reaches
    a child in its launch struct, read once: no other module reads an MLXD_* variable."""
    for path in _product_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ENV_READERS:
            continue
        reads = _environment_reads(ast.parse(path.read_text()))
        assert not reads, f"{rel} reads {reads}"


def test_the_environment_read_check_finds_reads():
    tree = ast.parse('import os\nENV = "MLXD_X"\na = os.environ.get(ENV)\n'
                     'b = os.getenv("MLXD_Y")\nc = os.environ["MLXD_Z"]\n'
                     'd = "MLXD_W" in os.environ\n')
    assert set(_environment_reads(tree)) == {"MLXD_X", "MLXD_Y", "MLXD_Z", "MLXD_W"}


def test_every_package_folder_is_packaged():
    """A non-editable install (a wheel) holds only the packages pyproject.toml lists: every
    folder of the product with modules is one, with its `__init__.py`, and is listed."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    roots = {name: folder for name, folder in project["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            assert (path.parent / "__init__.py").exists(), f"{path.parent} has no __init__.py"
            found.add(".".join([name, *rel.parts]))
    assert found == listed, (sorted(found - listed), sorted(listed - found))
