"""``zerodp bench --compress/--shard-size``: compressed and hybrid contenders of ours (guide §14-§15).

The bytes each of them sends per step come from the engine's own trace; the ratios to the plain
row must be the planner's (``zerodp.plan.hybrid.wire_bytes``) for the collectives it compresses.
"""

from __future__ import annotations

import json

import pytest

from _engine_common import ALL_WORLDS
from zerodp.bench import schedule
from zerodp.bench import spec as bspec
from zerodp.bench.contenders import CONTENDERS, VARIANTS, Compression, engine_options, variant_name
from zerodp.bench.predict import WireCost, predict_step, predicted_wire_bytes
from zerodp.cli import main
from zerodp.plan.calibrated import PerKindCost
from zerodp.plan.hybrid import step_bytes_per_leg, wire_bytes
from zerodp.train.model import PRESETS

from _profiles import synthetic_profile


# ---- names, options, specs (no ranks) ------------------------------------------------------------
def test_default_spec_has_no_extra_contenders():
    spec = bspec.BenchSpec()
    assert spec.compress == ("none",) and spec.shard_size is None
    assert not [n for n in spec.contenders(with_auto=True) if n in VARIANTS]


def test_compress_names_are_the_planners_and_parsed_once():
    from zerodp.plan.hybrid import COMPRESSIONS

    assert [c.value for c in Compression] == list(COMPRESSIONS)
    spec = bspec.BenchSpec(compress=("none", "int8"))
    assert spec.compress == (Compression.NONE, Compression.INT8)
    assert all(isinstance(c, Compression) for c in spec.compress)
    assert json.loads(json.dumps(spec.compress)) == ["none", "int8"]  # bench.json keeps the spellings


def test_variants_sit_in_their_stage_group_beside_ours():
    spec = bspec.BenchSpec(world_size=4, stages=(0, 3), compress=("none", "bf16-reduce", "int8"), shard_size=2)
    groups = schedule.stage_groups(spec.contenders(with_auto=False))
    assert groups[0] == ["floor", "ours0", "ddp_bucket_view", "ddp", "ours0_bf16"]  # stage 0: bf16 only
    assert groups[1] == ["floor", "ours3", "fsdp2", "ours3_bf16", "ours3_int8", "ours3_hybrid",
                         "ours3_hybrid_bf16", "ours3_hybrid_int8"]
    assert engine_options("ours3_int8") == {"quantize_params": True, "quantize_grads": True}
    assert engine_options("ours0_bf16") == {"reduce_dtype": "bf16"}
    assert engine_options("ours3_hybrid_bf16", 2) == {"reduce_dtype": "bf16", "shard_size": 2}
    assert variant_name(1, "int8-grads", True) == "ours1_hybrid_int8g"
    assert all(CONTENDERS[n][1] == "ours" for n in VARIANTS)


