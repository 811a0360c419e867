"""Shared pieces of the training app's tests: a full state cut into ranks' checkpoint pieces here,
independently of the engine (tests/test_train_checkpoint.py, test_storage_units.py,
test_reliability_checkpoint.py), a save killed mid-way in a process of its own, and a rank's
context on the CPU for ``zerodp.train.loop``."""

from __future__ import annotations

import multiprocessing as mp

import torch

from zerodp.engine.master import Piece
from zerodp.train import checkpoint as ckpt
from zerodp.train.hooks import Hooks

KINDS = ("param", "exp_avg")
MODEL = {"d_model": 8, "n_layer": 1}


def reference_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (5, 3), "b.bias": (7,), "c.weight": (2, 2, 3)}
    return {(n, k): torch.randn(s, generator=g) for n, s in shapes.items() for k in KINDS}


def pieces_for(state, rank, world):
    """The full state concatenated in name order and split into ``world`` contiguous ranges, the
    way a ZeRO flat buffer is (guide §9): rank ``rank``'s pieces."""
    names = sorted({n for n, _ in state})
    sizes = {n: state[(n, "param")].numel() for n in names}
    total = sum(sizes.values())
    shard = -(-total // world)
    lo, hi = rank * shard, min(total, (rank + 1) * shard)
    out, at = [], 0
    for n in names:
        a, b = max(lo, at), min(hi, at + sizes[n])
        if a < b:
            for k in KINDS:
                flat = state[(n, k)].reshape(-1)
                out.append(Piece(n, k, a - at, b - at, tuple(state[(n, k)].shape), flat[a - at:b - at]))
        at += sizes[n]
    return out


def save_then_die(root, step, phase):
    """One writer saving ``reference_state(seed=step)`` as step ``step``, killed at ``phase``."""
    import os

    class DieAt(Hooks):
        def save_phase(self, step, name):
            if name == phase:
                os._exit(17)  # as abrupt as a kill: no cleanup, no exception handlers

    ckpt.save(pieces_for(reference_state(seed=step), 0, 1), root, step, {"model": MODEL},
              keep=1, hooks=DieAt())


def save_killed(root, step, phase, wait_s: float) -> int | None:
    """:func:`save_then_die` in a new process, waited for at most ``wait_s``: its exit code (17)."""
    proc = mp.get_context("spawn").Process(target=save_then_die, args=(str(root), step, phase))
    proc.start()
    proc.join(wait_s)
    return proc.exitcode


def cpu_context(rank: int, world: int):
    """``zerodp.train.loop``'s context of rank ``rank`` of ``world`` on the CPU (local rank = rank)."""
    from zerodp.train.loop import RankContext

    return RankContext(rank, world, rank, torch.device("cpu"))
