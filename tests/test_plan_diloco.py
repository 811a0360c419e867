"""The planner's DiLoCo (guide §16, zerodp/plan/diloco.py): the bytes per step against a brute
simulation of which fragment syncs on which inner step, the acceptance ratios on the trainable
GPT presets, the outer state, the crossover's exact solution against a bisection on the step
times and against the guide's closed form, the measured-loss table, and the CLI."""

import contextlib
import io
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerodp.cli import main
from zerodp.plan import get_model, hardware_from_dict
from zerodp.plan.diloco import (LOSS_TABLE, DiLoCoSettings, GroupLink, crossover,
                                diloco_bytes, diloco_plan, fragments_due,
                                group_link, load_loss_table, loss_figure, measured_loss,
                                outer_state_bytes, outer_step_seconds)
from zerodp.plan.hardware import get_hardware, save_hardware, with_inter_group
from zerodp.plan.recommend import recommend

QUANT_BLOCK = 256


def _wire(compress):
    return 1 + 4 / QUANT_BLOCK if compress == "int8" else 4.0


def _brute(numel, r, g, every, fragments, compress, steps):
    """Inner steps 1..steps: which fragments sync (the engine's rule, (k − f·H/F) mod H = 0,
    written out here), and the bytes one rank sends on each step: an AllReduce over the R
    replica peers of its 1/g shard of the fragment, 2(R−1)/R per byte."""
    size = numel / fragments
    per_step, syncs = [], [0] * fragments
    for k in range(1, steps + 1):
        sent = 0.0
        for f in range(fragments):
            if (k - int(f * every / fragments)) % every == 0:
                syncs[f] += 1
                sent += 2 * (r - 1) / r * (size / g) * _wire(compress)
        per_step.append(sent)
    return per_step, syncs


@given(r=st.integers(1, 6), g=st.sampled_from([1, 2, 4, 8]), every=st.integers(1, 60),
       frac=st.floats(0, 1), compress=st.sampled_from(["none", "int8"]),
       stage=st.sampled_from([0, 1, 2, 3]))
def test_bytes_per_step_equal_a_brute_simulation_over_three_outer_steps(r, g, every, frac,
                                                                         compress, stage):
    fragments = 1 + int(frac * (every - 1))
    numel = 1_000_003.0 * g
    s = DiLoCoSettings(every=every, fragments=fragments, compress=compress)
    b = diloco_bytes(numel, r * g, g, s, stage)
    per_step, syncs = _brute(numel, r, g, every, fragments, compress, 3 * every)
    assert syncs == [3] * fragments  # every fragment once per H steps
    assert b.cross_bytes_per_step == pytest.approx(sum(per_step) / (3 * every), rel=1e-12, abs=1e-9)
    assert b.peak_cross_bytes_per_step == pytest.approx(max(per_step), rel=1e-12, abs=1e-9)
    assert b.sync_cross_bytes == pytest.approx(2 * (r - 1) / r * numel / g * _wire(compress),
                                               rel=1e-12, abs=1e-9)
    # stage 0: the new parameters AllGathered in the shard group after a sync, fp32
    assert b.sync_intra_bytes == (pytest.approx((g - 1) / g * 4 * numel) if stage == 0 else 0)
    for k in range(1, 3 * every + 1):
        due = fragments_due(k, every, fragments)
        assert sum(b.fragment_cross_bytes[f] for f in due) == pytest.approx(per_step[k - 1],
                                                                             abs=1e-9)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_acceptance_ratios_two_groups_of_two_at_h100(name):
    """≥ 400x less cross-group traffic than DDP at H = 100 with int8, ≥ 100x in fp32 (R = 2,
    g = 2, ZeRO-3 inside, fp32 as the engine's CPU runs)."""
    psi = get_model(name).params
    ddp = 2 * 3 / 4 * 4 * psi  # AllReduce over N = 4 of fp32 gradients
    for compress, floor in (("int8", 400), ("none", 100)):
        b = diloco_bytes(psi, 4, 2, DiLoCoSettings(every=100, compress=compress), 3)
        mine = 2 * 1 / 2 * psi / 2 * _wire(compress) / 100
        assert b.ddp_cross_bytes_per_step == pytest.approx(ddp)
        assert b.cross_bytes_per_step == pytest.approx(mine)
        assert b.ddp_ratio == pytest.approx(ddp / mine) and b.ddp_ratio >= floor
    assert diloco_bytes(psi, 4, 2, DiLoCoSettings(every=100), 3).ddp_ratio == pytest.approx(300)


