"""``zerodp plan-auto-regret`` (zerodp.bench.plan_auto): --plan auto's regret and the pick's
prediction error, from a separate measurement of the planner's top K. make test checks the
arithmetic and the table on synthetic timings and the command's --help and refusals; make fuzz
(ZERODP_ALL_WORLDS=1) runs it for real on one small setting."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from zerodp.bench import plan_auto
from zerodp.bench.plan_auto import Result, Setting
from zerodp.cli import main
from zerodp.train.autoplan import Trial

MORE = bool(os.environ.get("ZERODP_ALL_WORLDS") or os.environ.get("ZERODP_ENGINE_FUZZ"))

#: the planner's top 5 (stage, micro-batch, predicted s)
TOP5 = [(1, 32, 0.040), (2, 32, 0.040), (0, 32, 0.042), (3, 32, 0.045), (1, 16, 0.050)]


def _trials(measured, n=None):
    """Two rounds of two timed steps each, 10 % either side of the measured step."""
    return tuple(Trial(rank=i, stage=s, micro_batch=m, grad_acc=64 // (2 * m), bucket_mb=0.5,
                       predicted_s=p, measured_s=t, steps=(0.9 * t, 0.9 * t, 1.1 * t, 1.1 * t))
                 for i, ((s, m, p), t) in enumerate(zip(TOP5[:n or len(measured)], measured), 1))


def _result(choice, measured, setting=Setting("nano", 64, 4096)):
    return Result(setting, _trials(choice, 3), _trials(measured))


def test_the_pick_is_plan_autos_and_is_judged_on_the_separate_measurement():
    # plan-auto's trial found #3 (stage 0) fastest; the measurement finds #5 fastest
    r = _result([0.060, 0.058, 0.052], [0.061, 0.059, 0.056, 0.070, 0.050])
    assert (r.pick.rank, r.pick.stage, r.pick.measured_s) == (3, 0, 0.056)  # the measurement's timing
    assert (r.first.rank, r.best.rank) == (1, 5)
    assert r.regret == pytest.approx(0.056 / 0.050)
    assert r.first_regret == pytest.approx(0.061 / 0.050)
    assert r.prediction_error == pytest.approx(0.042 / 0.056 - 1)
    assert r.spread(r.pick) == pytest.approx(0.2) and r.noise == pytest.approx(0.2)  # rounds 0.9× and 1.1×
    d = r.to_dict()
    assert d["meets_goal"] is False and d["pick"] == {"stage": 0, "micro_batch": 32}
    assert len(d["choice"]) == 3 and len(d["measured"]) == 5
    json.dumps(d)  # all of it is JSON


def test_a_pick_that_was_the_best_has_regret_one():
    r = _result([0.050, 0.058, 0.052], [0.049, 0.059, 0.055, 0.070, 0.050])
    assert r.pick.rank == 1 and r.regret == 1.0 and r.first_regret == 1.0


def test_the_table_prints_each_setting_with_units_and_the_goal():
    good = _result([0.050, 0.058, 0.052], [0.049, 0.059, 0.055, 0.070, 0.050])
    bad = _result([0.060, 0.058, 0.052], [0.061, 0.059, 0.056, 0.070, 0.050], Setting("tiny", 128, 8192))
    lines = plan_auto.table([good, bad]).splitlines()
    assert "ms per step" in lines[0]
    head = lines[1].split("  ")
    assert {"regret", "pick ms", "best ms", "pred. error", "round spread", "regret <= 1.10"} <= {
        h.strip() for h in head}
    row1, row2 = lines[3], lines[4]
    assert row1.startswith("nano 64×64") and "#1 s1 mb32" in row1 and row1.split()[-1] == "yes"
    assert "1.000" in row1 and "49.0" in row1 and "-18.4%" in row1  # 40 ms predicted / 49 ms - 1
    assert row1.split()[-2] == "20%"
    assert row2.startswith("tiny 64×128") and "#3 s0 mb32" in row2 and "#5 s1 mb16" in row2
    assert "1.120" in row2 and "1.220" in row2 and row2.split()[-1] == "NO"
    assert lines[-1].startswith("setting: model, sequences × tokens")


def test_settings_parse_and_bad_ones_are_one_line():
    assert plan_auto.parse_settings(plan_auto.DEFAULT_SETTINGS)[0] == Setting("nano", 64, 4096)
    assert len(plan_auto.parse_settings(plan_auto.DEFAULT_SETTINGS)) >= 3
    assert Setting("tiny", 128, 8192).label == "tiny 64×128"
    for text, why in (("nano:64", "MODEL:SEQ_LEN"), ("huge:64:4096", "unknown model"),
                      ("nano:64:100", "whole number"), ("nano:64:4096,nano:64:4096", "twice"), (",", "empty")):
        with pytest.raises(ValueError, match=why):
            plan_auto.parse_settings(text)


def test_the_command_has_help_and_refuses_bad_input_in_one_line(capsys):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["plan-auto-regret", "-h"])
    assert done.value.code == 0
    text = out.getvalue()
    for flag in ("--settings", "--nproc", "--top", "--rounds", "--profile", "--out", "--json"):
        assert flag in text
    assert "regret" in text and plan_auto.DEFAULT_SETTINGS in text.replace("\n", "").replace(" ", "")
    for argv, why in ((["--settings", "nano:64"], "MODEL:SEQ_LEN"), (["--nproc", "1"], "--nproc"),
                      (["--top", "2"], "--top must be >= 3"), (["--rounds", "1"], "--rounds must be >= 2")):
        assert main(["plan-auto-regret", *argv, "--out", "/nonexistent/never"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, err


@pytest.mark.fuzz
@pytest.mark.dist
@pytest.mark.skipif(not MORE, reason="make fuzz (ZERODP_ALL_WORLDS=1): two real 2-rank runs, ~2 min on 2 CPUs")
def test_a_real_run_measures_every_candidate(tmp_path):
    import subprocess
    import sys

    from _profiles import synthetic_profile

    profile = synthetic_profile(tmp_path / "profile.json")
    done = subprocess.run([sys.executable, "-m", "zerodp.cli", "plan-auto-regret", "--settings", "nano:32:512",
                           "--top", "4", "--profile", str(profile), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / plan_auto.RESULT_FILE).read_text())
    (r,) = record["results"]
    # the top 4, and plan-auto's fastest of a stage they lack when it tried one (its pick may be that)
    assert len(r["choice"]) in (3, 4) and [c["rank"] for c in r["measured"][:4]] == [1, 2, 3, 4]
    assert {(c["stage"], c["micro_batch"]) for c in r["choice"]} <= {(c["stage"], c["micro_batch"])
                                                                       for c in r["measured"]}
    assert len(r["measured"]) <= 5
    assert done.stdout.count("measurement run ") == 2 * len(r["measured"])  # 2 rounds, a line each
    best = min(c["measured_s"] for c in r["measured"])
    pick = next(c for c in r["measured"]
                if {"stage": c["stage"], "micro_batch": c["micro_batch"]} == r["pick"])
    assert r["regret"] == pytest.approx(pick["measured_s"] / best) and r["regret"] >= 1
    assert f"{r['regret']:.3f}" in done.stdout.split("plan auto, measured:")[1]
    # --json: standard output is the JSON alone, the ranks' progress lines go to standard error
    done = subprocess.run([sys.executable, "-m", "zerodp.cli", "plan-auto-regret", "--settings", "nano:32:512",
                           "--top", "3", "--profile", str(profile), "--out", str(tmp_path / "json"), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (r,) = json.loads(done.stdout)
    assert len(r["measured"]) in (3, 4) and done.stderr.count("measurement run ") == 2 * len(r["measured"])
