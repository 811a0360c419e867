"""Run configs as TOML files, for any subcommand built with argparse (``zerodp train``, ``zerodp bench``).

Every option of the command is a key: its long name without the dashes, with ``_`` for ``-``
(``--micro-batch`` is ``micro_batch``). ``--config FILE`` reads the keys, and options given on the
command line override the file; ``--print-config`` prints the resolved settings as TOML, which read
back with ``--config`` resolves to the same settings. A file value goes through the same parsing
and checks as the option it names (``micro_batch = 4`` is ``--micro-batch 4``), so a bad value and
an unknown key each end with one line naming the file and the key.

Torch-free: ``zerodp train --help`` and argument parsing must not import torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from pathlib import Path

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    tomllib = None

#: dests of the options this module adds, which are not settings themselves
OWN = ("config", "print_config")
CONFIG_FILE = "config.toml"  # the resolved config a run directory keeps


def add_config_options(parser: argparse.ArgumentParser, command: str) -> None:
    """``--config FILE`` and ``--print-config`` on ``parser`` (call it after the other options)."""
    g = parser.add_argument_group("run config")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="read settings from this TOML file (keys are the option names with _ for -, "
                        "e.g. micro_batch = 4); options given on the command line override it")
    g.add_argument("--print-config", action="store_true",
                   help=f"print the resolved settings as TOML and exit (a file that {command} --config reads)")
    parser.set_defaults(_config_parser=parser, _config_command=command)


def key_of(action: argparse.Action) -> str | None:
    """The TOML key of an option (its first long name), or None for what is not a setting."""
    if not action.option_strings or action.help == argparse.SUPPRESS or action.dest in OWN:
        return None
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs:
        return None
    name = longs[0][2:]
    if isinstance(action, argparse._StoreFalseAction) and name.startswith("no-"):
        name = name[3:]  # --no-progress is progress = false: a key holds the setting, not the flag
    return name.replace("-", "_")


def settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """key -> action of every setting of ``parser``, in the order ``-h`` lists them."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        key = key_of(action)
        if key is not None and key not in out:
            out[key] = action
    return out


def add_alias(group, old: str, canonical: argparse.Action) -> None:
    """Accept ``old`` for ``canonical`` without listing it in ``-h`` (a name kept for a release)."""
    kw = dict(dest=canonical.dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS)
    if isinstance(canonical, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        group.add_argument(old, action="store_true" if isinstance(canonical, argparse._StoreTrueAction)
                           else "store_false", **kw)
    else:
        group.add_argument(old, type=canonical.type, choices=canonical.choices, nargs=canonical.nargs,
                           const=canonical.const, metavar=canonical.metavar, **kw)


# ----------------------------------------------------------------------------------- reading
def load(path: str) -> dict:
    """The table of a TOML file, or ValueError in one line naming the file and what is wrong."""
    p = Path(path)
    if tomllib is None:  # pragma: no cover
        raise ValueError("--config needs Python 3.11+ (tomllib); this is Python "
                         f"{sys.version_info.major}.{sys.version_info.minor}")
    if not p.is_file():
        raise ValueError(f"--config {path}: {'is a directory' if p.is_dir() else 'no such file'}; "
                         "give a TOML file (zerodp ... --print-config > run.toml writes one)")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path} is not valid TOML: {e}") from None


def tokens(parser: argparse.ArgumentParser, table: dict, path: str) -> list[str]:
    """The command-line words that say what ``table`` says (checked as the options check them)."""
    known = settings(parser)
    words: list[str] = []
    for key, value in table.items():
        action = known.get(key)
        if action is None:
            raise ValueError(_unknown(key, known, path, parser.prog))
        flag = next(o for o in action.option_strings if o.startswith("--"))
        shown = _toml_value(value) if _plain(value) else repr(value)
        where = f"--config {path}: {key} = {shown}"
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: expected true or false")
            if value == isinstance(action, argparse._StoreTrueAction):
                words.append(flag)
            continue
        if isinstance(value, bool) or isinstance(value, dict) or (
                isinstance(value, list) and not all(_scalar(v) for v in value)):
            raise ValueError(f"{where}: expected {_expected(action)}")
        text = ",".join(_word(v) for v in value) if isinstance(value, list) else _word(value)
        _check(action, text, where)
        words += [flag, text]
    return words


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _scalar(v) -> bool:
    return isinstance(v, (int, float, str)) and not isinstance(v, bool)


def _word(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def _expected(action: argparse.Action) -> str:
    if action.choices:
        return "one of " + ", ".join(map(str, action.choices))
    kind = getattr(action.type, "__name__", "str") if action.type else "str"
    flag = next(o for o in action.option_strings if o.startswith("--"))
    return {"int": "a whole number", "float": "a number", "str": "a string"}.get(
        kind, f"a value {flag} takes ({flag} {action.metavar or 'VALUE'})")


def _check(action: argparse.Action, text: str, where: str) -> None:
    value = text
    if action.type is not None:
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            reason = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"expected {_expected(action)}"
            raise ValueError(f"{where}: {reason}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: expected {_expected(action)}")


def _unknown(key: str, known: dict, path: str, prog: str) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"{prog} --print-config lists every key"
    return f"--config {path}: unknown key {key!r}: {prog} has no such setting ({hint})"


def resolve(args: argparse.Namespace, argv: list[str]) -> argparse.Namespace:
    """``args`` as parsed from ``argv`` (the words after the subcommand), with the file of
    ``--config`` under them: defaults < the file < the command line."""
    parser = args._config_parser
    if not args.config:
        return args
    words = tokens(parser, load(args.config), args.config)
    resolved = parser.parse_args(words + list(argv))
    for k, v in vars(args).items():  # what the parent parsers set (the command's name)
        if not hasattr(resolved, k):
            setattr(resolved, k, v)
    resolved.config = args.config
    return resolved


# ----------------------------------------------------------------------------------- writing
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    return json.dumps(str(v), ensure_ascii=False)  # JSON's escapes are TOML's basic-string escapes


def to_toml(args: argparse.Namespace) -> str:
    """The resolved settings of ``args`` as TOML, grouped as ``-h`` groups them; a setting that is
    not set (None) is a comment, so that every key is listed."""
    parser = args._config_parser
    keyed = {id(a): k for k, a in settings(parser).items()}
    lines = [f"# {args._config_command}: resolved settings. Read back with --config FILE; options on the "
             "command line override the file."]
    for group in parser._action_groups:
        body = []
        for action in group._group_actions:
            key = keyed.get(id(action))
            if key is None:
                continue
            value = getattr(args, action.dest, None)
            body.append(f"# {key} = (not set)" if value is None else f"{key} = {_toml_value(value)}")
        if body:
            lines += ["", f"# {group.title}"] + body
    return "\n".join(lines) + "\n"


def values(args: argparse.Namespace) -> dict:
    """key -> resolved value of every setting (None: not set); what round-trips through TOML."""
    return {k: getattr(args, a.dest, None) for k, a in settings(args._config_parser).items()}


def write(args: argparse.Namespace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(args))
    return path
