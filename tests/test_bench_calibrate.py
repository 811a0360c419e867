"""Calibration: the alpha-beta fit recovers known α and W; a real sweep writes a profile the planner reads."""

import json

import pytest

from zerodp.bench import sweep
from zerodp.cli import main
from zerodp.plan import load_hardware
from zerodp.plan.collectives import RingCost


@pytest.mark.parametrize("kind", sweep.KINDS)
@pytest.mark.parametrize("n", [2, 4])
def test_fit_recovers_alpha_and_bandwidth(kind, n):
    truth = RingCost(alpha=30e-6, bandwidth=2e9, n=n)
    pts = []
    for i, v in enumerate(sweep.sweep_sizes(1024, 64 << 20)):
        t = truth.time(kind, v) * (1 + 0.02 * (-1) ** i)  # ±2% noise
        pts.append(sweep.Point(kind, v, t, v / t, 0.0))
    fit = sweep.fit_alpha_beta(pts, n)
    assert fit.alpha_s == pytest.approx(30e-6, rel=0.1)
    assert fit.bandwidth == pytest.approx(2e9, rel=0.1)
    assert fit.rel_rms < 0.05


def test_fit_refuses_flat_times():
    pts = [sweep.Point("all_reduce", v, 1e-3, 0.0, 0.0) for v in (1e3, 1e4, 1e5)]
    with pytest.raises(ValueError, match="does not grow with size"):
        sweep.fit_alpha_beta(pts, 2)


@pytest.mark.dist
def test_calibrate_writes_a_profile_plan_and_predict_accept(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--nproc", "2", "--max-bytes", "4194304", "--iters", "3",
                 "--model", "nano", "--micro-batch", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "algbw (GB/s)" in text and "busbw (GB/s)" in text and "alpha (us/hop)" in text
    hw = load_hardware(str(out))
    assert hw.devices_per_node == 2 and hw.flops > 0 and hw.intra_bw > 0
    assert main(["plan", "roofline", "--hardware", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["predict", "--profile", str(out), "--model", "nano", "--micro-batch", "2", "--json"]) == 0
    preds = json.loads(capsys.readouterr().out)
    assert [p["stage"] for p in preds] == [0, 1, 2, 3]
    for p in preds:
        parts = p["forward_s"] + p["backward_s"] + p["exposed_comm_s"] + p["optimizer_s"] + p["param_sync_s"]
        assert p["step_s"] == pytest.approx(parts)
        assert p["exposed_comm_s"] >= 0


def test_predict_without_profile_says_how_to_make_one(tmp_path, capsys):
    assert main(["predict", "--profile", str(tmp_path / "none.json")]) == 2
    assert "zerodp calibrate" in capsys.readouterr().err
