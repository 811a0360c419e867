"""Shared pieces of the engine tests: tiny models, deterministic data, error measures, and
:func:`spawn_once`, the one way a test starts a group of ranks.

Every numerical claim is checked against an independent reference computed in the same rank
process: a single-process full-batch model, torch DDP, or ZeroRedundancyOptimizer.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerodp.train.model import GPT, PRESETS

NANO = PRESETS["nano"]  # 43,904 parameters: seq 64, 2 blocks, d 32
PER_RANK = 2  # sequences per rank per micro-batch
SMALL_BUCKETS = dict(bucket_mb=0.02, first_bucket_mb=0.005)  # 8 buckets on the nano GPT
FEW_BUCKETS = dict(bucket_mb=0.06, first_bucket_mb=0.01)  # 4 buckets: cheaper for long runs
# Trajectories use bias=False: the key part of the attention's qkv bias has an exactly zero
# gradient (softmax is shift invariant), so Adam turns its rounding noise into full-size steps
# and no two correct implementations agree on it.
TRAJECTORY = dict(bias=False)


def make_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(NANO, **overrides))


class Odd(nn.Module):
    """Parameter sizes not divisible by 2, 3 or 4 (35, 7, 7, 7, 21, 3): padding everywhere."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.norm(self.fc1(x)))), y)


def make_odd(seed: int = 0) -> Odd:
    torch.manual_seed(seed)
    return Odd()


def gpt_batch(step: int, world: int, per_rank: int = PER_RANK, seq: int = NANO.seq_len):
    """The global batch of a step (the same on every rank); rank r takes rows r·per_rank..."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, NANO.vocab_size, (world * per_rank, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def regression_batch(seed: int, rows: int, dtype: torch.dtype = torch.float32):
    """``rows`` inputs of 5 features and targets of 3 (the small 5 → 3 models: Odd, Net, the
    matrix's and the idiom files'), normal, drawn from generator seed ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=g).to(dtype), torch.randn(rows, 3, generator=g).to(dtype)


def token_batch(seed: int, rows: int):
    """``rows`` sequences of random nano-GPT tokens and, as targets, each shifted by one (wrapping)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, NANO.vocab_size, (rows, NANO.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def odd_batch(step: int, world: int, per_rank: int = 3):
    return regression_batch(2000 + step, world * per_rank)


def shard(t: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    return t[rank * per_rank:(rank + 1) * per_rank]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| — elementwise, relative to the reference's scale."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ — the relative error of a whole tensor."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.norm().item()
    return (a - b).norm().item() / (scale if scale > 0 else 1.0)


def worst(errors: dict[str, float]) -> tuple[str, float]:
    name = max(errors, key=errors.get)
    return name, errors[name]


class Net(nn.Module):
    """The script-idiom model (tests/test_engine_idioms.py, tests/test_engine_fuzz.py): two blocks
    in a ModuleList (stage 3: two units and the root), an ``extra`` branch used only when asked,
    odd sizes (padding in every flat buffer), an optional hook on an activation."""

    def __init__(self, seed: int = 0, batchnorm: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(7), nn.Linear(7, 7)) for _ in range(2)])
        self.extra = nn.Linear(7, 7)
        self.norm = nn.BatchNorm1d(7) if batchnorm else nn.Identity()
        self.out = nn.Linear(7, 3)

    def forward(self, x, y, use_extra: bool = True, hook=None):
        h = self.norm(self.inp(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
            if hook is not None and h.requires_grad:
                h.register_hook(hook)
                hook = None
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return F.mse_loss(self.out(h), y)


class Residual(nn.Module):
    """``blocks`` residual blocks (LayerNorm, Linear) between an input and an output layer — stage
    3: one unit per block and the root; ``width`` 7 pads every flat buffer. ``checkpoint``: each
    block under activation checkpointing, "reentrant" or "non-reentrant"."""

    def __init__(self, blocks: int = 2, width: int = 7, seed: int = 0, checkpoint: str = "none"):
        super().__init__()
        torch.manual_seed(seed)
        self.checkpoint = checkpoint
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))
                                     for _ in range(blocks)])
        self.out = nn.Linear(width, 3)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            if self.checkpoint != "none":
                b = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.checkpoint == "reentrant")
            else:
                b = b(h)
            h = h + torch.tanh(b)
        return F.mse_loss(self.out(h), y)


# ---- optimizers -------------------------------------------------------------------------------
#: AdamW of the trajectory tests (stages 0-3). lr 1e-3: at 1e-2 the tiny models on random tokens
#: are so ill-conditioned that merely splitting a batch's sum in two *in one process* moves the
#: parameters by ~1e-3 relative after 20 Adam steps; at 1e-3 that inherent spread is ~2e-7.
ADAMW_LR, ADAMW_WD = 1e-3, 0.1


def adamw(groups):
    """torch AdamW at ADAMW_LR with weight decay ADAMW_WD: the engine's optimizer factory in the
    trajectory tests, and their references' optimizer."""
    return torch.optim.AdamW(groups, lr=ADAMW_LR, weight_decay=ADAMW_WD)


