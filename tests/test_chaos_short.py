"""The short chaos run (``make chaos`` runs the long one): two faults in one run of the nano model
under ``--max-restarts`` — a SIGKILL while a checkpoint is being written, then a SIGKILL during the
restart that follows — and the final parameters and optimizer states equal, bitwise, those of the
same run without faults (shared with test_preempt.py, tests/_straight.py). See zerodp.train.chaos.
"""

import pytest

from zerodp.train.chaos import run_chaos

from _straight import CKPT_EVERY, STEPS, straight

pytestmark = pytest.mark.dist


def test_a_short_chaos_run_ends_bitwise_where_an_uninterrupted_run_ends(tmp_path, tmp_path_factory):
    report = run_chaos(tmp_path, seed=0, steps=STEPS, ckpt_every=CKPT_EVERY, short=True, timeout_s=30,
                       limit_s=400, reference=straight(tmp_path_factory))
    print(report.text())
    assert report.passed, report.text()
    assert len(report.outcomes) == 2
    for o in report.outcomes:  # each fault happened, was noticed, and the run went on after it
        assert o.seen_at is not None and o.detected and o.recovered_s is not None, report.text()
    assert report.launches == [0] and report.final_step == STEPS
