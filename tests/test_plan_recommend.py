"""plan recommend (docs/planner.md, "recommend"): the first pick's figures recomputed from the
individual planner functions, the rejected regions, the CLI and its refusals."""

import importlib
import json
import math

import pytest

from zerodp import plan
from zerodp.plan.cli import add_parser  # noqa: F401 - the CLI is importable without torch

rec = importlib.import_module("zerodp.plan.recommend")  # the module, not plan.recommend()

LLAMA = "tests/data/llama-3-8b"


def _run(capsys, *argv):
    from zerodp.cli import main
    rc = main(["plan", "recommend", *argv])
    return rc, capsys.readouterr()


@pytest.fixture(scope="module")
def llama_64():
    m = plan.load_config(LLAMA)
    return m, rec.recommend(m, "H100", nodes=8, gpus_per_node=8, global_batch_tokens="4M",
                            seq=8192)


def test_first_pick_is_the_planner_functions_arithmetic(llama_64):
    m, r = llama_64
    c = r.best
    n = 64
    g = c.shard_size
    # batch: gbs rounded to a power of two, grad_acc = gbs / (mbs · n)  (guide §6.1)
    b = plan.plan_batch(4e6, 8192, c.micro_batch, n)
    assert (c.grad_acc, r.samples) == (b.grad_acc, 512)
    assert c.grad_acc * c.micro_batch * n == 512
    # memory: memory_plan's total for that stage, and it leaves the headroom free
    mp = plan.memory_plan(m, n, "H100", seq=8192, micro_batch=c.micro_batch,
                          recompute=c.recompute, shard_size=g if g < n else None)
    row = mp.stages[c.stage]
    assert c.memory_bytes == row["total_bytes"] and row["fits"]
    assert c.memory_bytes <= 0.9 * 80e9
    # compute: the H100's compute model per micro-batch, and AdamW's 28 bytes per parameter the
    # rank steps (Ψ/g) at its HBM bandwidth
    t = 8192 * c.micro_batch
    attn = 2 * m.layers * 8192 * m.q_dim * t
    fwd = 2 * m.active * t + attn
    ct = plan.compute.step_compute(m, "H100", 8192, c.micro_batch, c.recompute)
    opt = 28 * m.params / g / 3.35e12
    assert c.compute_s == pytest.approx(c.grad_acc * (ct.forward_s + ct.backward_s) + opt)
    assert r.efficiency == pytest.approx(c.grad_acc * 3 * fwd / (c.compute_s * 9.9e14))
    assert r.efficiency_source.startswith("H100 compute model: matmul 80% of peak")
    # communication: step_comm's collectives, each once or per micro-batch by stage
    sc = plan.step_comm("H100", n, c.stage, m.params, g if g < n else None, "bf16", c.compress)
    once = max(sum(x["intra_s"] for x in sc.collectives), sum(x["inter_s"] for x in sc.collectives))
    assert c.comm_s >= once * 0.999  # buckets add latency, never take bytes away
    assert c.exposed_comm_s <= c.comm_s + 1e-12
    # the step and its rates
    assert c.step_s == pytest.approx(c.compute_s + c.exposed_comm_s)
    assert c.tokens_per_s_per_gpu == pytest.approx(512 * 8192 / n / c.step_s)
    assert c.mfu == pytest.approx(c.grad_acc * 3 * fwd / (c.step_s * 9.9e14))


def test_ranked_fastest_first_and_runners_up_say_why(llama_64):
    _, r = llama_64
    best = r.best
    assert len(r.candidates) == 5
    for c in r.candidates[1:]:
        assert c.lost_because
        # a runner-up is slower, or within the 1 % tie and more complicated
        assert c.seconds_per_token >= best.seconds_per_token * (1 - rec.TIE) - 1e-15
    reasons = {x["reason"].split(":")[0] for x in r.rejected}
    assert {"does not fit in HBM", "grad_acc < 1"} <= reasons
    assert sum(x["count"] for x in r.rejected) < r.searched


def test_nothing_that_fits_says_so():
    r = rec.recommend("llama3-405b", "H100", nodes=1, global_batch_tokens="1M", seq=4096)
    assert not r.candidates and any("nothing fits" in x for x in r.notes)
    printed = rec.text(r).splitlines()  # one line says so: no table header, no empty table
    assert printed[0].startswith("Searched: llama3-405b") and printed[1].startswith("Nothing fits: ")
    assert not any(line.startswith(("#  stage", "- ")) for line in printed)


