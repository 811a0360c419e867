"""``python -m zerodp.ui [--port N ...]``: the same as ``zerodp ui``, without loading the other
subcommands (some of which import torch, which takes seconds)."""

from __future__ import annotations

import sys

from zerodp.cli import Parser
from zerodp.ui.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m zerodp")
    add_parser(parser.add_subparsers(dest="command", parser_class=Parser))
    args = parser.parse_args(["ui", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"zerodp ui: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
