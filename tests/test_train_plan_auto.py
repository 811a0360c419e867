"""``zerodp train --plan auto`` (zerodp.train.autoplan): the planner's top 3 tried for a few steps,
the table of predicted vs measured, the regret, and the run trained with the measured best."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib

import pytest

from zerodp.train import autoplan
from zerodp.train.autoplan import Trial
from zerodp.train.config import TrainConfig
from zerodp.train.model import PRESETS

RUN = ["--preset", "nano", "--seq-len", "32", "--global-batch-tokens", "512", "--steps", "2",
       "--eval-batches", "1", "--no-progress"]


def _trials(measured):
    return [Trial(rank=i, stage=i - 1, micro_batch=4, grad_acc=2, bucket_mb=0.5, predicted_s=0.1,
                  measured_s=m) for i, m in enumerate(measured, 1)]


def test_regret_is_the_first_picks_measured_step_over_the_best():
    assert autoplan.regret(_trials([0.12, 0.10, 0.15])) == pytest.approx(1.2)
    assert autoplan.regret(_trials([0.10, 0.11, 0.15])) == 1.0
    text = autoplan.table(_trials([0.12, 0.10, 0.15]))
    assert "measured best" in text.splitlines()[4] and "+20.0%" in text.splitlines()[3]
    assert text.splitlines()[-1].endswith("= 1.200")


def test_the_search_offers_only_what_the_trainer_runs():
    cfg = TrainConfig(preset="nano", seq_len=32, global_batch_tokens=512, nproc=2)
    assert autoplan.micro_batches(cfg) == [1, 2, 4, 8]  # 16 samples over 2 ranks, powers of two
    for t in autoplan.calibration_tokens(cfg, PRESETS["nano"].seq_len):
        assert t <= 64 or t % 64 == 0  # what zerodp calibrate accepts for nano (seq_len 64)
    assert "--nproc >= 2" in autoplan.refuse(TrainConfig(nproc=1), False)
    assert "torchrun" in autoplan.refuse(cfg, True)
    assert autoplan.refuse(cfg, False) is None


@pytest.mark.dist
def test_plan_auto_tries_three_and_trains_the_measured_best(tmp_path):
    from _profiles import synthetic_profile

    profile = synthetic_profile(tmp_path / "profile.json")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "zerodp.cli", "train", "--plan", "auto", "--profile",
                           str(profile), "--out", str(out), *RUN], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("plan auto: the planner's top "))
    record = json.loads((out / autoplan.RESULT_FILE).read_text())
    cands = record["candidates"]
    k = len(cands)
    assert k in (3, 4) and lines[head].startswith(f"plan auto: the planner's top {k},")
    assert lines[head + 1].split()[:3] == ["#", "stage", "micro-batch"]
    rows = [l.split() for l in lines[head + 3:head + 3 + k]]
    assert [r[0] for r in rows][:3] == ["1", "2", "3"]
    for c, n in zip(cands, record["trial_steps"]):  # at least TRIAL_STEPS, more for short steps
        assert n == autoplan.trial_steps(Trial(c["rank"], c["stage"], c["micro_batch"], c["grad_acc"],
                                               c["bucket_mb"], c["predicted_s"]))
        assert len(c["steps"]) == autoplan.ROUNDS * (n - 1)
    for row, c in zip(rows, cands):  # the table prints what the record keeps
        assert float(row[5]) == pytest.approx(c["predicted_s"] * 1e3, abs=0.06)
        assert float(row[6]) == pytest.approx(c["measured_s"] * 1e3, abs=0.06)
    best = min(cands, key=lambda c: c["measured_s"])
    assert record["regret"] == pytest.approx(cands[0]["measured_s"] / best["measured_s"])
    assert f"= {record['regret']:.3f}" in lines[head + 3 + k]
    assert math.isfinite(record["regret"]) and record["regret"] >= 1
    assert {k: record["chosen"][k] for k in ("stage", "micro_batch", "bucket_mb")} == \
        {k: best[k] for k in ("stage", "micro_batch", "bucket_mb")}
    # the run trained with the measured best, and config.toml repeats that run (no second trial)
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert start["stage"] == best["stage"] and start["config"]["micro_batch"] == best["micro_batch"]
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved.get("plan") is None and saved["stage"] == best["stage"]
    assert not (out / autoplan.TRIAL_DIR).exists()


def test_a_calibration_too_noisy_to_fit_is_retried_once_with_larger_messages(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 1:
            return subprocess.CompletedProcess(cmd, 2, "", f"zerodp calibrate: error: all_gather: time does "
                                                           f"not grow with size in this sweep; {autoplan.WIDEN}\n")
        return subprocess.CompletedProcess(cmd, 0, "C = 1.00 GFLOP/s per rank\n", "")

    monkeypatch.setattr(autoplan.subprocess, "run", fake_run)
    said = []
    cfg = TrainConfig(preset="nano", seq_len=32, global_batch_tokens=512, nproc=2)
    assert autoplan.ensure_profile(cfg, tmp_path, said.append) == str(tmp_path / autoplan.PROFILE_FILE)
    sizes = [int(c[c.index("--max-bytes") + 1]) for c in calls]
    assert len(calls) == 2 and sizes[1] == 8 * sizes[0]
    assert any("once more" in s for s in said) and said[-1] == "  C = 1.00 GFLOP/s per rank"
    calls.clear()
    monkeypatch.setattr(autoplan.subprocess, "run", lambda cmd, **kw: (
        calls.append(cmd), subprocess.CompletedProcess(cmd, 2, "", "zerodp calibrate: error: boom\n"))[1])
    with pytest.raises(RuntimeError, match="boom"):
        autoplan.ensure_profile(cfg, tmp_path / "other", said.append)
    assert len(calls) == 1  # another failure is not retried


def test_the_trial_adds_the_fastest_of_a_missing_stage_when_near(monkeypatch):
    """Step 3: the top 3, plus the fastest configuration of a stage they lack when it is predicted
    within NEAR of the first pick; none when it is farther."""
    import types

    import zerodp.plan.recommend  # noqa: F401  (the package exports a function of the same name)
    recommend_mod = sys.modules["zerodp.plan.recommend"]

    def fake(steps):
        cands = [types.SimpleNamespace(stage=s, micro_batch=m, step_s=t) for s, m, t in steps]
        return lambda *a, **kw: types.SimpleNamespace(candidates=cands[:kw["top"]], searched=len(cands),
                                                       elapsed_s=0.0, notes=[], rejected=[])

    cfg = TrainConfig(preset="nano", seq_len=64, global_batch_tokens=4096, nproc=2)
    ranked = [(1, 32, 1.00), (2, 32, 1.00), (1, 16, 1.04), (2, 16, 1.05), (0, 32, 1.10), (3, 32, 1.12)]
    monkeypatch.setattr(recommend_mod, "recommend", fake(ranked))
    _, plain = autoplan.candidates(cfg, "profile.json")
    assert [(t.rank, t.stage) for t in plain] == [(1, 1), (2, 2), (3, 1)]
    _, wide = autoplan.candidates(cfg, "profile.json", other_stage=True)
    assert [(t.rank, t.stage, t.micro_batch) for t in wide] == [(1, 1, 32), (2, 2, 32), (3, 1, 16), (5, 0, 32)]
    far = [(s, m, t if s != 0 and s != 3 else 1 + autoplan.NEAR + 0.01) for s, m, t in ranked]
    monkeypatch.setattr(recommend_mod, "recommend", fake(far))
    _, wide = autoplan.candidates(cfg, "profile.json", other_stage=True)
    assert [t.rank for t in wide] == [1, 2, 3]


def test_short_steps_get_more_trial_steps():
    def t(predicted_s):
        return Trial(1, 1, 8, 1, 0.5, predicted_s)
    assert autoplan.trial_steps(t(1.0)) == autoplan.TRIAL_STEPS
    assert autoplan.trial_steps(t(0.02)) == 25  # 0.5 s of 20 ms steps
    assert autoplan.trial_steps(t(1e-6)) == autoplan.MAX_TRIAL_STEPS