def test_70b_on_1024_gpus_answers_quickly():
    r = rec.recommend("llama3-70b", "H100", nodes=128, gpus_per_node=8,
                      global_batch_tokens="16M", seq=8192)
    assert r.best is not None and r.n == 1024
    assert r.elapsed_s < 10  # a figure in the docs, not a benchmark: about 0.1 s here


def test_cli_table_and_json(capsys):
    rc, out = _run(capsys, "--config", LLAMA, "--hardware", "H100", "--nodes", "8",
                   "--gpus-per-node", "8", "--global-batch-tokens", "4M", "--seq", "8192")
    assert rc == 0 and "first pick" in out.out and "rejected" in out.out
    rc, out = _run(capsys, "--config", LLAMA, "--gpus", "16", "--seq-len", "4096", "--json")
    d = json.loads(out.out)
    assert d["n"] == 16 and d["nodes"] == 2 and d["candidates"][0]["stage"] in (0, 1, 2, 3)
    assert math.isclose(d["headroom"], 0.1)


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "12", "--gpus-per-node", "8"], "does not fill nodes"),
    (["--gpus", "16", "--nodes", "3"], "is not --nodes 3"),
    (["--params", "8e9"], "needs the model's shape"),
])
def test_cli_refusals_are_one_line(capsys, argv, needle):
    from zerodp.cli import main
    rc = main(["plan", "recommend", *argv])
    err = capsys.readouterr().err
    assert rc != 0 and needle in err and len(err.strip().splitlines()) == 1



def test_refusals_name_the_field(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, '
                   '"num_attention_heads": 12, "vocab_size": 50280}')
    with pytest.raises(ValueError, match="model_type 'mamba'"):
        plan.load_config(str(bad))
    with pytest.raises(ValueError, match=r"multiple of num_key_value_heads \(5\)"):
        plan.custom_model(layers=32, hidden=4096, heads=32, kv_heads=5)


def test_moe_factor_both_ways():
    m = plan.load_config("tests/data/deepseek-v2-lite")
    assert m.moe_factor == pytest.approx(64 / 6)
    assert m.active_factor == pytest.approx(m.params / m.active) and 5.5 < m.active_factor < 6.3


def test_tight_inside_the_headroom():
    assert plan.memory.verdict(71e9, 80e9) == "fits"
    assert plan.memory.verdict(75e9, 80e9) == "tight"
    assert plan.memory.verdict(81e9, 80e9) == "no"


def test_calibrated_compute_comes_from_the_profile(tmp_path):
    """With a calibration profile a micro-batch costs its measured forward + backward at its token
    count, the optimizer its measured time over the parameters a rank steps (docs/planner.md)."""
    from _profiles import synthetic_profile
    from zerodp.plan.calibrated import compute_times, load_calibration, optimizer_time

    prof = synthetic_profile(tmp_path / "p.json")
    comp = load_calibration(prof)["calibration"]["compute"]
    m = plan.get_model("nano")
    r = rec.recommend(m, prof, nodes=1, gpus_per_node=2, global_batch_tokens=1024, seq=32,
                      precision="fp32", recompute=("none",), compress=("none",), bucket_mb=(0.5,),
                      calibration=prof)
    assert r.efficiency == 1.0 and r.candidates
    for c in r.candidates:
        f, b = compute_times(comp, c.micro_batch * 32)
        opt = optimizer_time(comp, c.micro_batch * 32, m.params / (2 if c.stage else 1))
        assert c.compute_s == pytest.approx(c.grad_acc * (f + b) * m.active / comp["params"] + opt)
        assert c.step_s == pytest.approx(c.compute_s + c.exposed_comm_s)


def test_a_given_efficiency_keeps_the_flop_count_model():
    """--efficiency 0.5: every configuration's compute is 3·(2·A·t + 2·L·s·q·t) + recomputation
    at 50 % of 989 TFLOP/s, and the header says it was given."""
    m = plan.load_config(LLAMA)
    r = rec.recommend(m, "H100", nodes=8, gpus_per_node=8, global_batch_tokens="4M", seq=8192,
                      efficiency=0.5)
    c = r.best
    t = 8192 * c.micro_batch
    attn = 2 * m.layers * 8192 * m.q_dim * t
    fwd = 2 * m.active * t + attn
    extra = {"none": 0, "selective": attn, "full": fwd}[c.recompute]
    assert c.compute_s == pytest.approx(c.grad_acc * (3 * fwd + extra) / (0.5 * 9.9e14))
    assert r.efficiency == 0.5 and r.efficiency_source.startswith("given: 50%")
