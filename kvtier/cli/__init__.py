"""``kvtier`` command line: ``serve`` (the daemon), ``status`` and ``bench``.

Settings come from ``KVCACHED_OFFLOAD_*`` variables; flags override them. A bad value exits 2 with
a message naming the flag or variable and the accepted values.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from kvtier.config import OffloadConfig
from kvtier.errors import ConfigError
from kvtier.flags import SERVE_FLAGS, package_version


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon", description="Run the kvtier daemon.")
    meta = {f.name: f for f in fields(OffloadConfig)}
    for flag, (name, typ) in SERVE_FLAGS.items():
        f = meta[name]
        text = f"{f.metadata['doc']} Accepted: {f.metadata['accepted']}. Env: {f.metadata['env']}."
        if name == "listen":
            p.add_argument(flag, dest=name, action="append", metavar="ADDR[,ADDR...]",
                           help=text + " Repeatable.")
        else:
            p.add_argument(flag, dest=name, type=typ, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="KV-cache tiering daemon.")
    parser.add_argument("--version", action="version", version=f"kvtier {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    from kvtier.cli.status import add_status_parser

    add_status_parser(sub)
    from kvtier.cli.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def _config(args: argparse.Namespace) -> OffloadConfig:
    overrides = {name: getattr(args, name) for name, _ in SERVE_FLAGS.values()}
    if overrides["listen"] is not None:  # repeatable, and each value a comma-separated list
        overrides["listen"] = tuple(
            a.strip() for value in overrides["listen"] for a in value.split(",") if a.strip())
    try:
        return OffloadConfig.from_env(**overrides)
    except ConfigError as exc:
        raise ConfigError(_name_flag(str(exc), overrides)) from None


def _name_flag(message: str, overrides: dict[str, Any]) -> str:
    """Prefix the flag when the bad value came from one (the message names the variable)."""
    env = {f.name: f.metadata["env"] for f in fields(OffloadConfig)}
    for flag, (name, _) in SERVE_FLAGS.items():
        if overrides[name] is not None and message.startswith(env[name] + "="):
            return f"{flag}: {message}"
    return message


def _serve(args: argparse.Namespace) -> int:
    from kvtier.server.main import run

    config = _config(args)
    for line in config.start_warnings():  # before anything slow, where the operator looks
        print(f"kvtier serve: warning: {line}", file=sys.stderr)
    return run(config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", _serve)
    try:
        return int(func(args))
    except ConfigError as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)  # one line naming the setting
        return 2
