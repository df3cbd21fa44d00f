"""`mlxd service install | uninstall | status`: the launchd user agent (macOS) or the systemd
user unit (Linux), filled in from the templates in deploy/.

An API key given to `install` (`--api-key K` or MLXD_API_KEY) never goes into the service file
or onto the service's command line, where every user could read it (`ps`, the unit): it is
written to a file of mode 0600 beside the config file, and the service gets
`--api-key-file PATH`."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

import platformdirs

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
    secret: tuple[Path, str] | None = None  # (file, API key): written first, mode 0600


def current_platform() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def serve_command(serve_args: list[str]) -> list[str]:
    """Absolute interpreter, `-m mlxd serve`, the user's flags; a service always runs
    isolated (supervised children) unless told `--no-isolate`."""
    args = list(serve_args)
    if "--isolate" not in args and "--no-isolate" not in args:
        args.insert(0, "--isolate")
    return [sys.executable, "-m", "mlxd", "serve", *args]


def api_key_path() -> Path:
    """Where `install` keeps the service's API key: beside the user's config file."""
    return Path(platformdirs.user_config_dir("mlxd")) / "api_key"


def without_api_key(serve_args: list[str], key: str,
                    key_file: Path) -> tuple[list[str], tuple[Path, str]]:
    """The serve flags with `--api-key K` replaced by `--api-key-file FILE`, and the secret
    to write there. Raises ValueError if the key would still be on the command line."""
    args: list[str] = []
    skip = False
    for a in serve_args:
        if skip:
            skip = False
        elif a == "--api-key":
            skip = True
        elif not a.startswith("--api-key="):
            args.append(a)
    args += ["--api-key-file", str(key_file)]
    if any(key in a for a in args):
        raise ValueError("give the API key as `--api-key KEY` or in MLXD_API_KEY, so that it "
                         "can be kept off the service's command line")
    return args, (key_file, key)


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
    if plan.secret is not None:
        lines += [f"# mlxd service {action}: write {plan.secret[0]} (mode 0600): the API key"]
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


def write_secret(path: Path, secret: str) -> None:
    """`secret` in `path`, mode 0600 from its creation on, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secret + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def execute(plan: Plan) -> int:
    if plan.secret is not None:
        write_secret(*plan.secret)
        print(f"mlxd: wrote the API key to {plan.secret[0]} (mode 0600)")
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
