"""`mlxd service install | uninstall | status`: the launchd user agent (macOS) or the systemd
user unit (Linux), filled in from the templates in deploy/."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

LABEL = "dev.mlxd"
UNIT = "mlxd.service"
THROTTLE_S = 10


@dataclass
class Plan:
    """What an install or uninstall writes, removes and runs; `--dry-run` prints it."""
    platform: str
    path: Path
    content: str | None = None  # None: the file is removed
    commands: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    optional: set[int] = field(default_factory=set)  # indexes of commands allowed to fail
    after_removal: list[list[str]] = field(default_factory=list)


def current_platform() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def serve_command(serve_args: list[str]) -> list[str]:
    """Absolute interpreter, `-m mlxd serve`, the user's flags; a service always runs
    isolated (supervised children) unless told `--no-isolate`."""
    args = list(serve_args)
    if "--isolate" not in args and "--no-isolate" not in args:
        args.insert(0, "--isolate")
    return [sys.executable, "-m", "mlxd", "serve", *args]


def exit_timeout(shutdown_timeout: float) -> int:
    # The proxy drains for up to shutdown_timeout (+10 s grace), the engines flush (same
    # bound), the storage worker gets 15 s: stay longer than all of them.
    return int(2 * shutdown_timeout + 40)


def _template(name: str) -> Template:
    return Template(resources.files("mlxd.deploy").joinpath(name).read_text())


def launchd_plan(command: list[str], shutdown_timeout: float, home: Path, uid: int) -> Plan:
    path = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    log_file = home / "Library" / "Logs" / "mlxd" / "mlxd.log"
    args = "\n".join(f"        <string>{escape(a)}</string>" for a in command)
    content = _template("dev.mlxd.plist").substitute(
        label=LABEL, program_arguments=args, throttle=THROTTLE_S,
        exit_timeout=exit_timeout(shutdown_timeout), home=escape(str(home)),
        log_file=escape(str(log_file)))
    domain = f"gui/{uid}"
    plan = Plan("macos", path, content, [
        ["launchctl", "bootout", f"{domain}/{LABEL}"],  # an older version, if loaded
        ["launchctl", "enable", f"{domain}/{LABEL}"],
        ["launchctl", "bootstrap", domain, str(path)]], optional={0})
    plan.notes.append(f"logs: {log_file}")
    plan.notes.append("the agent starts at login (launchd user agents run in the user's "
                      "session) and after a crash; `mlxd stop` leaves it stopped until the "
                      "next login or `launchctl kickstart " + f"{domain}/{LABEL}`")
    return plan


def systemd_quote(arg: str) -> str:
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("%", "%%").replace("$", "$$") + '"'


def systemd_plan(command: list[str], shutdown_timeout: float, home: Path) -> Plan:
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    path = config_home / "systemd" / "user" / UNIT
    content = _template(UNIT).substitute(
        exec_start=" ".join(systemd_quote(a) for a in command), throttle=THROTTLE_S,
        exit_timeout=exit_timeout(shutdown_timeout))
    plan = Plan("linux", path, content, [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", UNIT]])
    plan.notes.append(f"logs: journalctl --user -u {UNIT}")
    plan.notes.append("to start at boot without a login session: loginctl enable-linger "
                      f"{os.environ.get('USER', '$USER')}")
    return plan


def install_plan(platform: str, command: list[str], shutdown_timeout: float) -> Plan:
    home = Path.home()
    if platform == "macos":
        return launchd_plan(command, shutdown_timeout, home, os.getuid())
    return systemd_plan(command, shutdown_timeout, home)


def uninstall_plan(platform: str) -> Plan:
    home = Path.home()
    if platform == "macos":
        path = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        return Plan("macos", path, None,
                    [["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"]], optional={0})
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    path = config_home / "systemd" / "user" / UNIT
    return Plan("linux", path, None, [["systemctl", "--user", "disable", "--now", UNIT]],
                optional={0}, after_removal=[["systemctl", "--user", "daemon-reload"]])


def status_command(platform: str) -> list[str]:
    if platform == "macos":
        return ["launchctl", "print", f"gui/{os.getuid()}/{LABEL}"]
    return ["systemctl", "--user", "status", "--no-pager", UNIT]


def describe(plan: Plan, action: str) -> str:
    lines = []
    if plan.content is not None:
        lines += [f"# mlxd service {action}: write {plan.path}", plan.content.rstrip("\n")]
    else:
        lines += [f"# mlxd service {action}: remove {plan.path}"]
    lines += [f"# run: {' '.join(c)}" for c in plan.commands]
    if plan.content is None:
        lines += [f"# then remove {plan.path}"]
    lines += [f"# run: {' '.join(c)}" for c in plan.after_removal]
    lines += [f"# note: {n}" for n in plan.notes]
    return "\n".join(lines)


def execute(plan: Plan) -> int:
    if plan.content is not None:
        plan.path.parent.mkdir(parents=True, exist_ok=True)
        if plan.platform == "macos":
            (Path.home() / "Library" / "Logs" / "mlxd").mkdir(parents=True, exist_ok=True)
        tmp = plan.path.with_suffix(plan.path.suffix + ".tmp")
        tmp.write_text(plan.content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, plan.path)
        print(f"mlxd: wrote {plan.path}")
    for i, cmd in enumerate(plan.commands):
        if not _run(cmd, optional=i in plan.optional):
            return 1
    if plan.content is None:
        plan.path.unlink(missing_ok=True)
        print(f"mlxd: removed {plan.path}")
    for cmd in plan.after_removal:
        if not _run(cmd, optional=False):
            return 1
    for note in plan.notes:
        print(f"mlxd: {note}")
    return 0


def _run(cmd: list[str], optional: bool) -> bool:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        print(f"mlxd: {cmd[0]} not found; run it yourself: {' '.join(cmd)}", file=sys.stderr)
        return optional
    if done.returncode != 0 and not optional:
        print(f"mlxd: `{' '.join(cmd)}` failed ({done.returncode}): "
              f"{(done.stderr or done.stdout).strip()}", file=sys.stderr)
        return False
    return True
