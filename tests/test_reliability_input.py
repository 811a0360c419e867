"""Issue 9, bad input: every row of the misuse table in docs/reliability.md is a case here.

The cases live in ``tests/_misuse_cases.py``; each one is run and its message compared with the
table's exactly (temporary paths shown as ``<tmp>``). A second test checks that the table in the
docs is the one generated from the same list, so behaviour and documentation cannot drift.
"""

import pytest

from _misuse_cases import CASES, DOC, ROOT, START, doc_table, normalise, render_table


def test_the_table_covers_every_area_with_at_least_15_cases():
    assert len(CASES) >= 15
    assert {c.area for c in CASES} == {"configuration", "CLI", "data", "checkpoint", "API"}
    assert len({c.id for c in CASES}) == len(CASES)


def test_the_docs_table_is_generated_from_the_cases():
    assert doc_table() == render_table(), (
        f"{DOC} is out of date with tests/_misuse_cases.py: run "
        "'.venv/bin/python tests/_misuse_cases.py --write'")


def test_the_table_lives_in_one_place():
    assert START not in (ROOT / "README.md").read_text(), "the misuse table is docs/reliability.md's alone"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_misuse_gives_the_documented_message(case, tmp_path):
    message = normalise(case.run(tmp_path), tmp_path)
    assert "Traceback" not in message
    assert message == case.expected
