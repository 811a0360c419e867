"""The planner against published FSDP runs (zerodp/plan/validation.json, docs/planner.md,
"Validation against published runs"): every run predicted within its band, the bands read from
the table, the command's exit status, and parameters fitted on some runs predicting the others."""

import copy
import json

import pytest

from zerodp.cli import main
from zerodp.plan import report
from zerodp.plan.hardware import COMPUTE, clock_factor, get_hardware, with_power_limit

DATA = report.load_validation()


def test_the_table_holds_the_published_runs_with_their_sources():
    runs = DATA["runs"]
    assert len(runs) == len({r["id"] for r in runs}) == 22
    for r in runs:
        assert r["url"].startswith("https://github.com/") and r["date"] and r["source"]
        assert r["measured_tps_per_gpu"] > 0 and r["gpus"] >= 8
    # the runs, as their sources print them
    by_id = {r["id"]: r for r in runs}
    assert by_id["tt-h100-l3-8b-8"]["measured_tps_per_gpu"] == 5762
    assert by_id["tt-h100-l3-8b-8"]["measured_memory_gib"] == 82.4
    assert by_id["tt-a100-l3-8b-op"]["measured_tps_per_gpu"] == 2973
    assert by_id["tt-a100-l3-70b-full"]["measured_tps_per_gpu"] == 331
    assert (DATA["tps_band"], DATA["memory_band"]) == (0.15, 0.10)


def test_every_run_is_predicted_within_the_band():
    v = report.validate()
    assert v.ok
    for row, run in zip(v.rows, DATA["runs"]):
        ratio = row["predicted_tps"] / run["measured_tps_per_gpu"]
        assert abs(ratio - 1) <= DATA["tps_band"], (run["id"], ratio)
        if run.get("measured_memory_gib") is not None:
            m = row["predicted_memory_gib"] / run["measured_memory_gib"]
            assert abs(m - 1) <= DATA["memory_band"], (run["id"], m)
    # the spread the single 50 % efficiency had (0.80x-1.51x) is gone
    ratios = [r["tps_ratio"] for r in v.rows]
    assert max(ratios) / min(ratios) < 1.2


def test_the_command_prints_the_table_and_fails_outside_the_band(tmp_path, capsys):
    assert main(["plan", "validate"]) == 0
    out = capsys.readouterr().out
    assert "tt-h100-l3-8b-8" in out and "all within the band" in out
    bad = copy.deepcopy(DATA)
    bad["runs"][0]["measured_tps_per_gpu"] *= 1.3  # a run 30 % faster than the planner says
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert main(["plan", "validate", "--table", str(path)]) == 1
    out = capsys.readouterr().out
    assert "OUTSIDE THE BAND" in out and " NO" in out


def test_memory_is_the_planners_peak_times_the_allocator_slack():
    v = report.validate()
    rows = {r["id"]: r for r in v.rows}
    r8, r128 = rows["tt-h100-l3-8b-8"], rows["tt-h100-l3-8b-128"]
    for r in (r8, r128):
        assert r["predicted_memory_gib"] == pytest.approx(r["peak_gib"] * report.RESERVED_OVER_PEAK)
    # 8 → 128 GPUs: the model states shrink by 16·Ψ·(1/8 − 1/128) bytes, nothing else moves
    psi = 8.03e9
    assert (r8["peak_gib"] - r128["peak_gib"]) * 2**30 == pytest.approx(16 * psi * (1 / 8 - 1 / 128),
                                                                        rel=0.01)


def test_parameters_fitted_on_half_the_runs_predict_the_other_half():
    runs = DATA["runs"]
    fitted = report.fit_constants(runs[0::2], iters=60)
    held_max, _ = report._errors(runs[1::2], fitted)
    assert held_max <= DATA["tps_band"]


def test_a_power_limit_slows_the_clock_by_the_cube_root():
    h = get_hardware("H100 96GB")
    assert h.power_limit_w == 500 and clock_factor(h) == pytest.approx((500 / 700) ** (1 / 3))
    assert clock_factor(with_power_limit(h, 700)) == 1.0
    with pytest.raises(ValueError, match="TDP"):
        with_power_limit(get_hardware("TPU v5p"), 300)
    assert COMPUTE.attention_backward == 2.5 and COMPUTE.optimizer_bytes == 28
