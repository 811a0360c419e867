"""``zerodp bench``: the machinery (rows, ratios, JSON, PNG, markdown, auto bucket), not speed.

Speed is shown by running ``zerodp bench``; these tests check that what it prints is computed from
what it measured: ratios from the medians, every comparison present, counters sane.
"""

from __future__ import annotations

import json
import math
import os
import statistics

import pytest

from zerodp.bench import auto, budget, compare, probe, results, roofline, runner, schedule, tables
from zerodp.bench import spec as bspec
from zerodp.bench.contenders import COMPARISONS, CONTENDERS
from zerodp.cli import main
from zerodp.plan import calibrated
from zerodp.train.model import PRESETS

from _profiles import synthetic_profile
from _regret import expected_choice_mib
from _engine_common import in_make_fuzz


# ---- auto bucket -----------------------------------------------------------------------------
def test_choose_bucket_mb_is_in_the_simulated_sweet_spot(tmp_path):
    path = synthetic_profile(tmp_path / "p.json", model="small")
    cfg = PRESETS["small"]
    sweep = auto.bucket_sweep(path, cfg, 2048)
    mb = auto.choose_bucket_mb(path, cfg, 2048)
    assert mb == expected_choice_mib(sweep.points, 1.0, calibrated.ETA_UNCERTAINTY, calibrated.REGRET_TOLERANCE,
                                     calibrated.SWEET_SPOT_SLACK_S)
    # no η measured: communication hides (η = 1), so the choice leaves only a small tail exposed
    chosen = next(p for p in sweep.points if p.bucket_bytes / calibrated.MIB == mb)
    assert chosen.exposed_comm_s <= 1.5 * sweep.best_exposed_comm_s + calibrated.SWEET_SPOT_SLACK_S
    assert 1 < chosen.num_buckets
    # same answer from the profile dict and from its calibration table
    with open(path) as f:
        prof = json.load(f)
    assert auto.choose_bucket_mb(prof, cfg, 2048) == mb == auto.choose_bucket_mb(prof["calibration"], cfg, 2048)


def test_choose_bucket_mb_grows_with_latency(tmp_path):
    cfg = PRESETS["small"]
    fast = auto.choose_bucket_mb(synthetic_profile(tmp_path / "a.json", alpha=1e-6, model="small"), cfg, 2048)
    slow = auto.choose_bucket_mb(synthetic_profile(tmp_path / "b.json", alpha=20e-3, model="small"), cfg, 2048)
    assert slow >= fast  # guide §4: a large α makes small buckets pay


def test_choose_bucket_mb_bad_input(tmp_path):
    cfg = PRESETS["small"]
    with pytest.raises(ValueError, match="tokens_per_rank"):
        auto.choose_bucket_mb(synthetic_profile(tmp_path / "p.json"), cfg, 0)
    with pytest.raises(ValueError, match="calibration profile"):
        auto.choose_bucket_mb({"nope": 1}, cfg, 128)
    with pytest.raises(FileNotFoundError, match="zerodp calibrate"):
        auto.choose_bucket_mb(str(tmp_path / "missing.json"), cfg, 128)


# ---- tables from synthetic results -------------------------------------------------------------
def _fake_result(profile=None) -> results.BenchResult:
    spec = bspec.quick_spec(profile=profile)
    regimes = []
    for j, regime in enumerate(spec.regimes):
        cs = {}
        for k, name in enumerate(spec.contenders(with_auto=True)):
            stage, role, label = CONTENDERS[name]
            times = [0.010 * (1 + k) * (1 + j) + d for d in (0.0, 0.004, 0.001)]
            cs[name] = results.ContenderResult(name, label, stage, role, times, sorted(times)[1], [1 << 20] * 2,
                                               [1000] * 2, [2048.0, 2048.0], {"bucket_mb": 25.0},
                                               predicted_s=0.02 if role != "peer" else None)
        regimes.append(results.RegimeResult(regime, cs, 1.0))
    return results.BenchResult(spec, {"cores": 2, "torch": "x"}, regimes, {"compute": 1.5, "comm": 0.5}, 43904)


