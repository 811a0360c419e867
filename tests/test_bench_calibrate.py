"""Calibration: the alpha-beta fit recovers known α and W; a real sweep writes a profile the planner reads."""

import json

import pytest

from zerodp.bench import sweep
from zerodp.cli import main
from zerodp.plan import calibrated, load_hardware
from zerodp.plan.collectives import RingCost

from _profiles import collective_sweep
from _regret import expected_choice_mib


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
                 "--model", "nano", "--tokens", "8,64,128", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "algbw (GB/s)" in text and "busbw (GB/s)" in text and "alpha (us/hop)" in text
    assert "AdamW ms" in text and "overlap efficiency" in text
    with open(out) as f:
        compute = json.load(f)["calibration"]["compute"]
    assert [p["tokens"] for p in compute["points"]] == [8, 64, 128]
    assert [(p["micro_batch"], p["seq_len"]) for p in compute["points"]][-1] == (2, 64)
    with open(out) as f:
        ov = json.load(f)["calibration"]["overlap"]
    assert ov["tokens"] == 8 and ov["bytes"] > 0 and 0 <= ov["efficiency"] <= 1
    assert compute["tokens"] == 128 and all(p["forward_s"] > 0 and p["optimizer_s"] > 0 for p in compute["points"])
    hw = load_hardware(str(out))
    assert hw.devices_per_node == 2 and hw.flops > 0 and hw.intra_bw > 0
    assert main(["plan", "roofline", "--hardware", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["predict", "--profile", str(out), "--model", "nano", "--micro-batch", "2", "--json"]) == 0
    preds = json.loads(capsys.readouterr().out)
    assert [p["stage"] for p in preds] == [0, 1, 2, 3]
    for p in preds:
        parts = p["forward_s"] + p["backward_s"] + p["exposed_comm_s"] + p["optimizer_s"] + p["param_sync_s"]
        parts += p["contention_s"]
        assert p["step_s"] == pytest.approx(parts)
        assert p["exposed_comm_s"] >= 0


def test_predict_without_profile_says_how_to_make_one(tmp_path, capsys):
    assert main(["predict", "--profile", str(tmp_path / "none.json")]) == 2
    assert "zerodp calibrate" in capsys.readouterr().err


# ---- compute between and beyond the calibrated sizes -------------------------------------------
def _table(points):
    from zerodp.bench.compute import ComputePoint, ComputeProfile

    return ComputeProfile.from_points("small", 1000,
                                      [ComputePoint(t, 1, t, f, b, o) for t, f, b, o in points]).to_dict()


def test_compute_is_exact_at_measured_sizes_and_linear_between():
    from zerodp.plan.calibrated import compute_part, compute_times, optimizer_time

    c = _table([(32, 0.03, 0.06, 0.10), (256, 0.14, 0.28, 0.07), (2048, 1.1, 2.2, 0.068)])
    assert c["tokens"] == 2048 and c["forward_s"] == 1.1  # the main size is the largest
    assert compute_times(c, 32) == (0.03, 0.06)
    assert compute_times(c, 2048) == (1.1, 2.2)
    assert compute_part(c, 144, "forward_s") == pytest.approx((0.03 + 0.14) / 2)
    assert optimizer_time(c, 256) == pytest.approx(0.07)
    assert optimizer_time(c, 256, params=500) == pytest.approx(0.035)  # per parameter
    # beyond the largest: the last segment's slope; below the smallest: never negative
    assert compute_part(c, 4096, "backward_s") == pytest.approx(2.2 + (2.2 - 0.28) / (2048 - 256) * 2048)
    assert 0 <= compute_part(c, 1, "forward_s") <= 0.03
    # a time that falls with tokens is not extrapolated downwards past the last size
    assert optimizer_time(c, 8192) == pytest.approx(0.068)


def test_compute_from_an_older_profile_with_one_small_size():
    from zerodp.plan.calibrated import compute_times

    old = {"model": "small", "params": 1000, "tokens": 2048, "forward_s": 1.0, "backward_s": 2.0,
           "optimizer_s": 0.1, "small_tokens": 32, "small_forward_s": 0.03, "small_backward_s": 0.05}
    assert compute_times(old, 32) == (0.03, 0.05)
    assert compute_times(old, 2048) == (1.0, 2.0)
    single = {k: old[k] for k in ("model", "params", "tokens", "forward_s", "backward_s", "optimizer_s")}
    assert compute_times(single, 1024) == pytest.approx((0.5, 1.0))  # one size: proportional


def test_lockstep_takes_the_slowest_rank_per_iteration():
    from zerodp.bench.compute import lockstep_points

    rank0 = {64: [(1.0, 2.0, 0.5), (1.0, 2.0, 0.5), (1.0, 2.0, 0.5)]}
    rank1 = {64: [(1.5, 2.5, 0.1), (0.5, 1.0, 0.9), (1.5, 2.5, 0.1)]}
    (p,) = lockstep_points([rank0, rank1], seq_len=64)
    assert (p.tokens, p.micro_batch, p.seq_len) == (64, 1, 64)
    assert (p.forward_s, p.backward_s) == (1.5, 2.5)  # rank 1 was slower in 2 of 3 iterations
    assert p.optimizer_s == 0.5  # medians of [0.5, 0.9, 0.5]


def test_calibrate_refuses_bad_token_counts():
    from zerodp.bench.calibrate import calibrate
    from zerodp.bench.compute import iterations_for

    with pytest.raises(ValueError, match="multiple of the model's seq_len"):
        calibrate(2, model="nano", tokens=(100,))
    with pytest.raises(ValueError, match="positive"):
        calibrate(2, model="nano", tokens=(0, 64))
    with pytest.raises(ValueError, match="unknown model preset"):
        calibrate(2, model="huge", tokens=(64,))
    assert iterations_for(32, 2048) == 30 and iterations_for(2048, 2048) == 5


# ---- overlap efficiency: what hidden communication still costs ----------------------------------
def test_overlap_efficiency_from_the_three_times():
    from zerodp.bench.overlap import aggregate
    from zerodp.plan.calibrated import Overlap, contention_s, efficiency

    assert Overlap(1, 8, 0.100, 0.060, 0.100).efficiency == 1.0  # the AllReduce hid entirely
    assert Overlap(1, 8, 0.100, 0.060, 0.160).efficiency == 0.0  # one after the other
    assert Overlap(1, 8, 0.100, 0.060, 0.130).efficiency == pytest.approx(0.5)
    assert Overlap(1, 8, 0.100, 0.060, 0.200).efficiency == 0.0  # worse than serial: clipped
    assert contention_s(0.040, 0.25) == pytest.approx(0.030) and contention_s(-1.0, 0.0) == 0.0
    assert efficiency({}) == 1.0  # no measurement: the simulator's assumption
    o = aggregate([{"bytes": 64, "tokens": 8, "compute": [1.0, 3.0, 1.0], "comm": [1.0] * 3, "both": [1.5] * 3},
                   {"bytes": 64, "tokens": 8, "compute": [2.0, 1.0, 2.0], "comm": [1.0] * 3, "both": [2.0] * 3}])
    assert (o.compute_s, o.comm_s, o.both_s) == (2.0, 1.0, 2.0)  # slowest rank per iteration, median
    assert efficiency({"overlap": o.to_dict()}) == 1.0


def test_prediction_charges_hidden_communication_by_overlap_efficiency():
    from zerodp.plan.calibrated import Overlap
    from zerodp.bench.predict import predict_step
    from zerodp.train.model import PRESETS

    cal = _synthetic_calibration()
    cfg = PRESETS["small"]
    free = predict_step(cal, cfg, 0, 8)
    assert free.contention_s == 0.0  # no overlap measured: η = 1
    assert free.comm_s > free.exposed_comm_s > 0  # most of it hidden under backward
    serial = predict_step({**cal, "overlap": Overlap(1, 8, 1.0, 1.0, 2.0).to_dict()}, cfg, 0, 8)
    assert serial.contention_s == pytest.approx(free.comm_s - free.exposed_comm_s)
    assert serial.step_s == pytest.approx(serial.forward_s + serial.backward_s + serial.optimizer_s + serial.comm_s)
    for stage in (1, 2, 3):
        p = predict_step({**cal, "overlap": Overlap(1, 8, 1.0, 1.0, 2.0).to_dict()}, cfg, stage, 8)
        assert p.step_s == pytest.approx(p.forward_s + p.backward_s + p.optimizer_s + p.comm_s)


def test_auto_bucket_with_serialized_communication_takes_few_buckets():
    from zerodp.bench import auto
    from zerodp.plan.calibrated import Overlap
    from zerodp.train.model import PRESETS

    cal = _synthetic_calibration()
    serial = {**cal, "overlap": Overlap(1, 8, 1.0, 1.0, 2.0).to_dict()}
    cfg = PRESETS["small"]
    sweep = auto.bucket_sweep(serial, cfg, 2048)
    mb = auto.choose_bucket_mb(serial, cfg, 2048)
    assert mb == expected_choice_mib(sweep.points, 0.0, calibrated.ETA_UNCERTAINTY, calibrated.REGRET_TOLERANCE,
                                     calibrated.SWEET_SPOT_SLACK_S)
    least = min(p.comm_s for p in sweep.points)
    chosen = next(p for p in sweep.points if p.bucket_bytes / calibrated.MIB == mb)
    assert chosen.comm_s <= 1.1 * least  # with η near 0 the total communication is what counts
    assert mb >= auto.choose_bucket_mb(cal, cfg, 2048)  # fewer, larger buckets than with free overlap


def _synthetic_calibration(alpha=2e-3, bandwidth=1e9, world=2) -> dict:
    """A calibration table from a known α, W and compute, the 'small' model (no measurement)."""
    from zerodp.bench.calibrate import Calibration
    from zerodp.bench.compute import ComputePoint, ComputeProfile

    pts, fits = collective_sweep(alpha, bandwidth, world)
    comp = ComputeProfile.from_points("small", 10_942_464, [ComputePoint(32, 1, 32, 0.03, 0.06, 0.07),
                                                           ComputePoint(2048, 8, 256, 1.0, 2.0, 0.07)])
    return Calibration(world, "gloo", pts, fits, comp, "test").to_dict()["calibration"]