@pytest.mark.parametrize("momentum, per", [(0.9, 8), (0.0, 4)])
def test_outer_state_is_8_psi_over_g(momentum, per):
    for psi, g in ((875_264, 2), (10_942_464, 4), (7.5e9, 8)):
        assert outer_state_bytes(psi, g, momentum) == per * psi / g
        b = diloco_bytes(psi, 2 * g, g, DiLoCoSettings(every=10, momentum=momentum), 3)
        assert b.outer_state_bytes == per * psi / g
    plan = diloco_plan("tiny", "H100", 4, 2, 3, every=100, precision="fp32")
    assert plan.methods[2]["outer_state_bytes"] == 8 * get_model("tiny").params / 2


def test_one_replica_group_sends_nothing_across():
    b = diloco_bytes(1e6, 4, 4, DiLoCoSettings(every=10), 3)
    assert b.cross_bytes_per_step == b.ddp_cross_bytes_per_step == 0 and b.ddp_ratio is None
    assert diloco_plan(1e6, "H100", 4, 4, 3, every=10).crossover == "one group"


@given(r=st.integers(2, 8), g=st.sampled_from([1, 2, 4, 8]), every=st.integers(1, 500),
       frac=st.floats(0, 1), compress=st.sampled_from(["none", "int8"]),
       stage=st.sampled_from([0, 1, 2, 3]), delay_frac=st.floats(0, 1),
       latency=st.sampled_from([0.0, 1e-6, 2e-5, 1e-3]), compute=st.sampled_from([0.0, 1e-3, 0.1]),
       outer=st.sampled_from([None, 1e-5, 0.05]), overlap=st.booleans(),
       precision=st.sampled_from(["fp32", "bf16"]))
def test_the_exact_crossover_agrees_with_a_bisection_on_the_step_times(
        r, g, every, frac, compress, stage, delay_frac, latency, compute, outer, overlap,
        precision):
    fragments = 1 + int(frac * (every - 1))
    s = DiLoCoSettings(every=every, fragments=fragments, compress=compress,
                       delay=int(delay_frac * (every - 1)))
    if s.wire_bytes > every * (4 if precision == "fp32" else 2):
        return  # DiLoCo would send more per step than hybrid ZeRO: no single crossing
    plan = diloco_plan(2e7, "H100", r * g, g, stage, s, precision=precision, compute_s=compute,
                       inter_group_bw=1e9, inter_group_latency=latency, outer_s=outer,
                       overlap=overlap)
    if plan.crossover == "below":
        assert plan.crossover_bisection_bytes_per_s == pytest.approx(
            plan.crossover_bandwidth_bytes_per_s, rel=1e-6)
        # either side of W*: DiLoCo faster below, hybrid ZeRO no slower above
        for w, faster in ((plan.crossover_bandwidth_bytes_per_s * 0.99, True),
                          (plan.crossover_bandwidth_bytes_per_s * 1.01, False)):
            p = diloco_plan(2e7, "H100", r * g, g, stage, s, precision=precision,
                            compute_s=compute, inter_group_bw=w, inter_group_latency=latency,
                            outer_s=outer, overlap=overlap)
            assert (p.methods[1]["step_s"] > p.methods[2]["step_s"]) == faster
    else:
        assert plan.crossover_bisection_bytes_per_s is None


@given(r=st.integers(2, 8), g=st.sampled_from([1, 2, 4, 8]), every=st.integers(2, 500),
       frac=st.floats(0, 1), compress=st.sampled_from(["none", "int8"]),
       stage=st.sampled_from([1, 2, 3]), latency=st.sampled_from([0.0, 1e-6, 2e-5]),
       outer=st.sampled_from([1e-4, 0.01, 1.0]), hidden=st.sampled_from([0.0, 0.005, 0.05]))
