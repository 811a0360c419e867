"""Stage 0 (DDP, guide §2-§5) on gloo at world sizes 2, 3, 4, against independent references.

One spawned group per world size runs every check (spawning costs seconds); the test functions
below read its results. References: a single-process model on the full batch, and
``torch.nn.parallel.DistributedDataParallel`` for trajectories.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from _engine_common import (ALL_WORLDS, FEW_BUCKETS, NANO, PER_RANK, SMALL_BUCKETS, TRAJECTORY, adamw, gpt_batch,
                            make_gpt, make_odd, max_rel, norm_rel, odd_batch, shard, spawn_once, sum_tolerance,
                            trajectory_tolerance, worst)
from zerodp.plan._common import MIB
from zerodp.plan.units import plan_buckets

pytestmark = pytest.mark.dist
#: make test: 2 ranks; make fuzz (ZERODP_ALL_WORLDS=1): 2, 3 and 4 (the differential matrix
#: covers every world size 1-4 in make test)
WORLDS = (2, 3, 4) if ALL_WORLDS else (2,)
MODES = ("naive", "overlap", "bucketed")
STEPS = 20
# Tolerances (_engine_common.sum_tolerance): a gradient here sums every token of the batch
# (N ranks × PER_RANK sequences × seq_len tokens, × 4 micro-batches when accumulating) in another
# order than the full-batch reference. A real fault (a micro-batch lost or counted twice, a wrong
# ÷N) is ≥ 1e-2, orders of magnitude above these bounds.


def batch_terms(world: int, micro: int = 1) -> int:
    return world * PER_RANK * NANO.seq_len * micro


ACCUMULATED_MICRO = 4


class Branchy(nn.Module):
    """``branch`` is used only when ``use_branch`` — on some ranks, not others."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x, y, use_branch):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return F.mse_loss(self.out(h), y)


def _grad_errors(model, ref, measure=max_rel) -> dict[str, float]:
    refs = dict(ref.named_parameters())
    return {n: measure(p.grad, refs[n].grad) for n, p in model.named_parameters()}


def _modes(rank, world, out):
    """Gradients equal the full batch's in every mode; buckets launch in order, overlap or not."""
    for mode in MODES:
        for kind, make, batch, per_rank in (("gpt", make_gpt, gpt_batch, PER_RANK), ("odd", make_odd, odd_batch, 3)):
            model, ref = make(), make()
            engine = zerodp.parallelize(model, adamw, stage=0, sync=mode, **SMALL_BUCKETS)
            x, y = batch(0, world)
            engine(shard(x, rank, per_rank), shard(y, rank, per_rank)).backward()
            ref(x, y).backward()
            out[f"grad_err/{mode}/{kind}"] = worst(_grad_errors(model, ref))
            if kind != "gpt":
                continue
            engine.step()
            events = engine.recorder.step_events(0)
            comm = [e for e in events if e.lane == "comm"]
            backward = [e for e in events if e.name == "backward"][0]
            out[f"trace/{mode}"] = {
                "labels": [e.args["label"] for e in comm],
                "buckets": [b.names for b in engine.groups],
                "registration": [n for n, _ in model.named_parameters()],
                "first_comm_before_backward_end": min(e.start for e in comm) < backward.end,
                "all_reduces": engine.stats().collectives["all_reduce"].count,
                "bytes": engine.stats().collectives["all_reduce"].bytes,
                "grad_bytes": sum(b.grads.grad_full.numel() * b.grads.grad_full.element_size() for b in engine.groups),
            }


