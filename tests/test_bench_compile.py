"""``zerodp bench --compile``: which contenders it adds, the table it prints and that a compiled
contender really runs a compiled model, with no timing asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerodp.bench import results, tables
from zerodp.bench import spec as bspec
from zerodp.bench.contenders import (COMPARISONS, CONTENDERS, VARIANTS, compiled_peer, eager_form, is_compiled,
                                     short_label)
from zerodp.bench.cli import bench_command_line
from zerodp.cli import build_parser


@pytest.mark.parametrize("stages", [(0, 3), (0, 1, 2, 3)])
def test_compile_adds_ours_and_the_reference_peer_compiled_at_every_stage(stages):
    eager = bspec.quick_spec(stages=stages).contenders(with_auto=False)
    names = bspec.quick_spec(stages=stages, compile=True).contenders(with_auto=False)
    assert not any(is_compiled(n) for n in eager)
    compiled = [n for n in names if is_compiled(n)]
    assert [n for n in names if not is_compiled(n)] == eager  # the eager rows stay as they were
    for s in stages:
        ours, peers = COMPARISONS[s]
        want = {f"{ours}_compiled", compiled_peer(s)}
        assert want == {n for n in compiled if CONTENDERS[n][0] == s}
        assert eager_form(compiled_peer(s)) == peers[0]  # the peer the stage's ratio is taken against
        assert CONTENDERS[compiled_peer(s)][1:] == ("peer", CONTENDERS[peers[0]][2] + ", compiled")
        assert VARIANTS[f"{ours}_compiled"].compiled and VARIANTS[f"{ours}_compiled"].engine_options() == {}
    for n in compiled:
        assert eager_form(n) in names and "compiled" in short_label(n)


def test_compiled_ours_is_no_compressed_row():
    result = _fake_result()
    assert not [r for r in results.compressed_rows(result) if is_compiled(r.name)]


def _fake_result() -> results.BenchResult:
    spec = bspec.quick_spec(stages=(0, 3), compile=True)
    regimes = []
    for j, regime in enumerate(spec.regimes):
        cs = {}
        for k, name in enumerate(spec.contenders(with_auto=False)):
            stage, role, label = CONTENDERS[name]
            times = [0.010 * (1 + k) * (1 + j) + d for d in (0.0, 0.004, 0.001, 0.002)]
            cs[name] = results.ContenderResult(name, label, stage, role, times, sorted(times)[1], [1 << 20] * 2,
                                               [1000] * 2, [2048.0, 2048.0], first_step_s=0.5 + k,
                                               timed_compiles=0)
        regimes.append(results.RegimeResult(regime, cs, 1.0))
    return results.BenchResult(spec, {"cores": 2, "torch": "x"}, regimes, {}, 43904)


def test_compiled_rows_and_table_give_both_ratios_per_stage_and_regime():
    result = _fake_result()
    rows = results.compiled_rows(result)
    assert len(rows) == 4 * len(result.spec.stages) * len(result.regimes)
    for row in rows:
        cs = next(rr for rr in result.regimes if rr.regime.name == row.regime).contenders
        c = cs[row.name]
        assert row.ms == pytest.approx(c.median_s * 1e3)
        assert row.first_step_s == c.first_step_s
        assert row.q1_ms <= row.ms <= row.q3_ms
        assert row.compiled == is_compiled(row.name)
        if row.compiled:
            assert row.vs_eager == pytest.approx(c.median_s / cs[eager_form(row.name)].median_s)
        else:
            assert row.vs_eager is None
        if row.role == "ours":
            peer = compiled_peer(row.stage) if row.compiled else COMPARISONS[row.stage][1][0]
            assert row.ours_vs_peer == pytest.approx(c.median_s / cs[peer].median_s)
        else:
            assert row.ours_vs_peer is None
    table = tables.compiled_table(result)
    lines = table.splitlines()
    assert len(lines) == 1 + len(rows) + 1  # header, rows, the note
    assert all(u in lines[0] for u in ("median ms", "IQR ms", "peak RSS MiB", "first step s", "compiled/eager",
                                       "ours/peer"))
    assert "warm-up excluded" in lines[-1]
    assert tables.compiled_table(results.BenchResult(bspec.quick_spec(), {}, [], {}, 0)) == ""
    d = json.loads(json.dumps(result.to_dict()))
    assert len(d["compiled_rows"]) == len(rows)
    back = results.result_from_dict(d)
    assert back.spec.compile and results.compiled_rows(back) == rows


def test_the_page_names_the_compile_flag():
    args = build_parser().parse_args(["bench", "--quick", "--compile", "--stages", "0,3"])
    assert args.compile and "--compile" in bench_command_line(args).split()
    args = build_parser().parse_args(["bench", "--quick"])
    assert "--compile" not in bench_command_line(args).split()


def test_a_compiled_contender_compiles_in_its_first_step_and_matches_eager():
    """One rank, stage 0, the nano model (about 10 s): ours and DDP compiled compute the eager loss,
    the first step compiles graphs and the next ones compile none."""
    code = """
import tempfile, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from zerodp.bench.peers import build
from zerodp.bench.runner import compiled_graphs, make_batches, make_model_factory
from zerodp.bench.spec import Regime
make = make_model_factory("nano", 0)
batches = make_batches(Regime("t", 1, 8), 256, 3, 0, 1, 0)
for name in ("ours0_compiled", "ddp_bucket_view_compiled"):
    eager = build(name.removesuffix("_compiled"), make, 1)
    c = build(name, make, 1)
    counts = []
    for x, y in batches:
        g0 = compiled_graphs()
        torch.testing.assert_close(c.step(x, y), eager.step(x, y))
        counts.append(compiled_graphs() - g0)
    print(name, counts)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    first = eval(lines["ours0_compiled"])  # noqa: S307 - our own printed list
    assert first[0] > 0 and first[1:] == [0, 0]
    # the peer's model is the same GPT: dynamo's per-process cache already holds its graph
    assert eval(lines["ddp_bucket_view_compiled"]) == [0, 0, 0]  # noqa: S307
