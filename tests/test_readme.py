"""The README's counted figures against the code they describe: the configuration table holds
every `mlxd serve` setting and nothing else, the hidden settings' list every tuning switch,
every `--flag` and `MLXD_*` name it mentions exists, and the endpoint table lists exactly the
routes the proxy's router serves, and the test count is the suite's (checked when the whole
suite is collected; its time is left to whoever runs it)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mlxd.cli.main import _parser
from mlxd.daemon.settings import SETTINGS
from support.routes import served_routes, template

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ENDPOINT = re.compile(r"`(GET|POST|DELETE|PUT|PATCH|HEAD) (/[^` ]*)`")

# Flags of other programs the README shows commands of, by program.
OTHER_PROGRAMS = {"--no-deps": "pip", "--dist": "pytest-xdist", "--unix-socket": "curl",
                  "--fix": "ruff", "--user": "systemctl", "--now": "systemctl",
                  "--train": "mlx_lm.lora", "--flag": "the word, in 'a --flag'"}
# MLXD_* names that are not settings, and the file that reads each.
OTHER_ENV = {"MLXD_CONFIG": "daemon/config.py", "MLXD_FUZZ_EXAMPLES": "tests/test_fuzz.py"}


def section(title: str) -> str:
    """The README's text from the heading `title` to the next heading of its level or above."""
    start = README.index(title)
    level = title.split(" ")[0]
    heading = re.compile(rf"^#{{1,{len(level)}}} ", re.M)
    ends = [m.start() for m in heading.finditer(README) if m.start() > start]
    return README[start:ends[0] if ends else len(README)]


def first_cells(text: str) -> list[str]:
    """The first cell of every body row of the Markdown tables in `text` (`\\|` is no border)."""
    return [re.split(r"(?<!\\)\|", line)[1] for line in text.splitlines()
            if line.startswith("| `")]


def cli_flags() -> set[str]:
    """Every option of `mlxd` and its subcommands, as argparse has them."""
    found: set[str] = set()
    parsers = [_parser()]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            found.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return found


def script_flags() -> set[str]:
    """Every `"--flag"` literal of the benchmarks' and the test support's scripts."""
    found: set[str] = set()
    for path in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/support/*.py")]:
        found.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", path.read_text()))
    return found


def test_the_configuration_table_is_every_setting_users_see():
    table = {f for cell in first_cells(section("## Configuration (`mlxd serve`)"))
             for f in FLAG.findall(cell)}
    shown = {s.flag for s in SETTINGS if not s.hidden}
    assert not shown - table, f"settings missing from the README's table: {sorted(shown - table)}"
    serve = cli_flags()
    assert not table - serve, f"the README's table names flags mlxd lacks: {sorted(table - serve)}"


def test_the_hidden_settings_list_is_every_tuning_switch():
    hidden = [s for s in SETTINGS if s.hidden]
    start = README.index("Hidden settings,")
    text = README[start:README.index("\n## ", start)]
    missing = [s.key for s in hidden if f"`{s.key}`" not in text or s.env not in text]
    assert hidden and not missing, f"tuning switches the README does not list: {missing}"


def test_every_flag_and_variable_the_readme_names_exists():
    known = cli_flags() | script_flags() | set(OTHER_PROGRAMS)
    unknown = sorted(set(FLAG.findall(README)) - known)
    assert not unknown, f"the README names flags nothing in the tree has: {unknown}"
    envs = {s.env for s in SETTINGS}
    for name in sorted(set(re.findall(r"\bMLXD_[A-Z0-9_]+", README)) - envs):
        assert name in OTHER_ENV, f"the README names {name}, which is no setting"
        assert name in (ROOT / OTHER_ENV[name]).read_text(), f"{name} is read nowhere"


def test_the_endpoint_table_is_the_router():
    listed = {(m, template(p)) for cell in first_cells(section("## Endpoints"))
              for m, p in ENDPOINT.findall(cell)}
    served = {r for r in served_routes() if r[0] != "HEAD"}  # aiohttp's, beside every GET
    assert not served - listed, f"routes the README does not list: {sorted(served - listed)}"
    assert not listed - served, f"README endpoints nothing serves: {sorted(listed - served)}"


def test_the_test_count_is_the_suites(request):
    items = request.session.items
    collected = {Path(str(item.path)).name for item in items}
    if collected != {p.name for p in (ROOT / "tests").glob("test_*.py")}:
        pytest.skip("only part of the suite was collected")
    said = re.search(r"([\d,]+) tests \(\d+ of them skipped", README)
    assert said is not None, "the README's test-count line"
    assert int(said.group(1).replace(",", "")) == len(items), \
        f"the README counts {said.group(1)} tests; the suite has {len(items)}"