def test_the_crossover_is_the_guides_closed_form_at_tau_0(r, g, every, frac, compress, stage,
                                                          latency, outer, hidden):
    """W* = 2(R−1)/R · Ψ/g · (b_h − b_d/H) / (t_hide + K − 2(R−1)α(1 − F/H)), K the outer step
    per inner step, t_hide what hybrid ZeRO's exchange hides behind (guide §16), with τ = 0 and
    equal fragments."""
    fragments = 1 + int(frac * (every - 1))
    psi = 3e7
    s = DiLoCoSettings(every=every, fragments=fragments, compress=compress)
    plan = diloco_plan(psi, "H100", r * g, g, stage, s, precision="fp32", compute_s=0.01,
                       inter_group_bw=1e9, inter_group_latency=latency, outer_s=outer,
                       hidden_s=hidden)
    k = outer / every
    assert plan.methods[2]["outer_s"] == pytest.approx(k)
    num = 2 * (r - 1) / r * psi / g * (4 - s.wire_bytes / every)
    den = hidden + k - 2 * (r - 1) * latency * (1 - fragments / every)
    if abs(den) < 1e-9 * (hidden + k):
        return  # a tie at W → ∞ within rounding: either answer is right
    if den > 0:
        assert plan.crossover == "below"
        assert plan.crossover_bandwidth_bytes_per_s == pytest.approx(num / den, rel=1e-9)
    else:
        assert plan.crossover == "always"


def test_crossover_pieces():
    """D(x) = const + Σ w·max(0, p + q·x): roots in the last ray, inside a piece, none."""
    assert crossover(-1.0, [(1.0, 0.0, 2.0)]) == ("below", 2.0)            # x* = 0.5
    assert crossover(1.0, [(1.0, 0.0, 2.0)]) == ("always", None)
    assert crossover(-1.0, [(-1.0, 0.0, 2.0)]) == ("never", None)
    # rises through 0 at x = 1, inside [0, 2), then a negative hinge flattens it but stays > 0
    kind, w = crossover(-1.0, [(1.0, 0.0, 1.0), (-0.5, -2.0, 1.0)])
    assert kind == "below" and w == pytest.approx(1.0)
    # hybrid hidden up to x = 1.5, then D rises: −1 + (−3 + 2x) = 0 at x = 2
    kind, w = crossover(-1.0, [(1.0, -3.0, 2.0)])
    assert kind == "below" and w == pytest.approx(1 / 2)


def test_step_times_add_up():
    s = DiLoCoSettings(every=50, fragments=5, compress="int8", delay=2)
    plan = diloco_plan("small", "H100", 8, 4, 3, s, precision="fp32", compute_s=0.02,
                       inter_group_bw=2e8, inter_group_latency=1e-5)
    ddp, hyb, dil = plan.methods
    link = GroupLink(2e8, 1e-5, "")
    psi = get_model("small").params
    avg, peak = outer_step_seconds(psi, 8, 4, s, link, 0.02,
                                   hbm_bw=get_hardware("H100").hbm_bw, stage=3)
    assert dil["step_s"] == pytest.approx(0.02 + dil["intra_s"] + avg)
    assert dil["peak_step_s"] == pytest.approx(0.02 + dil["intra_s"] + peak)
    assert hyb["intra_s"] == dil["intra_s"] > 0
    assert hyb["step_s"] == pytest.approx(0.02 + hyb["intra_s"] + link.time(
        "all_reduce", 2, psi / 4 * 4))
    assert ddp["step_s"] == pytest.approx(0.02 + link.time("all_reduce", 8, psi * 4))
    # τ = 2 inner steps of 20 ms hide each fragment's exchange: only the outer update is left
    exchange = link.time("all_reduce", 2, psi / 5 / 4 * s.wire_bytes)
    assert exchange < 2 * 0.02 and dil["exposed_cross_s"] == 0


def test_inter_group_link_defaults_and_files(tmp_path):
    hw = get_hardware("H100")
    one = group_link(hw, 8, 4)
    assert (one.bandwidth_bytes_per_s, one.latency_s) == (hw.intra_bw, hw.alpha)
    many = group_link(hw, 32, 8)
    assert many.bandwidth_bytes_per_s == hw.inter_bw / 8 and many.latency_s == hw.node_alpha
    slow = with_inter_group(hw, 1.25e9, 2e-5)
    assert group_link(slow, 32, 8).to_dict()["bandwidth_bytes_per_s"] == 1.25e9
    path = save_hardware(slow, str(tmp_path / "slow.json"))
    back = hardware_from_dict(json.loads(open(path).read()))
    assert (back.inter_group_bw, back.inter_group_alpha) == (1.25e9, 2e-5)
    with pytest.raises(ValueError):
        with_inter_group(hw, -1.0)


def test_settings_are_checked():
    for bad in (dict(every=0), dict(every=4, fragments=5), dict(every=4, delay=4),
                dict(every=4, compress="fp8"), dict(every=4, momentum=1.0)):
        with pytest.raises(ValueError):
            DiLoCoSettings(**bad)


