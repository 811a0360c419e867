"""Four training scripts in the shapes of public ones, ported by the import and the wrap line alone
(examples/port_*.py, docs/porting.md): each equal to DDP at stages 0-3.

One spawned group per world size runs every script with DDP and with zerodp at each stage, and
compares what the script logs, step by step, against DDP's:

- ``port_nanogpt`` (optimizer before the wrap, adopted; rank-0 evaluation and checkpoint, served at
  stages 1-3): losses and evaluations;
- ``port_imagenet`` (BatchNorm, optimizer and StepLR after the wrap, validation on every rank,
  rank-0 checkpoint): losses and validation losses;
- ``port_build_nanogpt`` (bf16 autocast, the loss all-reduced by the script, rank-0
  ``raw_model.state_dict()``): the logged loss and gradient norm;
- ``port_timm`` (the wrapped model a child module of a task object, EMA, rank-0 checkpoint, resume
  before the wrap): losses, the EMA, and the resumed run against the uninterrupted one.

Both wraps compute the same per-rank forward and backward and differ only in the order in which a
step's gradient terms are summed, so in fp32 step k is within ``trajectory_tolerance(n, k + 1)``
(tests/_engine_common.py) of DDP, n the terms of one step's gradient. Under bf16 autocast the
forward rounds every activation to bf16: a parameter that differs from DDP's by less than fp32
round-off can flip one rounding, moving that activation by one bf16 unit (2⁻⁸ relative), and the
logged loss — a mean of such values — by at most 2⁻⁸ relative per step since the runs diverged:
``(k + 1)·2⁻⁸``. DDP's own reorder floor (DDP again with other bucket sizes) is measured beside it
and printed. ``make test`` runs 2 ranks; ``make fuzz`` (ZERODP_ALL_WORLDS=1) 2 and 3 ranks and
twice the steps.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

from _engine_common import ALL_WORLDS, spawn_once, trajectory_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # the spawned ranks inherit it

import port_build_nanogpt  # noqa: E402
import port_imagenet  # noqa: E402
import port_nanogpt  # noqa: E402
import port_timm  # noqa: E402
import porting_ddp  # noqa: E402

pytestmark = pytest.mark.dist
WORLDS = (2, 3) if ALL_WORLDS else (2,)
SCALE = 2 if ALL_WORLDS else 1
STAGES = (0, 1, 2, 3)
WRAPS = [("ddp", 0)] + [("zerodp", s) for s in STAGES]
U_BF16 = 2.0 ** -8


def _runs(rank: int, world: int, folder: str) -> dict:
    out = {}
    for wrap, stage in WRAPS:
        out["nanogpt", wrap, stage] = port_nanogpt.train(rank, world, wrap, stage, 4 * SCALE, out_dir=folder)
        out["imagenet", wrap, stage] = port_imagenet.train(rank, world, wrap, stage, 2 * SCALE, out_dir=folder)
        out["build_nanogpt", wrap, stage] = port_build_nanogpt.train(rank, world, wrap, stage, 4 * SCALE,
                                                                     out_dir=folder)
        ckpt = os.path.join(folder, f"timm-{wrap}-{stage}.pth.tar")
        epochs = 2 * SCALE
        out["timm", wrap, stage] = port_timm.train(rank, world, wrap, stage, epochs, ckpt=ckpt, save_epoch=epochs // 2)
        out["timm resumed", wrap, stage] = port_timm.train(rank, world, wrap, stage, epochs, ckpt=ckpt, resume=True)
    # DDP's own reorder floor under autocast: other bucket sizes, another summation order
    out["build_nanogpt floor"] = _ddp_other_buckets(rank, world)
    return out


def _ddp_other_buckets(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    real = port_build_nanogpt.DDP
    port_build_nanogpt.DDP = functools.partial(DistributedDataParallel, bucket_cap_mb=0.001)
    try:
        return port_build_nanogpt.train(rank, world, "ddp", 0, 4 * SCALE)
    finally:
        port_build_nanogpt.DDP = real


def results(world: int) -> list[dict]:
    return spawn_once(_runs, world, folder=True, timeout=900)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _within(got: list[float], want: list[float], tol_of_step, what: str) -> float:
    """Each step k of ``got`` within ``tol_of_step(k)`` of ``want``; returns the largest ratio."""
    assert len(got) == len(want), (what, got, want)
    worst = 0.0
    for k, (a, b) in enumerate(zip(got, want)):
        tol = tol_of_step(k)
        assert _rel(a, b) <= tol, f"{what}, step {k}: {a!r} vs DDP's {b!r} ({_rel(a, b):.3g} > {tol:.3g})"
        worst = max(worst, _rel(a, b) / tol)
    return worst


def _losses_against_ddp(world: int, stage: int, script: str, terms: int):
    """Per rank: each step's loss within the trajectory bound of DDP's; yields what the test checks
    next (rank, its results, zerodp's and DDP's runs, the bound at step k)."""
    for rank, r in enumerate(results(world)):
        mine, ddp = r[script, "zerodp", stage], r[script, "ddp", 0]
        tol = lambda k: trajectory_tolerance(world * terms, k + 1)  # noqa: E731
        _within(mine["loss"], ddp["loss"], tol, f"rank {rank} stage {stage} loss")
        yield rank, r, mine, ddp, tol


NANOGPT_TERMS = porting_ddp.GRAD_ACC * porting_ddp.MICRO_BATCH * porting_ddp.SEQ  # per rank
IMAGENET_TERMS = port_imagenet.BATCH * port_imagenet.SIZE * port_imagenet.SIZE  # per rank


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_nanogpt_shape_equals_ddp(world, stage):
    for rank, _, mine, ddp, tol in _losses_against_ddp(world, stage, "nanogpt", NANOGPT_TERMS):
        assert sorted(mine["eval"]) == sorted(ddp["eval"]) and (bool(ddp["eval"]) == (rank == 0)), (mine, ddp)
        for it, loss in ddp["eval"].items():
            assert _rel(mine["eval"][it], loss) <= tol(it), (rank, stage, it, mine["eval"][it], loss)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_imagenet_shape_equals_ddp(world, stage):
    iters = 2
    for rank, _, mine, ddp, tol in _losses_against_ddp(world, stage, "imagenet", IMAGENET_TERMS):
        _within(mine["val"], ddp["val"], lambda e: tol(iters * (e + 1)), f"rank {rank} stage {stage} validation")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_build_nanogpt_shape_equals_ddp_within_the_bf16_autocast_bound(world, stage):
    bound = lambda k: (k + 1) * U_BF16  # noqa: E731 - the module docstring's derivation
    for rank, r in enumerate(results(world)):
        mine, ddp, floor = r["build_nanogpt", "zerodp", stage], r["build_nanogpt", "ddp", 0], r["build_nanogpt floor"]
        worst = _within(mine["loss"], ddp["loss"], bound, f"rank {rank} stage {stage} loss")
        _within(mine["norm"], ddp["norm"], bound, f"rank {rank} stage {stage} grad norm")
        ours = max(_rel(a, b) for a, b in zip(mine["loss"], ddp["loss"]))
        theirs = max(_rel(a, b) for a, b in zip(floor["loss"], ddp["loss"]))
        print(f"\nworld {world} stage {stage} rank {rank}: largest loss difference from DDP {ours:.2g} "
              f"(DDP with other buckets: {theirs:.2g}; bound at the last step {bound(len(ddp['loss']) - 1):.2g}; "
              f"worst step at {worst:.2f} of its bound)")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_timm_shape_equals_ddp_and_resumes_before_the_wrap(world, stage):
    for rank, r, mine, ddp, tol in _losses_against_ddp(world, stage, "timm", IMAGENET_TERMS):
        _within(mine["ema"], ddp["ema"], lambda e: tol(2 * (e + 1)), f"rank {rank} stage {stage} EMA")
        resumed = r["timm resumed", "zerodp", stage]
        tail = mine["loss"][len(mine["loss"]) - len(resumed["loss"]):]
        assert resumed["loss"] and len(resumed["loss"]) < len(mine["loss"]), resumed
        _within(resumed["loss"], tail, lambda k: tol(k + len(mine["loss"]) - len(tail)),
                f"rank {rank} stage {stage}: resumed before the wrap vs uninterrupted")
        # DDP's own resume, the reference's: bitwise at 2 ranks (a sum of 2 is order-free). At 3 a
        # fresh DDP's first step can reduce in other buckets than the uninterrupted run's, which
        # rebuilt its buckets after step 1, and gloo's ring then adds the 3 terms in another order
        # (1 ulp seen): within the same bound as ours
        ddp_resumed = r["timm resumed", "ddp", 0]
        ddp_tail = ddp["loss"][len(ddp["loss"]) - len(ddp_resumed["loss"]):]
        if world == 2:
            assert ddp_resumed["loss"] == ddp_tail, "DDP's own resume"
        _within(ddp_resumed["loss"], ddp_tail, lambda k: tol(k + len(ddp["loss"]) - len(ddp_tail)), "DDP's own resume")