def _trajectory_vs_ddp(rank, world, out, tmpdir):
    """20 AdamW steps: losses and parameters equal torch DDP's (fp32); bf16 stays close (world 2)."""
    runs = {"fp32": zerodp.parallelize(make_gpt(**TRAJECTORY), adamw, stage=0, **FEW_BUCKETS)}
    if world == 2:
        runs["bf16"] = zerodp.parallelize(make_gpt(**TRAJECTORY), adamw, stage=0, mixed_precision="bf16",
                                          **FEW_BUCKETS)
    ddp_model = make_gpt(**TRAJECTORY)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    opt = adamw(ddp.parameters())
    losses = {name: [] for name in [*runs, "ddp"]}
    for step in range(STEPS):
        x, y = gpt_batch(step, world)
        xs, ys = shard(x, rank, PER_RANK), shard(y, rank, PER_RANK)
        for name, eng in runs.items():
            loss = eng(xs, ys)
            loss.backward()
            eng.step()
            eng.zero_grad()
            losses[name].append(loss.item())
        loss = ddp(xs, ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses["ddp"].append(loss.item())
    engine = runs["fp32"]
    full = engine.full_state_dict()
    out["traj/loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses["fp32"], losses["ddp"]))
    out["traj/param_err"] = worst({n: norm_rel(full[n], p) for n, p in ddp_model.named_parameters()})
    out["traj/module_is_master"] = worst({n: max_rel(p, full[n]) for n, p in engine.module.named_parameters()})
    if "bf16" in runs:
        bf16 = runs["bf16"]
        out["bf16/loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses["bf16"], losses["ddp"]))
        out["bf16/dtypes"] = sorted({str(p.dtype) for p in bf16.module.parameters()})
        out["bf16/master_dtypes"] = sorted({str(t.tensor.dtype) for t in bf16.master.targets})
        stats = bf16.stats()
        out["bf16/bytes_per_param"] = {k: v / stats.num_params for k, v in stats.memory.items()}
    # Checkpoint pieces: what this rank saves, with values, to check disjointness and coverage.
    # (numpy, not tensors: tensors would travel back through shared memory of an exited process)
    out["pieces"] = [(p.name, p.kind, p.start, p.stop, p.tensor.numpy().copy())
                     for p in engine.checkpoint.state_pieces()]
    out["full_state"] = {n: t.numpy() for n, t in full.items()}
    out["trace_path"] = engine.export_chrome_trace(os.path.join(tmpdir, f"stage0-{world}.json"))


def _no_sync(rank, world, out):
    """grad_acc = 4 under no_sync: one AllReduce per bucket per step; grads = full-batch grads."""
    acc = 4
    model, ref = make_gpt(), make_gpt()
    engine = zerodp.parallelize(model, adamw, stage=0, **SMALL_BUCKETS)
    x, y = gpt_batch(7, world, per_rank=PER_RANK * acc)
    rows = world * PER_RANK
    for m in range(acc):
        xm, ym = x[m * rows:(m + 1) * rows], y[m * rows:(m + 1) * rows]
        with engine.no_sync(m < acc - 1):
            (engine(shard(xm, rank, PER_RANK), shard(ym, rank, PER_RANK)) / acc).backward()
    ref(x, y).backward()
    out["no_sync/grad_err"] = worst(_grad_errors(model, ref, norm_rel))
    norm = engine.clip_grad_norm_(0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    out["clip/norm_err"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
    out["clip/grad_err"] = worst(_grad_errors(model, ref, norm_rel))
    engine.step()
    out["no_sync/all_reduces"] = engine.stats().collectives["all_reduce"].count
    out["no_sync/buckets"] = len(engine.groups)


def _unused_and_mismatch(rank, world, out):
    """Unused parameters: a clear error by default, correct gradients when tolerated.
    Mismatched models: every rank fails at start-up with a message naming the difference."""
    model = make_gpt()
    model.unused_scale = nn.Parameter(torch.ones(3))
    engine = zerodp.parallelize(model, adamw, stage=0, **SMALL_BUCKETS)
    x, y = gpt_batch(0, world)
    try:
        engine(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK)).backward()
        out["unused/error"] = None
    except RuntimeError as e:
        out["unused/error"] = str(e)

    model, ref = Branchy(), Branchy()
    engine = zerodp.parallelize(model, adamw, stage=0, find_unused_parameters=True, bucket_mb=1e-4,
                                first_bucket_mb=1e-4)
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(world, 4, 6, generator=g), torch.randn(world, 4, 2, generator=g)
    engine(xs[rank], ys[rank], rank == 0).backward()
    sum(ref(xs[r], ys[r], r == 0) for r in range(world)).div(world).backward()
    out["unused/tolerated_grad_err"] = worst(_grad_errors(model, ref))

    wrong = make_odd()
    if rank == world - 1:
        wrong.fc2 = nn.Linear(7, 4)
    try:
        zerodp.parallelize(wrong, adamw, stage=0)
        out["mismatch/error"] = None
    except RuntimeError as e:
        out["mismatch/error"] = str(e)


def _tokens(rank, world, out):
    """Guide §2.2: ranks with different token counts, weighted by tokens = the full-batch token mean."""
    model, ref = make_gpt(), make_gpt()
    engine = zerodp.parallelize(model, adamw, stage=0, average_by_tokens=True, **SMALL_BUCKETS)
    g = torch.Generator().manual_seed(11)
    seqs = [8 * (r + 1) for r in range(world)]
    data = [torch.randint(0, 256, (PER_RANK, s + 1), generator=g) for s in seqs]
    x = data[rank]
    engine.count_tokens(x[:, 1:].numel())
    engine(x[:, :-1], x[:, 1:]).backward()
    total = sum(d[:, 1:].numel() for d in data)
    sum(ref(d[:, :-1], d[:, 1:]) * d[:, 1:].numel() for d in data).div(total).backward()
    out["tokens/grad_err"] = worst(_grad_errors(model, ref))


def _stage0_checks(rank, world, tmpdir):
    torch.use_deterministic_algorithms(True)
    out: dict = {}
    _modes(rank, world, out)
    _trajectory_vs_ddp(rank, world, out, tmpdir)
    _no_sync(rank, world, out)
    _unused_and_mismatch(rank, world, out)
    _tokens(rank, world, out)
    return out


def results(world: int) -> list[dict]:
    return spawn_once(_stage0_checks, world, folder=True, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", MODES)
def test_gradients_equal_full_batch_in_every_mode(world, mode):
    for r in results(world):
        for kind in ("gpt", "odd"):
            name, err = r[f"grad_err/{mode}/{kind}"]
            assert err <= sum_tolerance(batch_terms(world)), \
                f"{mode}/{kind}: {name} gradient off by {err:.2e} (world {world})"


@pytest.mark.parametrize("world", WORLDS)
def test_twenty_adamw_steps_equal_torch_ddp(world):
    for r in results(world):
        tol = trajectory_tolerance(world, STEPS)  # both sum N ranks' gradients, in other buckets
        assert r["traj/loss_err"] <= tol
        name, err = r["traj/param_err"]
        assert err <= tol, f"{name}: ‖ours − DDP‖/‖DDP‖ = {err:.2e}"
        assert r["traj/module_is_master"][1] == 0.0


def test_bf16_mixed_precision_keeps_fp32_master_and_16_bytes_per_param():
    for r in results(2):
        assert r["bf16/dtypes"] == ["torch.bfloat16"] and r["bf16/master_dtypes"] == ["torch.float32"]
        per = r["bf16/bytes_per_param"]
        # guide §1: 2 (bf16 param) + 2 (bf16 grad) + 4 (fp32 master) + 8 (Adam m, v); padding aside.
        for kind, want in (("params", 2), ("grads", 2), ("master", 4), ("optimizer_states", 8)):
            assert want <= per[kind] < want * 1.01, (kind, per[kind])
        # bf16 keeps 8 significant bits (ε = 2^-7, rounding 2^-8 per value); over 20 steps the
        # loss of the bf16 run stays within 2ε (1.6%) of the fp32 DDP run's.
        assert r["bf16/loss_err"] < 2 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("world", WORLDS)
def test_no_sync_one_all_reduce_per_bucket_and_full_batch_grads(world):
    for r in results(world):
        assert r["no_sync/all_reduces"] == r["no_sync/buckets"] > 1
        name, err = r["no_sync/grad_err"]
        assert err <= sum_tolerance(batch_terms(world, ACCUMULATED_MICRO)), \
            f"{name}: ‖ours − full batch‖/‖full batch‖ = {err:.2e}"


@pytest.mark.parametrize("world", WORLDS)
def test_clip_grad_norm_matches_torch(world):
    for r in results(world):
        assert r["clip/norm_err"] <= sum_tolerance(batch_terms(world))
        assert r["clip/grad_err"][1] <= sum_tolerance(batch_terms(world, ACCUMULATED_MICRO))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", MODES)
def test_bucket_plan_order_and_overlap_from_the_trace(world, mode):
    t = results(world)[0][f"trace/{mode}"]
    assert t["all_reduces"] == len(t["buckets"]) == len(t["labels"])
    assert t["labels"] == [f"bucket {i}" for i in range(len(t["buckets"]))]  # launched in order
    reverse = t["registration"][::-1]
    assert [n for b in t["buckets"] for n in b] == reverse  # buckets hold params in reverse order
    assert t["bytes"] == t["grad_bytes"]
    if mode == "naive":
        assert len(t["buckets"]) == 1 and not t["first_comm_before_backward_end"]
    else:
        assert len(t["buckets"]) > 1 and t["first_comm_before_backward_end"]


@pytest.mark.parametrize("world", WORLDS)
def test_unused_parameter_error_names_it_and_tolerance_gives_correct_grads(world):
    for r in results(world):
        assert r["unused/error"] and "unused_scale" in r["unused/error"]
        assert "find_unused_parameters=True" in r["unused/error"]
        assert r["unused/tolerated_grad_err"][1] <= sum_tolerance(batch_terms(world))


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_with_different_models_fail_at_start_up(world):
    for r in results(world):
        msg = r["mismatch/error"]
        assert msg and "fc2.weight" in msg and f"rank {world - 1}" in msg


@pytest.mark.parametrize("world", WORLDS)
def test_average_by_tokens_equals_full_batch_token_mean(world):
    for r in results(world):
        assert r["tokens/grad_err"][1] <= sum_tolerance(batch_terms(world))


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoint_pieces_are_disjoint_and_cover_every_element(world):
    res = results(world)
    full = {n: torch.from_numpy(a) for n, a in res[0]["full_state"].items()}
    covered = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in full.items()}
    for r in res:
        for name, kind, start, stop, values in r["pieces"]:
            if kind == "param":
                covered[name][start:stop] += 1
                assert torch.equal(torch.from_numpy(values), full[name].reshape(-1)[start:stop])
    for name, c in covered.items():
        assert torch.all(c == 1), f"{name}: elements saved {c.min()}..{c.max()} times"


@pytest.mark.parametrize("world", WORLDS)
def test_chrome_trace_has_every_rank_and_both_lanes(world):
    res = results(world)
    assert all(r["trace_path"] is None for r in res[1:])
    with open(res[0]["trace_path"]) as f:
        events = json.load(f)["traceEvents"]
    assert {e["pid"] for e in events} == set(range(world))
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {"compute", "comm"}
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"forward", "backward", "step", "all_reduce"} <= names


def test_bucket_plan_is_reverse_small_first_and_never_mixes_groups():
    sizes = [1000, 10, 2000, 10, 3000, 10, 4000, 10]
    groups = [0, 1, 0, 1, 0, 1, 0, 1]
    plan = plan_buckets(sizes, groups, 4, "bucketed", bucket_mb=8000 * 4 / MIB, first_bucket_mb=3000 * 4 / MIB)
    assert sorted(i for b in plan for i in b) == list(range(8))
    for b in plan:
        assert len({groups[i] for i in b}) == 1
        assert b == sorted(b, reverse=True)
    # Walking back from the last parameter: group 0's 4000 elements fill the small first bucket
    # alone; group 1's tiny ones and group 0's rest stay below the 8000-element cap.
    assert plan == [[7, 5, 3, 1], [6], [4, 2, 0]]
    assert plan_buckets(sizes, groups, 4, "naive", 1, 1) == [[7, 5, 3, 1], [6, 4, 2, 0]]
    assert plan_buckets(sizes, groups, 4, "overlap", 1, 1) == [[i] for i in range(7, -1, -1)]


def test_bad_options_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="sync='fast' is unknown"):
        zerodp.parallelize(make_odd(), adamw, stage=0, sync="fast")
    with pytest.raises(TypeError, match="unknown option"):
        zerodp.parallelize(make_odd(), adamw, stage=0, buckets=3)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        zerodp.parallelize(make_odd(), adamw, stage=0)