def test_loss_only_from_measured_rows(tmp_path):
    shipped = json.loads(LOSS_TABLE.read_text())
    assert "schema" in shipped and isinstance(shipped["measurements"], list)
    assert load_loss_table() == shipped["measurements"]
    s = DiLoCoSettings(every=100, compress="int8")
    rows, note = loss_figure("tiny", s, [])
    assert rows == [] and "no measured loss figure for tiny at H = 100" in note
    table = [dict(model="tiny", H=100, compress="int8", fragments=1, loss_ratio_vs_ddp=1.021,
                  tokens=2e6), dict(model="tiny", H=100, compress="int8", fragments=1,
                                    loss_ratio_vs_ddp=1.05, tokens=1e6),
             dict(model="tiny", H=50, compress="int8", fragments=1, loss_ratio_vs_ddp=1.01,
                  tokens=2e6)]
    assert [r["tokens"] for r in measured_loss("tiny", 100, "int8", 1, table)] == [2e6, 1e6]
    rows, note = loss_figure("tiny", s, table)
    assert "1.021x DDP's at equal tokens (2,000,000 tokens)" in note
    assert loss_figure("tiny", DiLoCoSettings(every=500, compress="int8"), table)[0] == []
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"measurements": table}))
    assert diloco_plan("tiny", "H100", 4, 2, 3, s, loss_table=str(path)).loss == table[:2]


def test_rows_after_a_warmup_are_quoted_apart():
    """A row whose DiLoCo started from a data-parallel warm-up ("warmup": W steps) is another
    setting: never quoted as the plain one, named with its W beside it."""
    table = [dict(model="tiny", H=50, compress="none", fragments=1, loss_ratio_vs_ddp=1.19, tokens=2e6),
             dict(model="tiny", H=50, compress="none", fragments=1, warmup=100, loss_ratio_vs_ddp=1.05, tokens=2e6)]
    assert [r["loss_ratio_vs_ddp"] for r in measured_loss("tiny", 50, table=table)] == [1.19]
    assert [r["loss_ratio_vs_ddp"] for r in measured_loss("tiny", 50, table=table, warmup=100)] == [1.05]
    rows, note = loss_figure("tiny", DiLoCoSettings(every=50), table)
    assert rows == table[:1] and "1.190x DDP's" in note and "1.050x after 100 data-parallel steps" in note
    assert loss_figure("tiny", DiLoCoSettings(every=50), table[1:])[0] == []


def _run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def test_plan_comm_prints_the_diloco_table():
    rc, text = _run("plan", "comm", "--model", "tiny", "--gpus", "4", "--shard-size", "2",
                    "--stage", "3", "--mixed-precision", "fp32", "--diloco-every", "100",
                    "--diloco-compress", "int8", "--inter-group-bw", "1.25GB",
                    "--inter-group-latency", "20us")
    assert rc == 0
    assert "DiLoCo over ZeRO-3 (guide §16)" in text and "DDP / DiLoCo 1,182x" in text
    assert "1.25 GB/s per GPU, 20 µs per ring step" in text and "no measured loss figure" in text
    rc, js = _run("plan", "comm", "--model", "tiny", "--gpus", "4", "--shard-size", "2",
                  "--diloco-every", "100", "--json")
    d = json.loads(js)["diloco"]
    assert d["bytes"]["outer_state_bytes"] == 8 * get_model("tiny").params / 2
    rc, plain = _run("plan", "comm", "--model", "tiny", "--gpus", "4", "--shard-size", "2")
    assert "DiLoCo" not in plain  # unchanged without the flags


@pytest.mark.parametrize("argv, words", [
    (["--diloco-fragments", "4"], "add --diloco-every"),
    (["--inter-group-bw", "1GB"], "add --diloco-every"),
    (["--diloco-every", "4", "--diloco-fragments", "5"], "at most every"),
])
def test_plan_comm_refuses_half_an_outer_loop(argv, words, capsys):
    rc = main(["plan", "comm", "--model", "tiny", "--gpus", "4", "--shard-size", "2", *argv])
    assert rc != 0 and words in capsys.readouterr().err