def test_rows_cover_every_stage_and_regime_and_ratios_come_from_medians():
    result = _fake_result()
    rows = result.rows()
    want = {(r.name, s, COMPARISONS[s][0], p) for r in result.spec.regimes for s in result.spec.stages
            for p in COMPARISONS[s][1]}
    want |= {(r.name, 0, "ours0_auto", "ours0") for r in result.spec.regimes}
    assert {(r.regime, r.stage, r.ours, r.peer) for r in rows} == want
    for row in rows:
        cs = next(rr for rr in result.regimes if rr.regime.name == row.regime).contenders
        assert row.ratio == pytest.approx(cs[row.ours].median_s / cs[row.peer].median_s)
        assert row.ours_overhead == pytest.approx(cs[row.ours].median_s / cs["floor"].median_s)
        assert (row.target is not None) == (row.stage in (0, 3) and row.peer in ("ddp_bucket_view", "fsdp2"))
        paired = sorted(a / b for a, b in zip(cs[row.ours].times_s, cs[row.peer].times_s))
        assert row.paired_q1 == pytest.approx((paired[0] + paired[1]) / 2)  # 3 steps: inclusive quartiles
        assert row.paired_q3 == pytest.approx((paired[1] + paired[2]) / 2)
    assert "per-step IQR" in tables.summary_table(result)


def test_paired_quartiles_need_two_steps():
    assert results.paired_quartiles([1.0], [2.0]) == (None, None)
    assert results.paired_quartiles([1.0, 3.0, 2.0, 4.0], [1.0] * 4) == pytest.approx((1.75, 3.25))