@pytest.mark.parametrize("kw, message", [
    (dict(compress=("zip",)), "compress"),
    (dict(shard_size=2), "shard_size"),  # world 2: a shard group of 2 is flat, not hybrid
    (dict(world_size=4, shard_size=3), "shard_size"),
])
def test_spec_refuses_bad_compress_or_shard_size(kw, message):
    with pytest.raises(ValueError, match=message):
        bspec.BenchSpec(**kw)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--compress", "gzip"], "--compress"),
    (["bench", "--shard-size", "2"], "shard_size"),
])
def test_bench_cli_bad_compress(argv, message, capsys, tmp_path):
    assert main(argv + ["--quick", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_predict_prices_the_planner_wire(tmp_path):
    cal = json.load(open(synthetic_profile(tmp_path / "p.json", world=4)))["calibration"]
    cfg = PRESETS["nano"]
    flat = WireCost(cal, wire_bytes("none", 4, 4))
    plain = PerKindCost(cal)
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        assert flat.time(kind, 1 << 20) == pytest.approx(plain.time(kind, 1 << 20))
    base = predict_step(cal, cfg, 3, 1, 8)
    int8 = predict_step(cal, cfg, 3, 1, 8, compress="int8")
    assert int8.comm_s < base.comm_s
    assert int8.forward_s == base.forward_s and int8.optimizer_s == base.optimizer_s
    # the planner's bytes per leg: flat int8 = the fp32 figure × (1 + 4/256) / 4
    ratio = wire_bytes("int8", 4, 4).param_ratio
    assert ratio == pytest.approx((1 + 4 / 256) / 4)
    assert int8.wire_bytes["intra"] == pytest.approx(base.wire_bytes["intra"] * ratio)
    hyb = predict_step(cal, cfg, 1, 1, 8, shard_size=2)
    assert hyb.wire_bytes == pytest.approx(step_bytes_per_leg(1, 43904, 4, 2))
    assert hyb.wire_bytes["inter"] > 0
    with pytest.raises(ValueError, match="shard_size"):
        predict_step(cal, cfg, 1, 1, 8, shard_size=3)
    assert predicted_wire_bytes(0, 1000, 4, "bf16-reduce")["intra"] == pytest.approx(2 * 3 / 4 * 1000 * 2)


def test_predict_cli_compress(tmp_path, capsys):
    prof = synthetic_profile(tmp_path / "p.json", world=4)
    assert main(["predict", "--profile", prof, "--model", "nano", "--micro-batch", "1", "--stages", "0,3",
                 "--compress", "none,int8", "--shard-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and "intra + inter" in out
    assert out.count("\n") == 5  # title, header, stage 0 none (int8 does not apply), stage 3 none and int8


# ---- one real quick run: 4 ranks, stages 0 and 3, hybrid g = 2 (make fuzz) -----------------------
@pytest.mark.dist
@pytest.mark.skipif(not ALL_WORLDS,
                    reason="4 ranks: make fuzz (ZERODP_ALL_WORLDS=1) runs it; the matrix checks the compressed paths")
def test_bench_quick_compressed_and_hybrid(tmp_path, capsys):
    profile = synthetic_profile(tmp_path / "p.json", world=4)
    out, md = tmp_path / "out", tmp_path / "docs" / "b.md"
    assert main(["bench", "--quick", "--nproc", "4", "--shard-size", "2", "--stages", "0,3", "--regimes", "comm",
                 "--compress", "none,bf16-reduce,int8", "--profile", profile, "--out", str(out),
                 "--markdown", str(md)]) == 0
    printed = capsys.readouterr().out
    d = json.load(open(out / "bench.json"))
    cs = d["regimes"][0]["contenders"]
    want = ["ours0_bf16", "ours3_bf16", "ours3_int8", "ours3_hybrid", "ours3_hybrid_bf16", "ours3_hybrid_int8"]
    assert set(want) <= set(cs) and "ours0_hybrid" not in cs
    for name in want:
        assert CONTENDERS[name][2].replace("hybrid", "hybrid g=2") in printed
        c = cs[name]
        assert c["median_s"] > 0 and c["predicted_s"] > 0 and c["wire_bytes"]["intra"] > 0
    for name, c in cs.items():  # a bytes figure for every row of ours, none for the peers
        assert (c["wire_bytes"] is not None) == (c["role"] == "ours"), name

    def total(name):
        return sum(cs[name]["wire_bytes"].values())

    def kind(name, k):
        return cs[name]["own_comm"][k]["sent_bytes"]

    int8 = wire_bytes("int8", 4, 4, 256)
    bf16 = wire_bytes("bf16-reduce", 4, 4)
    # stage 0: one AllReduce of the gradients, in bf16: half the bytes
    assert total("ours0_bf16") == pytest.approx(total("ours0") * bf16.grad_ratio, rel=0.01)
    # stage 3 int8: AllGathers and ReduceScatters at (1 + 4/256)/4 of fp32 (padding: a few %)
    assert kind("ours3_int8", "all_gather") == pytest.approx(kind("ours3", "all_gather") * int8.param_ratio, rel=0.03)
    assert kind("ours3_int8", "reduce_scatter") == pytest.approx(
        kind("ours3", "reduce_scatter") * int8.grad_ratio, rel=0.03)
    assert total("ours3_int8") == pytest.approx(total("ours3") * int8.param_ratio, rel=0.03)
    assert total("ours3_int8") <= 0.3 * total("ours3")
    # bf16-reduce at stage 3 narrows the ReduceScatter only
    assert kind("ours3_bf16", "reduce_scatter") == pytest.approx(kind("ours3", "reduce_scatter") * 0.5, rel=0.01)
    assert kind("ours3_bf16", "all_gather") == pytest.approx(kind("ours3", "all_gather"), rel=0.01)
    # hybrid: the traced legs are the planner's (stage 3 gathers all but the kept root unit twice)
    for leg in ("intra", "inter"):
        assert cs["ours3_hybrid"]["wire_bytes"][leg] == pytest.approx(
            cs["ours3_hybrid"]["predicted_wire_bytes"][leg], rel=0.02), leg
    assert cs["ours3"]["wire_bytes"]["intra"] == pytest.approx(cs["ours3"]["predicted_wire_bytes"]["intra"], rel=0.02)
    # hybrid int8: the shard group's collectives at the int8 ratio
    assert cs["ours3_hybrid_int8"]["wire_bytes"]["intra"] == pytest.approx(
        cs["ours3_hybrid"]["wire_bytes"]["intra"] * int8.param_ratio, rel=0.03)
    rows = {r["name"]: r for r in d["compressed_rows"]}
    assert set(rows) == set(want)
    assert rows["ours3_int8"]["bytes_vs_plain"] == pytest.approx(total("ours3_int8") / total("ours3"))
    assert rows["ours3_int8"]["planner_vs_plain"] == pytest.approx(int8.param_ratio, rel=1e-6)
    text = md.read_text()
    assert "## Compressed and hybrid" in text and "MiB sent per rank per step" in text and "× floor" in text
    assert "--compress none,bf16-reduce,int8" in text and "--shard-size 2" in text