def test_recommend_prices_diloco_twins_on_a_slow_link():
    hw = with_inter_group(get_hardware("H100"), 1.25e9, 2e-5)
    base = recommend("small", hw, 4, 8, 2**20, 256, top=50, micro_batches=(64,),
                     recompute=("none",), compress=("none",), bucket_mb=(25,))
    r = recommend("small", hw, 4, 8, 2**20, 256, top=50, micro_batches=(64,),
                  recompute=("none",), compress=("none",), bucket_mb=(25,),
                  diloco=DiLoCoSettings(every=100, compress="int8"))
    assert r.searched > base.searched and r.diloco["every"] == 100
    twins = [c for c in r.candidates if c.outer]
    assert twins and all(c.shard_size < r.n and c.stage > 0 for c in twins)
    psi = get_model("small").params
    for t in twins:
        plain = next(c for c in base.candidates if (c.stage, c.shard_size) == (t.stage, t.shard_size))
        assert t.memory_bytes - plain.memory_bytes == pytest.approx(8 * psi / t.shard_size)
        assert t.step_s < plain.step_s  # the replica AllReduce left the slow link
    assert "no measured loss figure for small at H = 100" in r.loss_note
    assert r.candidates[0].outer and "--diloco-every 100" in r.train_flags
    with pytest.raises(ValueError):
        recommend("small", hw, 1, 8, 2**20, 256)  # the link joins nodes


def test_the_planner_stays_torch_free():
    import subprocess
    import sys
    code = ("import sys, zerodp.plan.diloco, zerodp.plan.recommend; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert math.isfinite(diloco_plan("tiny", "H100", 4, 2, 3, every=10).speedup_vs_hybrid)


def test_guide_section_16_figures_are_what_the_planner_prints():
    """guide §16.2 and §16.4 in both languages quote these figures; they must stay the planner's."""
    from pathlib import Path

    from zerodp.plan._common import fmt_bytes
    docs = Path(__file__).resolve().parents[1] / "docs"
    figures = []
    for name in ("tiny", "small"):
        psi = get_model(name).params
        b32 = diloco_bytes(psi, 4, 2, DiLoCoSettings(every=100), 3)
        b8 = diloco_bytes(psi, 4, 2, DiLoCoSettings(every=100, compress="int8"), 3)
        figures += [fmt_bytes(b32.ddp_cross_bytes_per_step), fmt_bytes(b32.hybrid_cross_bytes_per_step),
                    fmt_bytes(b32.cross_bytes_per_step), fmt_bytes(b8.cross_bytes_per_step)]
    figures += [f"{b8.ddp_ratio:,.0f}".replace(",", "{,}"), f"{b8.hybrid_ratio:,.0f}"]
    link = dict(inter_group_bw=1.5625e9, inter_group_latency=20e-6, seq=8192, every=100,
                compress="int8")
    exposed = diloco_plan("llama3-8b", "H100", 128, 64, 3, **link)
    hidden = diloco_plan("llama3-8b", "H100", 128, 64, 3, overlap=True, **link)
    streaming = diloco_plan("llama3-8b", "H100", 128, 64, 3, fragments=4, delay=1, **link)
    by = exposed.bytes
    figures += [fmt_bytes(by["ddp_cross_bytes_per_step"]), fmt_bytes(by["hybrid_cross_bytes_per_step"]),
                fmt_bytes(by["cross_bytes_per_step"]), fmt_bytes(by["peak_cross_bytes_per_step"]),
                fmt_bytes(by["outer_state_bytes"]),
                f"{streaming.bytes['peak_cross_bytes_per_step'] / 1e6:.0f} MB"]
    sync_free = exposed.compute_s + exposed.methods[2]["intra_s"]  # a step no fragment syncs on
    figures += [f"{m['step_s']:.3g} s".replace("1.4 s", "1.40 s")
                for p in (exposed, hidden) for m in p.methods]
    figures += [f"{exposed.compute_s:.3g} s", f"{hidden.hidden_s:.2f} s",
                f"{exposed.methods[1]['exposed_cross_s'] * 1e3:.0f} ms",
                f"{hidden.crossover_bandwidth_bytes_per_s / 1e6:.0f} MB/s",
                f"{(exposed.methods[2]['peak_step_s'] - sync_free) * 1e3:.0f} ms"]
    assert exposed.crossover == "always" and hidden.crossover == "below"
    quiet = streaming.compute_s + streaming.methods[2]["intra_s"]  # a step no fragment syncs on
    figures.append(f"{(streaming.methods[2]['peak_step_s'] - quiet) * 1e3:.1f} ms")
    for name in ("guide.md", "guide.zh.md"):
        text = (docs / name).read_text(encoding="utf-8")
        section = text[text.index('<a id="s16-2"></a>'):text.index('<a id="s16-5"></a>')]
        missing = [f for f in figures if f not in section]
        assert not missing, (name, missing)
