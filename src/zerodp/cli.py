"""The one ``zerodp`` command. Each subcommand lives in its own module that exposes
``add_parser(subparsers)``; the parser it adds sets ``func(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order ``zerodp --help`` lists them.
COMMAND_MODULES = [
    "zerodp.plan.cli",
    "zerodp.train.cli",
    "zerodp.ui.cli",
    "zerodp.bench.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerodp",
        description="Data-parallel training with ZeRO/FSDP, and the seed's cost models to plan it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        print(f"zerodp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
