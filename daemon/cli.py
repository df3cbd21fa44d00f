"""The `mlxd` command."""

from __future__ import annotations

import argparse
import sys

from mlxd.daemon.config import add_serve_arguments, serve_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlxd", description="A local LLM serving daemon on MLX.")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP")
    add_serve_arguments(serve)
    args = ap.parse_args(argv)
    if args.command == "serve":
        cfg = serve_config(args)
        if cfg.isolate:
            from mlxd.daemon.supervisor import run_supervisor
            return run_supervisor(cfg)
        from mlxd.daemon.inprocess import run_inprocess
        return run_inprocess(cfg)
    return 2


if __name__ == "__main__":
    sys.exit(main())
