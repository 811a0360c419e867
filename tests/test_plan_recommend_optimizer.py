"""``zerodp plan recommend --optimizer`` (issue 36, point 4; docs/planner.md, "recommend with
another optimizer"): each configuration's memory is the figure ``zerodp plan memory --optimizer``
prints for that stage, shard group, micro-batch and recomputation (tensor ownership's fullest
rank, slice padding included, for adafactor and muon), its collectives move the elements tensor
ownership pads to, and the first pick is still the fastest of the whole space."""

import contextlib
import io
import json

import pytest

from test_plan_recommend_brute import _check
from zerodp.cli import main
from zerodp.plan.collectives import collective_time
from zerodp.plan.hybrid import step_comm
from zerodp.plan.memory import memory_plan
from zerodp.plan.ownership import PER_TENSOR
from zerodp.plan.recommend import recommend
from zerodp.ui.api import Api

MODEL, SEQ, TOKENS = "llama3-8b", 4096, 4 * 2**20
OPTIMIZERS = ("adamw", "muon", "adafactor")


def _memory(n, c, optimizer):
    """``plan memory``'s row for candidate ``c`` (its stage, shard group, micro-batch,
    recomputation) with ``optimizer``."""
    mp = memory_plan(MODEL, n, "H100", "bf16", seq=SEQ, micro_batch=c.micro_batch,
                     recompute=c.recompute, shard_size=None if c.shard_size == n else c.shard_size,
                     optimizer=optimizer)
    return mp.stages[c.stage]


@pytest.mark.parametrize("nodes", [1, 2], ids=["8-gpus", "16-gpus"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_row_holds_what_plan_memory_prints(nodes, optimizer):
    r = recommend(MODEL, "H100", nodes, 8, TOKENS, SEQ, top=1000, optimizer=optimizer)
    assert r.optimizer == optimizer and r.candidates
    n = nodes * 8
    for c in r.candidates:
        row = _memory(n, c, optimizer)
        assert c.memory_bytes == row["total_bytes"], (c, row["total_bytes"])
        assert c.comm_elements == row["comm_elements_per_step"]
        assert row["verdict"] == c.verdict == "fits"
        if optimizer in PER_TENSOR and c.stage > 0:  # the fullest rank's state, padded slices
            o = row["ownership"]
            assert row["optimizer_bytes"] == 4 * o["shard_numel"] + o["max_state_bytes"]
            assert c.comm_elements == (3 if c.stage == 3 else 2) * o["padded_numel"] + o["max_exchange_elements"]


def test_muon_moves_more_than_adamw_at_zero3():
    """Stage 3 with muon gathers and reduces flat units (3Ψ, as AdamW) and adds the owner
    exchange: the step's communication grows by exactly what an fp32 ReduceScatter sending the
    exchange's bytes per rank costs, once per step."""
    fixed = dict(stages=(3,), micro_batches=(1,), recompute=("full",), compress=("none",))
    adamw = recommend(MODEL, "H100", 1, 8, TOKENS, SEQ, **fixed).best
    muon = recommend(MODEL, "H100", 1, 8, TOKENS, SEQ, optimizer="muon", **fixed).best
    psi = memory_plan(MODEL, 8, "H100").model["params"]
    assert adamw.comm_elements == 3 * psi
    own = _memory(8, muon, "muon")["ownership"]
    padded, moved = own["padded_numel"], own["max_exchange_elements"]
    assert muon.comm_elements == 3 * padded + moved > 3 * psi and padded - psi < 8 * own["groups"]
    assert 0 < moved < psi / 2
    per_micro = (step_comm("H100", 8, 3, padded, gathers_per_step=2).time_s
                 - step_comm("H100", 8, 3, psi, gathers_per_step=2).time_s)
    exchange = collective_time("reduce_scatter", 4 * moved * 8 / 7, 8, "H100").time_s
    assert muon.comm_s - adamw.comm_s == pytest.approx(muon.grad_acc * per_micro + exchange, rel=1e-9)
    assert muon.comm_s > adamw.comm_s


def test_adafactor_fits_where_adamw_does_not():
    """Llama 3 8B on 8 H100, plain DP (stage 0): AdamW's fp32 master and two moments need
    (2 + 2 + 12)·Ψ = 128 GB before activations, nothing fits; Adafactor's factored second moment
    is row + column, so with full recomputation DP fits in 72 GB."""
    only_dp = dict(stages=(0,))
    adamw = recommend(MODEL, "H100", 1, 8, TOKENS, SEQ, **only_dp)
    ada = recommend(MODEL, "H100", 1, 8, TOKENS, SEQ, optimizer="adafactor", **only_dp)
    assert not adamw.candidates and adamw.fitting == 0
    assert ada.candidates and ada.best.stage == 0 and ada.best.recompute == "full"
    assert ada.best.memory_bytes <= 0.9 * 80e9
    row = _memory(8, ada.best, "adamw")  # the same point with AdamW: does not fit
    assert row["verdict"] == "no" and row["total_bytes"] > 80e9
    # in the full search too: layouts only Adafactor fits
    full = {o: {(c.stage, c.shard_size, c.micro_batch, c.recompute) for c in
                recommend(MODEL, "H100", 1, 8, TOKENS, SEQ, top=1000, optimizer=o).candidates}
            for o in ("adamw", "adafactor")}
    assert (0, 8, 1, "full") in full["adafactor"] - full["adamw"]


def test_first_pick_is_the_fastest_of_the_whole_space_with_muon():
    """tests/test_plan_recommend_brute.py's check (every point of the space priced alone, the
    same count searched and fitting, the first pick the fastest of them) with muon."""
    full = _check(MODEL, 1, TOKENS, SEQ, optimizer="muon")
    assert full.optimizer == "muon"


def test_the_cli_and_the_page_name_the_optimizer():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "recommend", "--model", MODEL, "--optimizer", "muon", "--top", "2"]) == 0
    text = out.getvalue()
    assert ", bf16, muon optimizer, flash attention," in text.splitlines()[0]
    assert "zerodp train steps AdamW: run muon" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "recommend", "--json", "--model", MODEL, "--optimizer", "muon"]) == 0
    cli = json.loads(out.getvalue())
    api = Api().handle("recommend", {"model": MODEL, "optimizer": "muon"})
    assert cli["optimizer"] == api["optimizer"] == "muon"
    assert [c["memory_bytes"] for c in cli["candidates"]] == \
        [c["memory_bytes"] for c in api["candidates"]]
    assert cli["candidates"][0]["memory_bytes"] == _memory(
        8, recommend(MODEL, "H100", 1, 8, optimizer="muon").best, "muon")["total_bytes"]
    schema = {e: {p["name"]: p for p in v["params"]} for e, v in Api().schema().items()}
    assert schema["recommend"]["optimizer"] == schema["memory"]["optimizer"]


def test_the_cli_smoke():
    """One real process: the console script prints the table with the optimizer."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("zerodp")
    r = subprocess.run([str(exe), "plan", "recommend", "--model", MODEL, "--optimizer", "adafactor",
                        "--stage", "0", "--top", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "adafactor optimizer" in r.stdout and "DP" in r.stdout