def no_decay_on_norms_and_biases(name, param):
    """The engine's ``param_groups`` rule of :func:`decay_groups`: no weight decay below 2-D."""
    return {"weight_decay": 0.0} if param.dim() < 2 else {}


def decay_groups(params, weight_decay: float | None = None) -> list[dict]:
    """nanoGPT's decay / no-decay split of ``params`` (a module's parameters, or a list), as torch
    param groups: matrices and embeddings decay (at ``weight_decay``, else at the optimizer's own),
    biases and norms do not."""
    params = list(params.parameters() if isinstance(params, nn.Module) else params)
    decay = {"params": [p for p in params if p.dim() >= 2]}
    if weight_decay is not None:
        decay["weight_decay"] = weight_decay
    return [decay, {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class Boom(Exception):
    """Raised inside backward by a tensor hook (anomaly mode, a caught OOM)."""


class LARS(torch.optim.SGD):
    """SGD scaled by a per-tensor trust ratio: per-tensor, not elementwise (refused unless declared)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + 1e-9))
        return super().step(closure)


#: make fuzz's second line sets ZERODP_ALL_WORLDS=1: the suites' 3- and 4-rank groups and other
#: volume that make test leaves to it (the Makefile lists what)
ALL_WORLDS = bool(os.environ.get("ZERODP_ALL_WORLDS"))


def in_make_fuzz(what: str):
    """Skip mark of a long end-to-end run that ``make fuzz`` runs and ``make test`` leaves to it
    (its smaller checks stay in ``make test``): ``what`` says which check covers it there."""
    import pytest

    return pytest.mark.skipif(not ALL_WORLDS, reason=f"make fuzz (ZERODP_ALL_WORLDS=1) runs it; make test: {what}")


# ---- tolerances from the dtype and the magnitude ------------------------------------------------
# Two correct implementations of data parallelism compute the same per-rank values and differ in
# the order in which they sum the n terms of a gradient (ranks, micro-batches, batch rows): a sum
# of n terms in another order differs by at most about n·ε of the terms' magnitude, ε being the
# dtype's machine epsilon. Errors are measured relative to the reference's largest element
# (max_rel) or its norm (norm_rel), i.e. atol = rtol × magnitude in assert_close's terms.
def sum_tolerance(n_terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound 2·n·ε on a sum of ``n_terms`` values taken in another order."""
    return 2 * n_terms * torch.finfo(dtype).eps


def trajectory_tolerance(n_terms: int, steps: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound after ``steps`` optimizer steps, each of whose gradients carries
    ``sum_tolerance(n_terms)``: the per-step errors add up (at most) linearly."""
    return steps * sum_tolerance(n_terms, dtype)


class Counting(torch.optim.Optimizer):
    """An optimizer of the script's own (not torch's class): SGD's update, and a step count per
    param group, as LAMB's bias correction or a warm-up keeps — which must advance once per step."""

    def __init__(self, params, lr: float = 0.05, count: int = 0):
        super().__init__(params, dict(lr=lr, count=count))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD whose step clips by the global gradient norm over every parameter it holds (LAMB's
    ``max_grad_norm``, timm's default): the update of one tensor reads every other's gradient, so
    zerodp runs it at stage 0 only (refused at stages 1-3)."""

    def __init__(self, params, lr: float = 0.1, max_norm: float = 0.05):
        super().__init__(params, dict(lr=lr, max_norm=max_norm))

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        for group in self.param_groups:
            coef = min(1.0, group["max_norm"] / (total + 1e-6))
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * coef)


def same_state(a, b) -> bool:
    """Nested state dicts (tensors, numbers, lists) bitwise equal."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def run_checks(rank: int, checks, stages=(0, 1, 2, 3), runs=None) -> dict:
    """Each ``check(rank, stage)`` at each stage (where ``runs(check, stage)``, if given), with
    deterministic algorithms: {(check's name, stage): what it returned (None: as the reference), or
    what it raised, in words} — a check that raises is reported and the group goes on."""
    torch.use_deterministic_algorithms(True)
    out = {}
    for stage in stages:
        for check in checks:
            if runs is not None and not runs(check, stage):
                continue
            try:
                out[(check.__name__, stage)] = check(rank, stage)
            except Exception as e:  # noqa: BLE001 - reported per check, the group goes on
                out[(check.__name__, stage)] = f"raised {type(e).__name__}: {e}"
    return out


# ---- groups of ranks, spawned once ---------------------------------------------------------------
# A spawned group costs seconds, so a test file runs its checks in one group and its tests read the
# results. spawn_once is the one way a test starts ranks: the group runs at the first call (in a
# test, a module fixture or a helper) and every later call with the same arguments, in the same
# test process, gets the same results — or the same error, without running again (a hang costs its
# timeout once, and every test that reads the group fails with the group's words).
_DONE: dict = {}
_SCRATCH: list = []  # the TemporaryDirectory holding spawn_once's folders, removed at exit


def once(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, called once per test process for the same arguments (compared by
    their pickled bytes): its value, or the error it raised, for every caller."""
    key = (fn.__module__, fn.__qualname__, pickle.dumps((args, sorted(kwargs.items()))))
    if key not in _DONE:
        try:
            _DONE[key] = (True, fn(*args, **kwargs))
        except Exception as e:
            _DONE[key] = (False, (e, e.__traceback__))
            raise
    ok, value = _DONE[key]
    if not ok:
        error, traceback = value
        raise error.with_traceback(traceback)
    return value


def _spawn(fn, world: int, args: tuple, folder: bool, options: dict) -> list:
    from zerodp.spawn import run_local

    if folder:
        if not _SCRATCH:
            _SCRATCH.append(tempfile.TemporaryDirectory(prefix="zerodp-tests-"))
        args = (tempfile.mkdtemp(dir=_SCRATCH[0].name), *args)
    return run_local(fn, world, *args, **options)


def spawn_once(fn, world: int, *args, folder: bool = False, **options) -> list:
    """``fn(rank, world, *args)`` on ``world`` fresh gloo ranks (:func:`zerodp.spawn.run_local`
    with ``options``: ``timeout``, ``grace``, ``env``, ``backend``), once per test process for the
    same ``fn``, ``world``, ``args`` and ``options``: the results by rank. ``folder=True`` passes a
    new empty folder, shared by the ranks and kept until the test process ends, as the first of
    ``args`` (``fn(rank, world, folder, *args)``); it is made only when the group runs."""
    return once(_spawn, fn, world, args, folder, options)
