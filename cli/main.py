"""The `mlxd` command: serve, config show, the client commands (status, models, flush, stop,
socket, chat, run), and service install. It runs in the user's process; `mlxd serve` resolves
the configuration and hands this process over to `mlxd.daemon` (the supervisor, or the
one-process mode)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlxd.daemon.config import Resolved, ServeConfig, add_serve_arguments, describe, resolve
from mlxd.daemon.settings import ConfigError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mlxd", description="A local LLM serving daemon on MLX.")
    sub = ap.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser(
        "serve", help="serve models over OpenAI-compatible HTTP (flags > MLXD_* environment "
                      "> config file > defaults)"))

    config = sub.add_parser("config", help="the effective configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print each setting, its value and its source")
    show.add_argument("--json", action="store_true")
    add_serve_arguments(show)

    for name, text in CLIENT_COMMANDS.items():
        _add_client_arguments(sub.add_parser(name, help=text), name)

    service = sub.add_parser("service", help="run mlxd as a launchd or systemd user service")
    service_sub = service.add_subparsers(dest="service_command", required=True)
    install = service_sub.add_parser(
        "install", help="write and start the service; flags after `install` are serve flags",
        prefix_chars="-", add_help=True)
    install.add_argument("--dry-run", action="store_true",
                         help="print what would be written and run")
    install.add_argument("--platform", choices=["macos", "linux"], default=None,
                         help=argparse.SUPPRESS)
    for name in ("uninstall", "status"):
        p = service_sub.add_parser(name)
        p.add_argument("--dry-run", action="store_true")
        p.add_argument("--platform", choices=["macos", "linux"], default=None,
                       help=argparse.SUPPRESS)
    return ap


CLIENT_COMMANDS = {
    "status": "the socket, children, models, states and cache figures",
    "models": "models the daemon serves and their states",
    "flush": "make every queued KV-cache write durable",
    "stop": "drain in-flight requests, flush, and stop the daemon",
    "socket": "print the daemon's Unix socket path (for curl --unix-socket \"$(mlxd socket)\")",
    "chat": "talk to a model in the terminal (streaming; /help inside)",
    "run": "one answer to one prompt on stdout, for scripts"}


def _add_client_arguments(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--socket", type=Path, default=None,
                   help="the daemon's Unix socket (default: from the configuration)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the daemon's run dir (default: the socket's directory if it holds "
                        "the daemon's lock, else from the configuration)")
    p.add_argument("--config", type=Path, default=None, metavar="FILE")
    if name in ("chat", "run"):
        _add_chat_arguments(p, name)
    elif name != "socket":
        p.add_argument("--json", action="store_true", help="print the raw JSON")
    if name == "stop":
        p.add_argument("--timeout", type=float, default=None,
                       help="seconds to wait for the exit (default: 2 x shutdown timeout + 40)")


def _run_namespace(argv: list[str]) -> argparse.Namespace:
    """`mlxd run` flags may come before or after the prompt (argparse's subcommands cannot
    intermix positionals and options, so `run` has a parser of its own)."""
    p = argparse.ArgumentParser(prog="mlxd run", description=CLIENT_COMMANDS["run"])
    _add_client_arguments(p, "run")
    args = p.parse_intermixed_args(argv)
    args.command = "run"
    return args


def _add_chat_arguments(p: argparse.ArgumentParser, name: str) -> None:
    if name == "chat":
        p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="the model to talk to (default: the daemon's)")
    else:
        p.add_argument("model", metavar="MODEL", help="the model to ask")
        p.add_argument("prompt", nargs="?", default="-", metavar="PROMPT",
                       help="the prompt; '-' or none: read it from stdin")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the daemon's, --temp)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="longest answer in tokens (default: the daemon's)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")


def _serve_namespace(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlxd serve")
    add_serve_arguments(p)
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace) -> Resolved:
    try:
        return resolve(args)
    except ConfigError as e:
        sys.exit(f"mlxd: bad configuration: {e}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = _parser()
    if argv[:2] == ["service", "install"]:  # everything after is a serve flag, passed through
        args, serve_args = ap.parse_known_args(argv)
        return _service_install(args, serve_args)
    args = _run_namespace(argv[1:]) if argv[:1] == ["run"] else ap.parse_args(argv)
    if args.command == "serve":
        cfg = _resolve(args).config
        if cfg.daemon.isolate:
            from mlxd.daemon.supervisor import run_supervisor
            return run_supervisor(cfg)
        from mlxd.daemon.inprocess import run_inprocess
        return run_inprocess(cfg)
    if args.command == "config":
        return _config_show(args)
    if args.command in ("status", "models", "flush", "stop", "socket", "chat", "run"):
        return _client_command(args)
    if args.command == "service":
        return _service(args)
    return 2


def _config_show(args: argparse.Namespace) -> int:
    resolved = _resolve(args)
    rows = describe(resolved)
    if args.json:
        print(json.dumps({k: {"value": v, "source": src} for k, v, _, src in rows}, indent=1))
        return 0
    from mlxd.cli.client import table
    print(f"# config file: {resolved.config_file or 'none'}")
    print(table([[k, shown, src] for k, _, shown, src in rows], ["KEY", "VALUE", "SOURCE"]))
    return 0


def _find_daemon(args: argparse.Namespace,
                 cfg: ServeConfig) -> tuple[Path, Path, int | None] | int:
    """(socket, run dir, pid if known) of the daemon the client command means, or the exit
    code after saying why there is none."""
    from mlxd.cli import client
    if args.run_dir is not None:  # that daemon, found through its run dir
        run_dir = args.run_dir
        pid = client.running_pid(run_dir)
        if pid is None:
            print(f"mlxd: no mlxd is running with run dir {run_dir}", file=sys.stderr)
            return 3
        sock = args.socket or client.socket_in(run_dir)
        if sock is None:
            print(f"mlxd: the mlxd with run dir {run_dir} (pid {pid}) serves no Unix socket "
                  f"(socket = off)", file=sys.stderr)
            return 3
        return sock, run_dir, pid
    sock = args.socket or cfg.socket
    if sock is None:
        sys.exit("mlxd: the configuration has no Unix socket (socket = off); use --socket")
    run_dir = sock.parent if (sock.parent / "lock").exists() else cfg.run_dir
    return sock, run_dir, client.daemon_pid(run_dir) if args.command == "stop" else None


def _client_command(args: argparse.Namespace) -> int:
    from mlxd.cli import client
    ns = _serve_namespace(["--config", str(args.config)] if args.config else [])
    cfg = _resolve(ns).config
    found = _find_daemon(args, cfg)
    if isinstance(found, int):
        return found
    sock, run_dir, pid = found
    if args.command == "socket":
        print(sock)
        if not sock.is_socket():
            print("mlxd: nothing listens there now (is `mlxd serve` running?)",
                  file=sys.stderr)
            return 3
        return 0
    if args.command in ("chat", "run"):
        return _chat_command(args, sock)
    method, path, timeout = {"status": ("GET", "/stats", 30.0),
                             "models": ("GET", "/v1/models", 30.0),
                             "flush": ("POST", "/admin/cache/flush", 150.0),
                             "stop": ("POST", "/admin/shutdown", 150.0)}[args.command]
    try:
        status, body = client.call(sock, method, path, timeout=timeout)
    except client.DaemonUnreachable as e:
        print(f"mlxd: {e}", file=sys.stderr)
        return 3
    if args.command == "flush" and status in (503, 507) and isinstance(body, dict) \
            and "engines" in body:  # answered, but the cache is not durable: say why
        if args.json:
            print(json.dumps(body, indent=1))
        else:
            err = body.get("error") or {}
            print(f"mlxd: flush failed ({err.get('code')}): {err.get('message')} "
                  f"({body['written']} block(s) written, {body['failed']} failed, "
                  f"{body['pending']} pending)", file=sys.stderr)
        return 1
    if status >= 400:
        print(f"mlxd: {method} {path}: {status} {json.dumps(body)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=1))
    elif args.command == "status":
        print(client.format_status(body, sock))
    elif args.command == "models":
        print(client.format_models(body))
    elif args.command == "flush":
        print(f"mlxd: {body['written']} block(s) written, {body['failed']} failed, "
              f"{body['pending']} pending")
    if args.command == "stop":
        timeout = args.timeout if args.timeout is not None \
            else 2 * cfg.proxy.shutdown_timeout + 40
        print("mlxd: stopping (in-flight requests finish first)...", file=sys.stderr)
        if not client.wait_for_exit(pid, sock, timeout):
            print(f"mlxd: still running after {timeout:.0f} s", file=sys.stderr)
            return 1
        print("mlxd: stopped", file=sys.stderr)
    return 0


def _chat_command(args: argparse.Namespace, sock: Path) -> int:
    from mlxd.cli import chat
    options = {k: v for k, v in (("temperature", args.temperature),
                                 ("max_tokens", args.max_tokens), ("seed", args.seed))
               if v is not None}
    if args.command == "run":
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        return chat.run_once(sock, args.model, prompt, options, system=args.system)
    from mlxd.cli import client
    try:
        name = chat.model_name(sock, args.model)
    except client.DaemonUnreachable as e:
        print(f"mlxd: {e}", file=sys.stderr)
        return 3
    convo = chat.Conversation(model=args.model, system=args.system, options=options)
    return chat.Chat(sock, convo).run(name)


def _service_install(args: argparse.Namespace, serve_args: list[str]) -> int:
    from mlxd.cli import service_install as svc
    resolved = _resolve(_serve_namespace(serve_args))  # bad flags fail here, not at boot
    cfg = resolved.config
    secret = None
    key_source = resolved.sources["api_key"]
    if cfg.daemon.api_key and key_source.startswith(("flag ", "env ")):
        try:  # to a 0600 file: the service's command line and file are readable by all
            serve_args, secret = svc.without_api_key(serve_args, cfg.daemon.api_key,
                                                     svc.api_key_path())
        except ValueError as e:
            sys.exit(f"mlxd: {e}")
    platform = args.platform or svc.current_platform()
    plan = svc.install_plan(platform, svc.serve_command(serve_args),
                             cfg.proxy.shutdown_timeout)
    plan.secret = secret
    if args.dry_run:
        print(svc.describe(plan, "install"))
        return 0
    return svc.execute(plan)


def _service(args: argparse.Namespace) -> int:
    from mlxd.cli import service_install as svc
    platform = args.platform or svc.current_platform()
    if args.service_command == "uninstall":
        plan = svc.uninstall_plan(platform)
        if args.dry_run:
            print(svc.describe(plan, "uninstall"))
            return 0
        return svc.execute(plan)
    cmd = svc.status_command(platform)
    if args.dry_run:
        print(f"# run: {' '.join(cmd)}")
        return 0
    import subprocess
    try:
        return subprocess.run(cmd).returncode
    except FileNotFoundError:
        sys.exit(f"mlxd: {cmd[0]} not found")


if __name__ == "__main__":
    sys.exit(main())