def test_tables_json_png_markdown(tmp_path):
    profile = synthetic_profile(tmp_path / "p.json")
    result = _fake_result(profile)
    summary = tables.summary_table(result)
    table = tables.contenders_table(result)
    for rr in result.regimes:
        for c in rr.contenders.values():
            assert c.label in table
    assert summary.count("\n") == len(result.rows()) + 1  # header, rows, the note on the IQR
    assert "predicted ms" in table
    d = json.loads(json.dumps(result.to_dict()))
    assert {"spec", "machine", "params", "auto_bucket_mb", "regimes", "rows"} <= set(d)
    assert {"ratio", "ours_ms", "peer_ms", "floor_ms", "target", "predicted_ms"} <= set(d["rows"][0])
    c = d["regimes"][0]["contenders"]["ours0"]
    assert {"times_s", "median_s", "peak_rss_bytes", "model_state_bytes", "sent_bytes_per_step"} <= set(c)
    png = tables.plot(result, str(tmp_path / "bench.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    from zerodp.bench.docs import write_markdown

    md = write_markdown(str(tmp_path / "docs" / "b.md"), "zerodp bench --quick", result, png, note="loaded")
    text = open(md).read()
    assert "zerodp bench --quick" in text and "torch" in text and "../bench.png" in text
    assert "Predicted vs measured" in text and "all_reduce" in text  # the calibration sweep is shown


def test_roofline_knee_is_the_seed_formula(tmp_path):
    profile = synthetic_profile(tmp_path / "p.json", bandwidth=2e9, flops=4e9)
    k, flops, bw = roofline.knee(profile, grad_bytes_per_param=2)
    assert k == pytest.approx(flops / bw * (2 - 1) / 2, rel=1e-9)  # guide §7.3: C/W·(N−1)/N
    assert flops == pytest.approx(4e9, rel=1e-6) and bw == pytest.approx(2e9, rel=0.01)
    assert roofline.knee(profile, grad_bytes_per_param=4)[0] == pytest.approx(2 * k)
    assert roofline.regime_for(2048, 256).micro_batch == 8
    with pytest.raises(ValueError, match="multiple"):
        roofline.regime_for(300, 256)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--stages", "5"], "stages"),
    (["bench", "--regimes", "fast"], "regimes"),
    (["bench", "--nproc", "1"], "world_size"),
    (["bench", "--steps", "0"], "steps"),
    (["bench", "--model", "huge"], "unknown model"),
    (["bench", "--quick", "--malloc", "mmap"], "applies to the fresh memory groups"),
    (["bench", "--turn", "0"], "turn"),
    (["bench", "--memory-steps", "0"], "memory_steps"),
    (["bench", "--memory-repeats", "0"], "memory_repeats"),
    (["bench", "--quick", "--memory-repeats", "3"], "repeats the fresh memory groups"),
    (["bench", "--stage2-bucket-mb", "0"], "--stage2-bucket-mb '0'"),
    (["bench", "--stage2-bucket-mb", "block"], "give 'unit'"),
])
def test_bench_cli_bad_input(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model", ["nano", "small", "gpt2-small"])
def test_our_stage_2_takes_buckets_of_one_block_and_every_other_contender_the_bench_bucket(model):
    """Stage 2 keeps no gradients at rest, so its bucket is memory held in backward: the bench gives
    it buckets of one block, the unit FSDP2 reduces at. A block of this GPT holds 12·d² + 13·d
    parameters (qkv 3d²+3d, attention projection d²+d, MLP 2·4d²+4d+d, two LayerNorms 4d) when the
    MLP is 4d wide and layers have biases."""
    cfg = PRESETS[model]
    assert cfg.ffn_mult == 4 and cfg.bias
    d = cfg.d_model
    block_mib = (12 * d * d + 13 * d) * 4 / 2**20
    assert compare.unit_mb(model) == pytest.approx(block_mib, rel=1e-12)
    spec = bspec.BenchSpec(model=model, compress=("none", "bf16-reduce", "int8"))
    names = spec.contenders(with_auto=True)
    buckets = compare.contender_buckets(spec, names)
    stage2 = {n for n in names if CONTENDERS[n][:2] == (2, "ours")}
    assert stage2 == {"ours2", "ours2_bf16", "ours2_int8"}
    assert buckets == {"ours0_auto": "auto", **{n: pytest.approx(block_mib) for n in stage2}}
    fixed = bspec.BenchSpec(model=model, stage2_bucket_mb=25)
    assert compare.contender_buckets(fixed, ["ours0", "ours2", "fsdp2_keep"]) == {"ours2": 25.0}
    for bad in (0, -1.0, "block", True):
        with pytest.raises(ValueError, match="stage2_bucket_mb"):
            bspec.BenchSpec(stage2_bucket_mb=bad)


def test_malloc_mmap_keeps_freed_buffers_out_of_the_resident_set():
    """``--malloc mmap`` in a fresh process: after a 4 MiB buffer is freed, glibc keeps its threshold,
    so the next 1 MiB buffer is a mapping of its own and leaves the resident set when freed."""
    import subprocess
    import sys

    code = ("from zerodp.bench import probe; import torch\n"
            "assert probe.set_malloc('mmap')\n"
            "t = torch.ones(1 << 20); del t\n"  # 4 MiB freed: glibc's dynamic threshold would rise to it
            "base = probe.reset_peak(); u = torch.ones(1 << 18); grown = probe.rss_bytes() - base; del u\n"
            "print(grown, probe.rss_bytes() - base)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    grown, after = map(int, out)
    assert grown >= 1 << 20 and after < grown // 2, (grown, after)
    with pytest.raises(ValueError, match="malloc must be one of"):
        probe.set_malloc("jemalloc")


# ---- one real quick run (spawns ranks) ---------------------------------------------------------
@in_make_fuzz("the rows, tables and choices on synthetic runs (the tests above)")
@pytest.mark.dist
def test_bench_quick_end_to_end(tmp_path, capsys):
    profile = synthetic_profile(tmp_path / "profile.json")
    out = tmp_path / "out"
    md = tmp_path / "docs" / "benchmarks.md"
    rc = main(["bench", "--quick", "--roofline", "--profile", profile, "--out", str(out),
               "--markdown", str(md)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"zerodp stage 2 ({compare.unit_mb('nano'):.3g} MiB buckets)" in printed
    for s in (0, 1, 2, 3):
        ours, peers = COMPARISONS[s]
        for name in (ours, *peers):
            assert CONTENDERS[name][2] in printed
    d = json.load(open(out / "bench.json"))
    assert [r["regime"]["name"] for r in d["regimes"]] == ["compute", "comm"]
    assert len(d["rows"]) == 2 * (sum(len(p) for _, p in COMPARISONS.values()) + 1)  # + auto vs 25 MB
    for r in d["regimes"]:
        cs = r["contenders"]
        assert set(cs) == set(bspec.quick_spec().contenders(with_auto=True))
        # Same model, data and seed: every first loss is the floor's, an fp32 forward (float32's
        # default tolerances of torch.testing, relative to the loss's magnitude).
        import torch

        floor = torch.tensor(cs["floor"]["first_loss"])
        for n, c in cs.items():
            torch.testing.assert_close(torch.tensor(c["first_loss"]), floor, msg=lambda m, n=n: f"{n}: {m}")
        steps = 2 if r["regime"]["name"] == "compute" else 2 * bspec.MAX_STEP_SCALE  # 128 vs 8 tokens
        groups = len(schedule.stage_groups(list(cs)))  # the floor runs beside every stage
        for name, c in cs.items():
            assert len(c["times_s"]) == steps * (groups if name == "floor" else 1)
            assert all(t > 0 for t in c["times_s"])
            assert c["median_s"] == pytest.approx(statistics.median(c["times_s"]))
            assert all(b > 0 for b in c["model_state_bytes"])
            sent = c["sent_bytes_per_step"][0]
            if sent is not None:
                # the floor sends nothing; every data-parallel contender at least its gradients once
                assert sent == 0 if name == "floor" else sent >= 43_904 * 4 * 0.9, (name, sent)
        ours = {s: cs[f"ours{s}"]["model_state_bytes"][0] for s in range(4)}
        assert ours[3] < ours[2] < ours[1] < ours[0]  # guide §9: each stage shards one more kind
        assert all(c["predicted_s"] > 0 for c in cs.values() if c["role"] == "ours")
        # the auto row is the engine's bucket_mb="auto": the size it chose is the simulator's spot
        reg = r["regime"]
        chosen = cs["ours0_auto"]["options"]
        assert chosen["bucket_auto"] is True
        assert chosen["bucket_mb"] == pytest.approx(auto.choose_bucket_mb(
            profile, PRESETS["nano"], reg["micro_batch"] * reg["seq_len"], reg["seq_len"]))
        assert d["auto_bucket_mb"][reg["name"]] == chosen["bucket_mb"]
        assert cs["ours2"]["options"]["bucket_mb"] == pytest.approx(compare.unit_mb("nano"))
        assert cs["ours1"]["options"]["bucket_mb"] == 25.0
    for row in d["rows"]:
        assert row["ratio"] == pytest.approx(row["ours_ms"] / row["peer_ms"])
        assert math.isfinite(row["ratio"])
    rl = json.load(open(out / "roofline.json"))
    assert [p["tokens"] for p in rl["points"]] == list(roofline.QUICK_TOKENS)
    assert rl["knee_tokens"] > 0
    for name in ("bench.png", "roofline.png"):
        assert os.path.getsize(out / name) > 1000
    text = md.read_text()
    assert "zerodp bench" in text and "Roofline" in text and "Machine" in text


def test_bench_refuses_a_profile_of_another_model_or_world(tmp_path, capsys):
    small = synthetic_profile(tmp_path / "small.json", model="small")
    assert main(["bench", "--quick", "--profile", small, "--out", str(tmp_path)]) == 2
    assert "measured the compute of model 'small'" in capsys.readouterr().err
    four = synthetic_profile(tmp_path / "four.json", world=4)
    assert main(["bench", "--quick", "--profile", four, "--out", str(tmp_path)]) == 2
    assert "calibrated on 4 ranks" in capsys.readouterr().err


def test_result_round_trips_through_json():
    result = _fake_result()
    back = results.result_from_dict(json.loads(json.dumps(result.to_dict())))
    assert json.loads(json.dumps(back.to_dict())) == json.loads(json.dumps(result.to_dict()))
    assert tables.summary_table(back) == tables.summary_table(result)


def test_contenders_live_one_stage_at_a_time_and_the_bench_refuses_what_would_not_fit(monkeypatch):
    spec = bspec.BenchSpec(model="small", world_size=2, profile=None)
    names = spec.contenders(with_auto=False)
    groups = schedule.stage_groups(names)
    assert groups[0] == ["floor", "ours0", "ddp_bucket_view", "ddp"] and len(groups) == 4
    assert all(g[0] == "floor" for g in groups)
    # 124M parameters, 2 ranks: four contenders at 24 B/param each, plus the ranks' baseline
    need = budget.memory_needed(spec, names, 124_000_000)
    assert need == 2 * (budget.RANK_BASELINE_BYTES + 4 * 24 * 124_000_000)
    monkeypatch.setattr(budget, "available_bytes", lambda: 1e9)
    big = bspec.BenchSpec(model="gpt2-small", world_size=2)
    with pytest.raises(ValueError) as info:
        budget.check_memory(big, big.contenders(with_auto=False))
    msg = str(info.value)
    assert "GiB" in msg and "--model" in msg and "--nproc" in msg and "\n" not in msg


def test_a_stage_that_would_not_fit_whole_runs_ours_and_its_peer_alone_then_the_rest(monkeypatch):
    big = bspec.BenchSpec(model="gpt2-small", world_size=2, stages=(0, 3))
    names = big.contenders(with_auto=False)
    import torch

    from zerodp.train.model import GPT

    with torch.device("meta"):
        params = GPT(PRESETS["gpt2-small"]).num_params()  # what check_memory counts
    pair = budget.memory_needed(big, names, params, [["ours0", "ddp_bucket_view"]])
    whole = budget.memory_needed(big, names, params, [["floor", "ours0", "ddp_bucket_view", "ddp"]])
    monkeypatch.setattr(budget, "available_bytes", lambda: (pair + whole) / 2)  # the pair fits, not all four
    groups = budget.check_memory(big, names)
    assert groups == [["ours0", "ddp_bucket_view"], ["floor", "ddp"], ["floor", "ours3", "fsdp2"]]
    assert all(n in sum(groups, []) for n in names)
    monkeypatch.setattr(budget, "available_bytes", lambda: pair * 0.99)
    with pytest.raises(ValueError, match="ours and its peer alive at once"):
        budget.check_memory(big, names)


@pytest.mark.parametrize("warmup,steps,turn", [(3, 6, 3), (1, 2, 3), (2, 5, 1), (3, 30, 4)])
def test_schedule_gives_each_contender_whole_turns_whose_first_step_is_not_timed(warmup, steps, turn):
    spec = bspec.BenchSpec(warmup=warmup, steps=steps, turn=turn, regimes=(bspec.REGIMES["compute"],))
    names = ["floor", "ours0", "ddp"]
    rounds = spec.rounds_for(bspec.REGIMES["compute"])
    plan = list(schedule.schedule(names, warmup, rounds, turn, seed=0))
    assert plan == list(schedule.schedule(names, warmup, rounds, turn, seed=0))  # every rank walks the same
    for name in names:
        mine = [(i, timed) for i, n, timed in plan if n == name]
        assert sum(t for _, t in mine) >= steps  # at least the timed steps asked for
        assert sum(t for _, t in mine) < steps + max(1, turn - 1)  # and no whole turn more
        assert len(mine) + 1 == schedule.steps_per_contender(warmup, rounds, turn)
        assert not any(t for i, t in mine if i < warmup)  # warm-up rounds: nothing timed
        for i in sorted({i for i, _ in mine if i >= warmup}):
            turn_steps = [t for j, t in mine if j == i]
            assert turn_steps == ([True] if turn == 1 else [False] + [True] * (turn - 1))
    # a turn is consecutive: nobody else steps in between
    for k in range(len(plan) - 1):
        i, n, timed = plan[k]
        if plan[k + 1][2] and plan[k + 1][0] == i and turn > 1:
            assert plan[k + 1][1] == n
    # the order of the turns changes from round to round
    orders = {tuple(dict.fromkeys(n for j, n, _ in plan if j == i)) for i in range(warmup, rounds + 1)}
    assert rounds - warmup < 2 or len(orders) > 1


def test_memory_repeats_take_the_median_per_rank_and_measure_every_contender_before_any_twice(monkeypatch):
    """``memory_repeats`` R: R fresh groups per contender, repeat-major (ours and peers interleaved),
    and per rank the median of the R readings; a missing reading (no /proc) stays missing."""
    import zerodp.spawn

    readings = {("compute", "ours0"): [[300, 310], [100, 110], [200, 210]],
                ("compute", "ddp"): [[50, 60], [70, None], [60, 70]]}
    calls = []

    def fake_run_local(fn, world, spec, regime, name, mb, timeout, backend):
        assert fn is runner.rank_memory and world == spec.world_size == 2
        calls.append(name)
        return readings[regime.name, name][sum(c == name for c in calls) - 1]

    monkeypatch.setattr(zerodp.spawn, "run_local", fake_run_local)
    spec = bspec.BenchSpec(regimes=(bspec.REGIMES["compute"],), stages=(0,), memory_repeats=3)
    out = compare._fresh_peaks(spec, ["ours0", "ddp"], {}, 60.0, "gloo")
    assert calls == ["ours0", "ddp"] * 3
    assert out[("compute", "ours0")] == [200, 210]
    assert out[("compute", "ddp")] == [60, None]


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_keep"])
def test_the_fsdp2_peers_mesh_is_on_the_models_device(monkeypatch, name):
    """fully_shard moves every parameter to its mesh's device: the FSDP2 peers build their mesh on
    the device the model is on. With a "cpu" mesh a CUDA model was taken to the host and the bench's
    stages 2-3 failed on one GPU (docs/gpu.md); on CPU both are "cpu", so the model here is built on
    the meta device and torch's mesh and fully_shard only record what they are given."""
    import torch
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    from zerodp.bench import peers
    from zerodp.train.model import GPT

    given, sharded = [], []
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape: given.append((kind, shape)) or kind)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh, **kw: sharded.append(mesh))

    def make_model():
        with torch.device("meta"):
            return GPT(PRESETS["nano"])

    peers.build(name, make_model, world_size=2)
    assert given == [("meta", (2,))]
    assert sharded and set(sharded) == {"meta"}  # every block and the root on that mesh
