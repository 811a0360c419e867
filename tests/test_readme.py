"""The README's promises: short, the quickstart's commands run as written and print what it
shows, its docs map points at docs that exist; and docs/layout.md's module table matches the
files in src/zerodp."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from zerodp.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAYOUT = ROOT / "docs" / "layout.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(text: str, lang: str = "") -> list[str]:
    """The fenced code blocks of ``text`` whose info string is ``lang``."""
    return [body for info, body in re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M) if info == lang]


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    assert rc == 0, argv
    return out.getvalue()


def test_the_readme_is_short_and_says_what_the_guide_is():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    first = text.split("\n\n")[1]
    assert "docs/guide.md" in first and "zerodp is" in first
    assert "make demo" in text and "make test" in text


def test_the_quickstart_runs_as_written_and_prints_what_the_readme_shows(monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name files relative to the repository
    section = _section("Plan my model on my cluster")
    commands = [line.split("#")[0].strip() for line in _blocks(section, "bash")[0].splitlines() if line.strip()]
    assert len(commands) == 6 and all(c.startswith("zerodp ") for c in commands)
    assert any(c.startswith("zerodp plan recommend ") for c in commands)  # on the plan path
    outputs = {}
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv == ["ui"]:  # a server that runs until stopped: its parser and the page's model
            argv = ["plan", "memory", "--config", "examples/configs/my-3b", "--json"]
        outputs[command] = _run(argv)
        assert outputs[command].strip()
    # the shown output is the first lines of what the command prints
    shown = _blocks(section)[-1]
    head, *lines = shown.strip().splitlines()
    assert head.startswith("$ ") and head[2:] in outputs
    assert outputs[head[2:]].splitlines()[:len(lines)] == lines
    # the files it names ship in the repository
    for path in ("examples/configs/my-3b/config.json", "examples/hardware/a100-4x8.toml"):
        assert (ROOT / path).is_file() and path in section


def test_the_docs_map_points_at_docs_that_exist():
    table = _section("Documentation")
    links = re.findall(r"\]\((docs/[^)]+)\)", table)
    assert len(links) >= 10
    for doc in ("guide", "porting", "planner", "ui", "train", "reliability", "benchmarks", "interop", "layout"):
        assert f"docs/{doc}.md" in links, doc
    # docs/porting.md is written separately and may land after this README
    missing = [l for l in links if not (ROOT / l).is_file() and l != "docs/porting.md"]
    assert not missing, missing


def _table_modules() -> list[str]:
    text = LAYOUT.read_text()
    body = text[text.index("<!-- module-table:start -->"):text.index("<!-- module-table:end -->")]
    return re.findall(r"^\| \[`([^`]+)`\]\(\.\./src/zerodp/\1\) \| \S", body, flags=re.M)


def test_the_one_module_table_lists_every_module():
    listed = _table_modules()
    assert len(listed) == len(set(listed)), "a module is listed twice"
    files = {p.relative_to(ROOT / "src" / "zerodp").as_posix() for p in (ROOT / "src" / "zerodp").rglob("*.py")}
    files = {f for f in files if not (f.endswith("/__init__.py") or f.endswith("/__main__.py"))}
    assert set(listed) == files, (f"docs/layout.md lists modules that do not exist: {sorted(set(listed) - files)}; "
                                  f"modules missing from it: {sorted(files - set(listed))}")
    # the one table: the README keeps no copy of it
    assert "| module |" not in README.read_text() and "group.py" not in README.read_text()
