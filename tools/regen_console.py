"""Re-run every ``$ zerodp plan ...`` console block of the docs and write (or check) its output.

    python tools/regen_console.py            # rewrite the blocks of README.md and docs/*.md
    python tools/regen_console.py --check    # exit 1 and show what differs (tests/test_plan_docs.py)

A block is a fenced ``console`` block whose lines starting with ``$ zerodp plan`` are commands;
everything after a command, up to the next ``$`` line or the fence, is its output, replaced by what
the command prints now (in-process, ``zerodp.cli.main``). Blocks of other commands (``zerodp
train``: a measured run) are left as they are. The one line that may differ between runs,
recommend's "searched in N s", is compared with its figure masked (:data:`IGNORE`).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIX = "$ zerodp plan "
#: (pattern, replacement) masking what differs from run to run: recommend's search time
IGNORE = [(re.compile(r"^searched in [0-9.]+ s$", re.M), "searched in <time> s")]
_BLOCK = re.compile(r"^```console\n(.*?)^```$", re.S | re.M)


def run(command: str) -> str:
    """What ``command`` ("zerodp plan ...") prints, run in-process from the repository root."""
    import os

    from zerodp.cli import main

    argv = shlex.split(command)[1:]
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the commands name paths relative to the repository (tests/data/...)
    try:
        with contextlib.redirect_stdout(out):
            rc = main(argv)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"{command}: exit status {rc}")
    return out.getvalue()


def _regen_block(body: str) -> str:
    lines = body.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(PREFIX):
            out.append(line)
            i += 1
            while i < len(lines) and not lines[i].startswith("$ "):
                i += 1  # the old output
            text = run(line[2:].strip())
            out.append(text if text.endswith("\n") else text + "\n")
        else:
            out.append(line)
            i += 1
    return "".join(out)


def regenerate(text: str) -> str:
    """``text`` with every ``zerodp plan`` console block's output printed anew."""
    return _BLOCK.sub(lambda m: "```console\n" + _regen_block(m.group(1)) + "```", text)


def commands(text: str) -> list[str]:
    return [line[2:].strip() for m in _BLOCK.finditer(text) for line in m.group(1).splitlines()
            if line.startswith(PREFIX)]


def masked(text: str) -> str:
    for pattern, repl in IGNORE:
        text = pattern.sub(repl, text)
    return text


def check(files=FILES) -> list[str]:
    """The unified diffs of every file whose blocks print something else now (empty: all agree)."""
    diffs = []
    for path in files:
        old = path.read_text()
        if not commands(old):
            continue
        new = regenerate(old)
        if masked(new) != masked(old):
            diffs.append("".join(difflib.unified_diff(
                masked(old).splitlines(keepends=True), masked(new).splitlines(keepends=True),
                str(path.relative_to(ROOT)), str(path.relative_to(ROOT)) + " (now)")))
    return diffs


def main(argv: list[str]) -> int:
    if "--check" in argv:
        diffs = check()
        sys.stdout.write("".join(diffs))
        return 1 if diffs else 0
    for path in FILES:
        old = path.read_text()
        if commands(old):
            new = regenerate(old)
            if new != old:
                path.write_text(new)
                print(f"rewrote {path.relative_to(ROOT)} ({len(commands(old))} commands)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
