"""The one ``zerodp`` command. Each subcommand lives in its own module that exposes
``add_parser(subparsers)``; the parser it adds sets ``func(args) -> int``.

Bad input ends with one line on stderr naming the option and what to do, and exit status 2
(argparse's own errors too: the usage block is printed only with ``-h``). A command that needs
PyTorch on an install without it names the extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

# Subcommand modules, in the order ``zerodp --help`` lists them.
COMMAND_MODULES = [
    "zerodp.plan.cli",
    "zerodp.train.cli",
    "zerodp.ui.cli",
    "zerodp.bench.cli",
]
#: what to run when torch is missing (the planner and the page need no torch)
TRAIN_EXTRA = "pip install 'zerodp[train]'"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``zerodp plan memory: error: ... (see
    zerodp plan memory -h)``, exit status 2. Subcommand parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # "-7e9" is a (negative) value, not an option: the option's own check then explains it
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?[a-zA-Z]*$")

    def error(self, message: str):  # noqa: D401 (argparse's signature)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def command_name(args) -> str:
    """``zerodp plan memory``: the command the user ran, for error lines."""
    words = ["zerodp"] + [w for w in (getattr(args, "command", None),
                                      getattr(args, "plan_command", None)) if w]
    return " ".join(words)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="zerodp",
        description="Data-parallel training with ZeRO/FSDP, and the guide's cost models to plan it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # -h and argparse's errors (one line, see Parser.error) end in SystemExit, as argparse does
    args, extra = parser.parse_known_args(argv)
    if extra:
        name = command_name(args)
        print(f"{name}: error: unrecognized arguments: {' '.join(extra)}: {name} takes no such "
              f"option (see {name} -h)", file=sys.stderr)
        raise SystemExit(2)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # user errors: one clear line, no traceback
        print(f"{command_name(args)}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `zerodp plan ... | head`: the reader left; not an error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "torch":
            print(f"{command_name(args)}: error: this command needs PyTorch, which this install "
                  f"lacks: {TRAIN_EXTRA} (the planner, 'zerodp plan' and 'zerodp ui', needs none)",
                  file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
