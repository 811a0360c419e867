"""Docs that re-run: every ``$ zerodp plan ...`` console block of README.md and docs/*.md is what
the command prints now (tools/regen_console.py rewrites them), byte for byte except recommend's
"searched in N s" (tools/regen_console.IGNORE). Blocks of ``zerodp train`` and ``zerodp
plan-auto-regret`` (measured runs) are left alone, and listed here so that none goes unnoticed."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("regen_console", ROOT / "tools" / "regen_console.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)

#: console blocks of other commands, which the test does not re-run: (file, command)
NOT_RERUN = {("docs/planner.md", "zerodp train --plan auto --out /tmp/ap/default2 --no-progress"),
             ("docs/planner.md", "zerodp plan-auto-regret --out /tmp/par50"),
             ("docs/reliability.md", "zerodp train --replica-groups 2 --nproc 2 --model nano --seq-len 32 "
                                     "--global-batch-tokens 512 \\")}


def test_every_plan_console_block_prints_what_the_doc_shows():
    diffs = regen.check()
    assert not diffs, "re-run python tools/regen_console.py:\n" + "".join(diffs)[:4000]


def test_the_blocks_cover_every_plan_command():
    text = (ROOT / "docs" / "planner.md").read_text()
    shown = {c.split()[2] for c in regen.commands(text)}
    assert shown >= {"memory", "comm", "roofline", "batch", "simulate", "recommend", "report"}


def test_only_listed_blocks_are_not_rerun():
    others = set()
    for path in regen.FILES:
        for m in regen._BLOCK.finditer(path.read_text()):
            for line in m.group(1).splitlines():
                if line.startswith("$ zerodp ") and not line.startswith(regen.PREFIX):
                    others.add((str(path.relative_to(ROOT)), line[2:].strip()))
    assert others == NOT_RERUN


def test_the_check_catches_a_changed_figure():
    good = regen.regenerate("```console\n$ zerodp plan batch --gpus 128\n```\n")
    assert "grad_acc                4  steps" in good
    bad = good.replace("grad_acc                4  steps", "grad_acc                5  steps")
    assert regen.masked(bad) != regen.masked(good) and regen.regenerate(bad) == good
