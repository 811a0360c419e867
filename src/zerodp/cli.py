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
    "zerodp.check.cli",
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
    from zerodp import __version__

    parser = Parser(
        prog="zerodp",
        description="Data-parallel training with ZeRO/FSDP, and the guide's cost models to plan it "
                    "(docs/guide.md). 'zerodp COMMAND -h' describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"zerodp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    _add_env(sub)
    return parser


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="print the versions and devices a bug report needs",
                       description="The versions of zerodp, PyTorch and Python, the distributed backend "
                                   "zerodp train would use, the devices, and the calibration profile in "
                                   "use (--profile, else ./profile.json when present). Paste it into a bug "
                                   "report.")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="calibration profile to describe (default: ./profile.json when present)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_env)


def environment(profile: str | None = None) -> dict:
    """What ``zerodp env`` reports, as a dict (torch's part says so when torch is missing)."""
    import os
    import platform

    from zerodp import __version__

    info: dict = {"zerodp": __version__, "python": platform.python_version(),
                  "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch
    except ModuleNotFoundError:
        info["torch"] = f"not installed ({TRAIN_EXTRA} to train)"
    else:
        import torch.distributed as dist

        cuda = torch.cuda.is_available()
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda if cuda else None
        info["backend"] = "nccl" if cuda else "gloo"
        info["backends available"] = ", ".join(b for b in ("gloo", "nccl", "mpi")
                                               if getattr(dist, f"is_{b}_available", lambda: False)())
        info["devices"] = ([f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
                           if cuda else [f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"])
    path = profile or ("profile.json" if os.path.isfile("profile.json") else None)
    if path is None:
        info["profile"] = "none (zerodp calibrate --out profile.json writes one; --profile FILE names it)"
    else:
        from zerodp.plan.calibrated import load_calibration

        data = load_calibration(path)
        cal = data["calibration"]
        hw = data.get("hardware", {})
        info["profile"] = (f"{os.path.abspath(path)}: {cal.get('world_size')} ranks"
                           + (f", backend {cal['backend']}" if cal.get("backend") else "")
                           + (f", {hw['name']}" if hw.get("name") else ""))
    return info


def run_env(args) -> int:
    import json

    info = environment(args.profile)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(map(len, info))
    for k, v in info.items():
        v = ", ".join(v) if isinstance(v, list) else ("-" if v is None else v)
        print(f"{k:<{width}}  {v}")
    return 0


def _sub_argv(argv: list[str], command: str) -> list[str]:
    """The words after the subcommand's name (the top-level parser takes none of its own)."""
    return argv[argv.index(command) + 1:] if command in argv else []


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
        if getattr(args, "_config_parser", None) is not None:  # a command that takes --config
            from zerodp import runconfig

            args = runconfig.resolve(args, _sub_argv(list(sys.argv[1:] if argv is None else argv), args.command))
            if args.print_config:
                check = getattr(args, "_config_check", None)
                if check is not None:  # a setting the run would refuse is refused here too
                    check(args)
                print(runconfig.to_toml(args), end="")
                return 0
            keep = getattr(args, "_config_out", None)  # the option naming the command's output folder
            if keep and getattr(args, keep, None):
                import os

                runconfig.write(args, os.path.join(getattr(args, keep), runconfig.CONFIG_FILE))
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
