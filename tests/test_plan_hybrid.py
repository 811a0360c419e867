"""Guide §14: hybrid sharding and compressed collectives in the planner. Hand-derived bytes for
small cases, properties over many, the CLI's new flags and its one-line refusals."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerodp.cli import main
from zerodp.plan import memory_plan, model_states, threshold
from zerodp.plan.hybrid import (COMPRESSIONS, QUANT_BLOCK, check_shard_size, hybrid_model_states,
                                int8_bytes, step_bytes_per_leg, step_collectives, step_comm,
                                wire_bytes)


# ---- step_bytes_per_leg: hand-derived values ----------------------------------------------------
def test_flat_small_cases_by_hand():
    # Ψ = 1024 elements, 8 ranks, 4 bytes: AllReduce 2·7/8·4096; RS and AG 7/8·4096 each
    assert step_bytes_per_leg(0, 1024, 8) == {"intra": 7168.0, "inter": 0.0}
    assert step_bytes_per_leg(1, 1024, 8) == {"intra": 7168.0, "inter": 0.0}
    assert step_bytes_per_leg(2, 1024, 8, 8) == {"intra": 7168.0, "inter": 0.0}
    assert step_bytes_per_leg(3, 1024, 8) == {"intra": 3 * 3584.0, "inter": 0.0}
    assert step_bytes_per_leg(3, 1024, 8, gathers_per_step=1) == {"intra": 7168.0, "inter": 0.0}
    # one rank sends nothing
    assert step_bytes_per_leg(3, 1024, 1) == {"intra": 0.0, "inter": 0.0}


def test_hybrid_small_cases_by_hand():
    # world 8 = R 2 replicas x g 4; Ψ = 1024, fp32
    # RS over 4: 3/4·4096 = 3072; AG over 4: 3072; AllReduce over 2 of 1024/4·4 = 1024 B: 2·1/2·1024
    assert step_bytes_per_leg(1, 1024, 8, 4) == {"intra": 6144.0, "inter": 1024.0}
    assert step_bytes_per_leg(2, 1024, 8, 4) == {"intra": 6144.0, "inter": 1024.0}
    # stage 3: two AGs + one RS inside the group, the same AllReduce across
    assert step_bytes_per_leg(3, 1024, 8, 4) == {"intra": 3 * 3072.0, "inter": 1024.0}
    # stage 0 is plain DP over all 8, counted as inter
    assert step_bytes_per_leg(0, 1024, 8, 4) == {"intra": 0.0, "inter": 7168.0}
    # bf16 gradients, fp32 parameters: RS 3/4·2048 + AG 3/4·4096; AllReduce 2·1/2·(256·2)
    assert step_bytes_per_leg(2, 1024, 8, 4, grad_bytes=2) == {"intra": 1536.0 + 3072.0, "inter": 512.0}
    # g = 1: nothing to shard over, everything is the replica AllReduce
    assert step_bytes_per_leg(2, 1024, 8, 1) == {"intra": 0.0, "inter": 7168.0}


def test_collectives_listed_per_stage():
    kinds = [(c.kind, c.group, c.count) for c in step_collectives(3, 1024, 16, 8)]
    assert kinds == [("all_gather", "shard", 2), ("reduce_scatter", "shard", 1),
                     ("all_reduce", "replica", 1)]
    assert [c.kind for c in step_collectives(1, 1024, 16)] == ["reduce_scatter", "all_gather"]


def test_bad_shard_sizes_are_one_sentence():
    with pytest.raises(ValueError, match="shard size 3 does not divide the 8 GPUs"):
        step_bytes_per_leg(2, 1024, 8, 3)
    with pytest.raises(ValueError, match="does not divide"):
        check_shard_size(8, 16)
    with pytest.raises(ValueError, match="whole number"):
        check_shard_size(8, 0)


# ---- properties ------------------------------------------------------------------------------------
worlds = st.sampled_from([(r, g) for r in (1, 2, 3, 4, 8) for g in (1, 2, 4, 8, 16)])
numels = st.integers(1, 10**12)
stages = st.sampled_from([0, 1, 2, 3])
bytes_ = st.sampled_from([1, 1 + 4 / QUANT_BLOCK, 2, 4])


@given(stages, numels, st.integers(1, 4096), bytes_, bytes_, st.integers(0, 4))
def test_flat_equals_hybrid_with_g_equal_world(stage, numel, world, pb, gb, gathers):
    kw = dict(param_bytes=pb, grad_bytes=gb, gathers_per_step=gathers)
    assert step_bytes_per_leg(stage, numel, world, None, **kw) == step_bytes_per_leg(stage, numel, world, world, **kw)


@given(st.sampled_from([1, 2, 3]), numels, worlds, bytes_, bytes_)
def test_hybrid_is_a_flat_group_plus_an_allreduce_across(stage, numel, rg, pb, gb):
    replicas, g = rg
    kw = dict(param_bytes=pb, grad_bytes=gb)
    hybrid = step_bytes_per_leg(stage, numel, replicas * g, g, **kw)
    # inside the group: exactly the flat step of a g-rank world
    assert hybrid["intra"] == pytest.approx(step_bytes_per_leg(stage, numel, g, **kw)["intra"], rel=1e-12)
    # across: 2(R−1)/R · Ψ·gb / g
    assert hybrid["inter"] == pytest.approx(2 * (replicas - 1) / replicas * numel * gb / g, rel=1e-12)


@given(st.sampled_from([1, 2, 3]), numels, st.sampled_from([2, 4, 8, 16]))
def test_inter_bytes_halve_when_g_doubles(stage, numel, replicas):
    inter = [step_bytes_per_leg(stage, numel, replicas * g, g)["inter"] * g for g in (1, 2, 4, 8)]
    assert all(x == pytest.approx(inter[0], rel=1e-12) for x in inter)


@given(stages, st.floats(1e6, 1e13), st.sampled_from([1, 2, 4, 8, 16, 32, 64]), st.booleans())
def test_memory_falls_as_g_grows_and_equals_flat_formula(stage, params, g, acc):
    n = 64
    here = hybrid_model_states(params, n, stage, g, fp32_grad_acc=acc).model_state_bytes
    assert here == model_states(params, g, stage, fp32_grad_acc=acc).model_state_bytes
    if g < n:
        wider = hybrid_model_states(params, n, stage, 2 * g, fp32_grad_acc=acc).model_state_bytes
        assert wider <= here
        assert (wider < here) == (stage > 0)
    assert hybrid_model_states(params, n, stage, None).model_state_bytes == \
        model_states(params, n, stage).model_state_bytes


@given(st.sampled_from(list(COMPRESSIONS)), st.sampled_from(["bf16", "fp32", "fp8"]),
       st.sampled_from([32, 64, 256, 2048]))
def test_compression_ratios(compress, precision, block):
    from zerodp.plan.memory import PRECISIONS
    prec = PRECISIONS[precision]
    w = wire_bytes(compress, prec["param_bytes"], prec["grad_bytes"], block)
    assert w.wire_param_bytes <= w.param_bytes and w.wire_grad_bytes <= w.grad_bytes
    q = 1 + 4 / block
    if compress in ("int8", "int8-params"):
        assert w.wire_param_bytes == min(q, prec["param_bytes"])
    if compress in ("int8", "int8-grads"):
        assert w.wire_grad_bytes == min(q, prec["grad_bytes"])
    if compress == "bf16-reduce":
        assert (w.wire_param_bytes, w.wire_grad_bytes) == (prec["param_bytes"], min(2, prec["grad_bytes"]))
    # the step's bytes scale with the wire's
    base = step_bytes_per_leg(2, 10**9, 64, 8, param_bytes=w.param_bytes, grad_bytes=w.grad_bytes)
    wired = step_bytes_per_leg(2, 10**9, 64, 8, param_bytes=w.wire_param_bytes, grad_bytes=w.wire_grad_bytes)
    assert wired["inter"] == pytest.approx(base["inter"] * w.grad_ratio, rel=1e-12)


def test_int8_bytes_per_element():
    assert int8_bytes() == 1 + 4 / 256 == 1.015625
    assert wire_bytes("bf16-reduce", 4, 4).wire_grad_bytes == 2
    # bf16 gradients become int8: about half the bytes
    assert wire_bytes("int8", 2, 2).grad_ratio == pytest.approx(0.5078125)
    with pytest.raises(ValueError, match="compress must be one of"):
        wire_bytes("zip")


# ---- on hardware -------------------------------------------------------------------------------------
def test_step_comm_zero3_keeps_gathers_off_the_nics():
    flat = step_comm("H100", 64, 3, 7.5e9)
    hybrid = step_comm("H100", 64, 3, 7.5e9, 8)
    # flat: the two AllGathers and the ReduceScatter cross nodes, 3 · 7/8 · 15 GB / 8 per GPU
    assert flat.inter_bytes == pytest.approx(3 * 7 / 8 * 15e9 / 8)
    # hybrid: only the AllReduce of the 1/8 shard: 2 · 7/8 · 15 GB / 8
    assert hybrid.inter_bytes == pytest.approx(2 * 7 / 8 * 15e9 / 8)
    assert hybrid.time_s < flat.time_s
    assert hybrid.ring_bytes == step_bytes_per_leg(3, 7.5e9, 64, 8, param_bytes=2, grad_bytes=2)


def test_step_comm_refuses_groups_across_node_boundaries():
    with pytest.raises(ValueError, match="straddles nodes of 8"):
        step_comm("H100", 48, 2, 1e9, 12)
    assert step_comm("H100", 64, 2, 1e9, 16).inter_bytes > 0  # two whole nodes per group


def test_roofline_levers():
    flat = threshold("H100", 1024)
    assert threshold("H100", 1024, shard_size=1024).threshold_tokens == flat.threshold_tokens
    # the guide's threshold assumes the two-leg AllReduce; hybrid at g = 8 sends the same NIC bytes
    assert threshold("H100", 1024, shard_size=8).threshold_tokens == pytest.approx(flat.threshold_tokens)
    # int8 on both wires: (1 + 4/256)·2 bytes against 2 + 2
    assert threshold("H100", 1024, compress="int8").threshold_tokens == \
        pytest.approx(flat.threshold_tokens * 2 * 1.015625 / 4)
    assert threshold("H100", compress="int8-grads").threshold_tokens == pytest.approx(2475 * 3.015625 / 4)
    assert threshold("H100").threshold_tokens == 2475  # the guide's number is untouched


def test_memory_plan_shard_size():
    mp = memory_plan("zero-7.5b", 64, "H100", shard_size=8)
    assert (mp.shard_size, mp.replicas) == (8, 8)
    z3 = mp.stages[3]
    assert z3["model_state_bytes"] == pytest.approx(16 * 7.5e9 / 8)
    assert (z3["n"], z3["shard_size"]) == (64, 8)


# ---- CLI ---------------------------------------------------------------------------------------------
def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_memory_shard_size(capsys):
    d = run_json(capsys, "memory", "--params", "7.5e9", "--gpus", "64", "--shard-size", "8")
    assert [round(s["model_state_bytes"] / 1e9, 1) for s in d["stages"]] == [120, 41.2, 28.1, 15]
    assert [c["stage"] for c in d["comm"]] == [0, 1, 2, 3]
    # --shard-size alone: the GPUs per node of the hardware
    alone = run_json(capsys, "memory", "--params", "7.5e9", "--gpus", "64", "--shard-size")
    assert alone["shard_size"] == 8 and alone["stages"] == d["stages"]


def test_cli_comm_step(capsys):
    d = run_json(capsys, "comm", "--params", "7.5e9", "--gpus", "64", "--shard-size", "node",
                 "--stage", "3", "--compress", "int8")
    s = d["steps"][0]
    assert s["shard_size"] == 8 and s["wire"]["wire_param_bytes"] == 1.015625
    # int8 inside the shard group; the averaged shard crosses the replicas in bf16 (the reduce dtype)
    assert s["ring_bytes"] == step_bytes_per_leg(3, 7.5e9, 64, 8, param_bytes=1.015625, grad_bytes=1.015625,
                                                 replica_grad_bytes=2)
    assert main(["plan", "comm", "--model", "zero-7.5b", "--gpus", "64", "--shard-size"]) == 0
    out = capsys.readouterr().out
    assert "NVLink B/GPU" in out and "8 replicas" in out


def test_cli_roofline_levers(capsys):
    d = run_json(capsys, "roofline", "--gpus", "1024", "--shard-size", "8", "--compress", "int8")
    assert d["threshold"]["threshold_tokens"] == pytest.approx(threshold("H100", 1024, shard_size=8,
                                                                         compress="int8").threshold_tokens)
    assert d["threshold"]["replicas"] == 128


@pytest.mark.parametrize("argv, says", [
    (["memory", "--gpus", "64", "--shard-size", "3"], "shard size 3 does not divide the 64 GPUs"),
    (["roofline", "--gpus", "48", "--shard-size", "12"], "straddles nodes of 8"),
    (["comm", "--bytes", "1e9", "--shard-size", "4"], "--shard-size applies to a step's collectives"),
    (["comm", "--bytes", "1e9", "--params", "1e9"], "not both"),
])
def test_cli_bad_levers_one_line(capsys, argv, says):
    assert main(["plan", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_cli_shard_size_not_a_number(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "memory", "--shard-size", "eight"])
    err = capsys.readouterr().err.strip()
    assert "shard-size" in err and len(err.splitlines()) == 1


def test_guide_section_14_worked_example_is_what_the_planner_prints():
    """guide §14.6 in both languages quotes these figures; they must stay the planner's."""
    from pathlib import Path

    from zerodp.plan._common import fmt_bytes, fmt_time
    docs = Path(__file__).resolve().parents[1] / "docs"
    figures = []
    for g, compress in ((None, "none"), (8, "none"), (8, "int8")):
        c = step_comm("H100", 64, 3, 7.5e9, g, compress=compress)
        figures += [fmt_bytes(c.intra_bytes), fmt_bytes(c.inter_bytes), fmt_time(c.intra_s),
                    fmt_time(c.inter_s), fmt_time(c.time_s)]
    for g in (None, 8):
        bill = memory_plan("zero-7.5b", 64, "H100", shard_size=g)
        figures += [fmt_bytes(s["model_state_bytes"]) for s in bill.stages]
    figures += [f"{threshold('H100', 1024, shard_size=8, compress=c).threshold_tokens:,.0f}"
                for c in ("none", "int8-params", "int8-grads", "int8")]
    figures += [f"{threshold('H800', 2048, shard_size=g, compress='int8').threshold_tokens:,.0f}" for g in (None, 4)]
    for name in ("guide.md", "guide.zh.md"):
        text = (docs / name).read_text(encoding="utf-8")
        section = text[text.index('<a id="s14-6"></a>'):]
        section = section[:section.index('<a id="s15"></a>')] if '<a id="s15"></a>' in section else section
        missing = [f for f in figures if f not in section]
        assert not missing, (name, missing)
