"""examples/porting_ddp.py: a DDP script run unchanged on zerodp but for the wrap line (docs/porting.md).

One spawned group of 2 gloo ranks runs the example's ``train`` with ``--wrap ddp`` and with zerodp
at stages 0-3, each uninterrupted for STEPS steps (writing its own checkpoint after SAVE_AT) and
again resumed from that checkpoint; then zerodp at every stage resumes from DDP's checkpoint.

What is compared, on every rank: each step's training loss and clipped gradient norm, and rank 0's
evaluation losses, against DDP's. Both compute the same per-rank forward and backward; they differ
in the order in which the gradient's terms are summed (ranks, micro-batches, tokens: N_TERMS in
all) and so, after k steps, by up to ``trajectory_tolerance(N_TERMS, k)`` of the magnitude
(tests/_engine_common.py); a loss or norm at step k adds one more such sum (its own mean over
tokens), hence ``k + 1``. A resumed run must continue exactly as the uninterrupted one did.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _engine_common import spawn_once, trajectory_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # the spawned ranks inherit it

import porting_ddp as ex  # noqa: E402

pytestmark = pytest.mark.dist
WORLD = 2
STAGES = (0, 1, 2, 3)
STEPS, SAVE_AT = 8, 4
N_TERMS = WORLD * ex.GRAD_ACC * ex.MICRO_BATCH * ex.SEQ  # token terms in one step's gradient


def _every_wrap(rank: int, world: int, folder: str) -> dict:
    out = {}
    for wrap, stage in [("ddp", 0)] + [("zerodp", s) for s in STAGES]:
        path = f"{folder}/{wrap}-{stage}.pt"
        full = ex.train(rank, world, wrap, stage, STEPS, checkpoint=path, save_at=SAVE_AT)
        resumed = ex.train(rank, world, wrap, stage, STEPS, checkpoint=path, resume=True)
        out[wrap, stage] = full, resumed
    for stage in STAGES:  # a DDP run's checkpoint (raw_model's names, torch's optimizer state)
        out["from ddp", stage] = ex.train(rank, world, "zerodp", stage, STEPS, checkpoint=f"{folder}/ddp-0.pt",
                                          resume=True)
    return out


def results() -> list[dict]:
    return spawn_once(_every_wrap, WORLD, folder=True, timeout=600)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _worst(series: list[float], reference: list[float], first_step: int = 0) -> tuple[float, float, int]:
    """(the largest relative difference over its bound, that difference, at which step) — each
    step's value compared with ``trajectory_tolerance(N_TERMS, k + 1)`` for k steps taken before it."""
    assert len(series) == len(reference)
    ratios = []
    for i, (a, b) in enumerate(zip(series, reference)):
        k = first_step + i
        ratios.append((_rel(a, b) / trajectory_tolerance(N_TERMS, k + 1), _rel(a, b), k))
    return max(ratios)


def test_the_script_clips_and_evaluates():
    """The comparison means something: the norm exceeds 1.0 on every step (torch's clip scales
    the gradients), the loss falls, and rank 0 evaluated."""
    for rank, r in enumerate(results()):
        full, _ = r["ddp", 0]
        assert len(full["loss"]) == STEPS and min(full["grad_norm"]) > 1.0, full["grad_norm"]
        assert full["loss"][-1] < full["loss"][0]
        assert sorted(full["eval"]) == ([4] if rank == 0 else [])


@pytest.mark.parametrize("stage", STAGES)
def test_zerodp_gives_ddps_losses_within_float32_round_off(stage):
    for rank, r in enumerate(results()):
        ddp, _ = r["ddp", 0]
        mine, _ = r["zerodp", stage]
        for key in ("loss", "grad_norm"):
            ratio, rel, k = _worst(mine[key], ddp[key])
            assert ratio <= 1.0, (f"rank {rank}, stage {stage}: {key} at step {k + 1} differs from DDP's by "
                                  f"{rel:.3g} relative (bound {trajectory_tolerance(N_TERMS, k + 1):.3g})")
        assert sorted(mine["eval"]) == sorted(ddp["eval"])  # rank 0 alone, served at stage 3
        for step, loss in ddp["eval"].items():
            tol = trajectory_tolerance(N_TERMS, step + 1)
            assert _rel(mine["eval"][step], loss) <= tol, (rank, stage, step, mine["eval"][step], loss, tol)


@pytest.mark.parametrize("wrap,stage", [("ddp", 0)] + [("zerodp", s) for s in STAGES])
def test_resume_from_the_scripts_own_checkpoint_continues_identically(wrap, stage):
    for rank, r in enumerate(results()):
        full, resumed = r[wrap, stage]
        assert resumed["loss"] == full["loss"][SAVE_AT:], (rank, resumed["loss"], full["loss"][SAVE_AT:])
        assert resumed["grad_norm"] == full["grad_norm"][SAVE_AT:], rank
        assert resumed["eval"] == {s: v for s, v in full["eval"].items() if s > SAVE_AT}, rank


@pytest.mark.parametrize("stage", STAGES)
def test_zerodp_resumes_a_ddp_checkpoint(stage):
    """DDP's ``model.module.state_dict()`` and its optimizer's torch-format state load as they are
    into the module and the optimizer built after the wrap; the run continues as DDP's own did."""
    for rank, r in enumerate(results()):
        ddp, _ = r["ddp", 0]
        resumed = r["from ddp", stage]
        for key in ("loss", "grad_norm"):
            ratio, rel, k = _worst(resumed[key], ddp[key][SAVE_AT:], first_step=SAVE_AT)
            assert ratio <= 1.0, f"rank {rank}, stage {stage}: {key} at step {k + 1} differs by {rel:.3g}"
