"""The short chaos run (``make chaos`` runs the long one): two faults in one run of the nano model
under ``--max-restarts`` — a SIGKILL while a checkpoint is being written, then a SIGKILL during the
restart that follows — and the final parameters and optimizer states equal, bitwise, those of the
same run without faults (shared with test_preempt.py, tests/_straight.py). Side by side, a run
whose rank 0 is killed right after the checkpoint of the last step is complete: the restarted group
finds the run done and ends with status 0. See zerodp.train.chaos.
"""

import pytest

from zerodp.train.chaos import RUN, Launch, compare, env_with, run_chaos

from _straight import CKPT_EVERY, STEPS, straight
from _engine_common import in_make_fuzz

pytestmark = pytest.mark.dist


@in_make_fuzz("a killed rank restarts the group and ends bitwise (test_reliability_faults.py)")
def test_a_short_chaos_run_ends_bitwise_where_an_uninterrupted_run_ends(tmp_path, tmp_path_factory):
    # side by side: a rank killed right after the checkpoint of the last step is complete; the
    # restarted group must find the run done (status 0), not fail for want of steps to take
    late = Launch([*RUN, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--max-restarts", "1",
                   "--out", str(tmp_path / "late")], env_with(f"kill-save-complete:0:{STEPS}@0"), [])
    report = run_chaos(tmp_path, seed=0, steps=STEPS, ckpt_every=CKPT_EVERY, short=True, timeout_s=30,
                       limit_s=400, reference=straight(tmp_path_factory))
    print(report.text())
    assert report.passed, report.text()
    assert len(report.outcomes) == 2
    for o in report.outcomes:  # each fault happened, was noticed, and the run went on after it
        assert o.seen_at is not None and o.detected and o.recovered_s is not None, report.text()
    assert report.launches == [0] and report.final_step == STEPS

    rc = late.wait(400)
    text = "\n".join(ln.text for ln in late.lines)
    assert rc == 0, text[-3000:]
    assert "the run had already completed its last step" in text and "nothing to redo" in text
    step, diff = compare(straight(tmp_path_factory)(), tmp_path / "late")
    assert step == STEPS and not diff, diff
