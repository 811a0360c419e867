"""The differential test matrix of the engine: stage × world size × model features × usage.

Every case trains a small model a few steps with ``zerodp.parallelize`` on W ranks and, in the
same rank process, an independent single-process reference: a plain ``torch.nn.Module`` with a
stock ``torch.optim.SGD`` (momentum, weight decay, optionally two param groups), whose loss is
the mean over the W ranks' per-shard losses (what data parallelism computes, guide §2.2) — so
rank-dependent control flow (a parameter used on one rank only) has a reference too. Gradients
are compared before every step, parameters and buffers at the end.

Tolerances follow from the dtype and the magnitude (``torch.testing.assert_close`` semantics):
each rank's forward and backward run on the same shapes in both, so they agree bitwise; what
differs is the order in which the W ranks' and the M micro-batches' gradients are summed (and,
in bf16, where that sum is rounded). A sum of n terms in another order differs by at most about
n·ε of the terms' magnitude (ε = ``torch.finfo(dtype).eps``), so gradients must agree within
rtol = 2·n·ε and atol = rtol × the largest reference gradient of the step (the magnitude that
cancellation can leave behind), n counting every term summed since the first step: the rounding
of earlier steps is in the parameters the later gradients are taken at. SGD turns a gradient error
into a parameter error of at most lr × (number of steps) per step (momentum 0.9 adds at most one
step's worth per earlier step), which bounds the parameters.

A case prints as one line (``str(case)``); ``python tests/_matrix.py "<that line>"`` reruns it
alone, and ``Case.parse`` reads it back.

Device: CPU ranks on gloo by default. ``ZERODP_MATRIX_DEVICE=cuda`` (or ``run_cases(..., device="cuda")``)
puts rank r's engine *and* its reference on ``cuda:r`` under NCCL — the reference on the same device,
so that the forward and backward still agree bitwise and the tolerances above keep their meaning;
``python -m zerodp.bench.gpu_check`` runs it so (guide §13).
"""

from __future__ import annotations

import copy
import itertools
import os
import random
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 3, 4)
FEATURES = ("tied", "frozen", "buffer", "unused", "groups", "twice", "reduce_once")
#: flat: one shard group of every rank; hybrid (guide §14): shard groups of 2 ranks at world 4
#: (2 × 2), of 1 rank at worlds 2-3 (every rank a replica: ReduceScatter over 1, AllReduce across)
MESHES = ("flat", "hybrid")
USAGES = ("no_sync", "multi_backward", "two_forwards", "nograd_forward", "clip", "bf16", "reshard")
ROWS = 12  # global batch rows per micro-batch: divisible by every world size 1-4
STEPS = 3
LR = 0.1
CLIP = 0.05
DEVICE_ENV = "ZERODP_MATRIX_DEVICE"  # "cpu" (default, gloo) or "cuda" (NCCL, one GPU per rank)


def matrix_device(rank: int, device: str | None = None) -> torch.device:
    """Where rank ``rank`` runs its cases: ``device`` or ``$ZERODP_MATRIX_DEVICE``, default CPU."""
    kind = (device or os.environ.get(DEVICE_ENV) or "cpu").lower()
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={kind!r}: use cpu or cuda")
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def matrix_backend(device: str | None = None) -> str:
    """The process-group backend for the matrix's device: gloo on CPU, NCCL on CUDA."""
    return "nccl" if matrix_device(0, device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class Case:
    stage: int
    world: int
    usage: str
    features: frozenset = field(default_factory=frozenset)
    mesh: str = "flat"

    def __str__(self) -> str:
        feats = ",".join(sorted(self.features)) or "-"
        return f"stage={self.stage} world={self.world} mesh={self.mesh} usage={self.usage} features={feats}"

    @classmethod
    def parse(cls, text: str) -> "Case":
        kv = dict(part.split("=", 1) for part in text.split())
        feats = frozenset() if kv["features"] == "-" else frozenset(kv["features"].split(","))
        unknown = feats - set(FEATURES)
        mesh = kv.get("mesh", "flat")
        if unknown or kv["usage"] not in USAGES or mesh not in MESHES:
            raise ValueError(f"unknown features {sorted(unknown)}, usage {kv['usage']!r} or mesh {mesh!r}")
        return cls(int(kv["stage"]), int(kv["world"]), kv["usage"], feats, mesh)

    # Resharding: saved at (world, stage), loaded at another world size and stage.
    @property
    def load_world(self) -> int:
        return self.world % 4 + 1

    @property
    def load_stage(self) -> int:
        return (self.stage + 3) % 4

    @property
    def ranks_needed(self) -> int:
        return max(self.world, self.load_world) if self.usage == "reshard" else self.world


# ---- which cases ---------------------------------------------------------------------------
def _columns() -> list[tuple[str, tuple]]:
    return ([("stage", STAGES), ("world", WORLDS), ("usage", USAGES), ("mesh", MESHES)]
            + [(f, (False, True)) for f in FEATURES])


def _as_case(row: dict) -> Case:
    return Case(row["stage"], row["world"], row["usage"], frozenset(f for f in FEATURES if row[f]), row["mesh"])


def shard_size(mesh: str, world: int, whole_job: bool = True) -> int:
    """Ranks per shard group of a case's mesh (see :data:`MESHES`). Hybrid sharding needs the
    engine on every rank of the job: a phase on a subgroup (resharding) runs flat."""
    return world if mesh == "flat" or not whole_job else (2 if world == 4 else 1)


def pairwise_cases(seed: int = 0, candidates: int = 60) -> list[Case]:
    """A covering array of strength 2: every value of every dimension meets every value of every
    other dimension in at least one case (greedy, seeded: the same list on every machine)."""
    rng = random.Random(seed)
    cols = _columns()
    uncovered = {(i, a, j, b) for (i, (_, va)), (j, (_, vb)) in itertools.combinations(enumerate(cols), 2)
                 for a in va for b in vb}
    rows = []
    while uncovered:
        best, best_new = None, -1
        target = next(iter(sorted(uncovered, key=repr)))  # always cover at least this pair
        for _ in range(candidates):
            row = [rng.choice(v) for _, v in cols]
            row[target[0]], row[target[2]] = target[1], target[3]
            new = sum((i, row[i], j, row[j]) in uncovered for i, j in itertools.combinations(range(len(cols)), 2))
            if new > best_new:
                best, best_new = row, new
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(cols)), 2)}
        rows.append(best)
    return sorted({_as_case({name: v for (name, _), v in zip(cols, r)}) for r in rows}, key=str)


def random_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [_as_case({name: rng.choice(v) for name, v in _columns()}) for _ in range(n)]


# ---- the model ----------------------------------------------------------------------------
class Block(nn.Module):
    """LayerNorm first (frozen in the "frozen" feature: a unit whose first parameter is frozen)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class Stats(nn.Module):
    """BatchNorm-style buffers: ``ema`` tracks the mean input in training (rank-dependent),
    ``mix`` is a constant float buffer used in a matmul (its dtype must follow the params')."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("ema", torch.zeros(d))
        self.register_buffer("mix", torch.eye(d) * 0.5 + 0.05)
        self.track = True

    def forward(self, x):
        if self.training and self.track:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return F.linear(x, self.mix)


class MatrixModel(nn.Module):
    """Parameter sizes 35, 7, 7, 7, 49, 7 (…) and 21, 3: not divisible by 2, 3 or 4."""

    def __init__(self, features: frozenset):
        super().__init__()
        self.features = features
        self.embed = nn.Linear(5, 7)
        self.stats = Stats(5) if "buffer" in features else None
        self.blocks = nn.ModuleList([Block(7), Block(7)])
        self.mix_a = nn.Linear(7, 7, bias=False)
        self.mix_b = nn.Linear(7, 7, bias=False)
        if "tied" in features:
            self.mix_b.weight = self.mix_a.weight
        self.spare = nn.Linear(7, 7) if "unused" in features else None
        self.head = nn.Linear(7, 3)
        if "frozen" in features:
            for b in self.blocks:
                b.norm.weight.requires_grad_(False)

    def forward(self, x, y, use_spare: bool = False):
        x = x.to(self.embed.weight.dtype)
        if self.stats is not None:
            x = self.stats(x)
        h = torch.tanh(self.embed(x))
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        if "twice" in self.features:
            h = self.blocks[1](h)
        h = self.mix_b(torch.tanh(self.mix_a(h)))
        if self.spare is not None and use_spare:
            h = h + self.spare(h)
        return F.mse_loss(self.head(h).float(), y)


def use_spare(step: int, rank: int) -> bool:
    """``spare`` is used on rank 0 only in step 1, and by no rank in the other steps."""
    return step == 1 and rank == 0


def param_groups(name, p):
    return {"weight_decay": 0.0, "lr": LR / 2} if p.ndim < 2 else {}


def make_optimizer(groups):
    return torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=0.1)


def batch(step: int, micro: int):
    g = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


# ---- one step's plan, shared by the engine and the reference -------------------------------
def micro_plan(usage: str) -> list[tuple[int, bool]]:
    """(micro-batch index, synchronizing?) per backward of a step."""
    if usage == "no_sync":
        return [(0, False), (1, False), (2, True)]
    if usage == "multi_backward":
        return [(0, True), (1, True)]
    if usage == "bf16":
        return [(0, False), (1, True)]
    return [(0, True)]


def tolerance(dtype: torch.dtype, n_terms: int) -> float:
    """rtol for a sum of ``n_terms`` terms taken in another order (see the module docstring)."""
    return 2 * n_terms * torch.finfo(dtype).eps


# ---- the reference -------------------------------------------------------------------------
class Reference:
    """Single process: fp32 master parameters, compute in ``dtype`` (a bf16 copy under bf16)."""

    def __init__(self, model: MatrixModel, dtype: torch.dtype, groups: bool):
        self.master = model
        model.stats is not None and setattr(model.stats, "track", False)
        self.dtype = dtype
        self.compute = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        params = list(model.named_parameters())
        trainable = [(n, p) for n, p in params if p.requires_grad]
        if groups:
            spec = [{"params": [p for n, p in trainable if p.ndim >= 2]},
                    {"params": [p for n, p in trainable if p.ndim < 2], **param_groups("", torch.zeros(1))}]
        else:
            spec = [{"params": [p for _, p in trainable]}]
        self.opt = make_optimizer(spec)

    def sync_compute(self):
        if self.compute is not self.master:
            with torch.no_grad():
                for pc, pm in zip(self.compute.parameters(), self.master.parameters()):
                    pc.copy_(pm)

    def loss(self, x, y, step, world, scale):
        total = 0.0
        for r in range(world):
            total = total + self.compute(shard(x, r, world), shard(y, r, world), use_spare(step, r))
        return total * (scale / world)

    def grads_to_master(self):
        if self.compute is not self.master:
            for pc, pm in zip(self.compute.parameters(), self.master.parameters()):
                pm.grad = None if pc.grad is None else pc.grad.float()
                pc.grad = None

    def grad_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.master.named_parameters() if p.requires_grad}


# ---- running a case on one rank --------------------------------------------------------------
def _build(case: Case, seed: int, stage: int, group, device: torch.device, world: int):
    import zerodp

    torch.manual_seed(seed)  # the reference is built from the same seed: the same values
    model = MatrixModel(case.features).to(device)
    # stages 0-2 tolerate a parameter without gradient only when told (as DDP)
    options = dict(find_unused_parameters=True) if stage < 3 and "unused" in case.features else {}
    if "groups" in case.features:
        options["param_groups"] = param_groups
    if "reduce_once" in case.features and stage >= 2:
        options["reduce_every_microbatch"] = False
    engine = zerodp.parallelize(model, optimizer=make_optimizer, stage=stage,
                                mixed_precision="bf16" if case.usage == "bf16" else None,
                                units=list(model.blocks) if stage == 3 else None,
                                bucket_mb=0.0002, first_bucket_mb=0.0001, group=group,
                                shard_size=shard_size(case.mesh, world, group is None), **options)
    return engine


def _gather_state(engine, members: list[int]):
    """Every rank's checkpoint pieces and scalars, assembled into full flat tensors."""
    pieces = [] if engine is None else [(p.name, p.kind, p.start, p.stop, p.shape, p.tensor.detach().cpu().clone())
                                        for p in engine.state_pieces()]
    scalars = None if engine is None else engine.scalar_state()
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (pieces, scalars))
    full: dict = {}
    for rank_pieces, _ in everything:
        for name, kind, start, stop, shape, t in rank_pieces:
            numel = 1
            for s in shape:
                numel *= s
            fill = float("nan") if t.is_floating_point() else 0  # NaN marks what no rank saved
            buf = full.setdefault((name, kind), torch.full((numel,), fill, dtype=t.dtype))
            buf[start:stop] = t
    return full, everything[members[0]][1]


def run_case(case: Case, rank: int, device: str | None = None) -> None:
    """Run ``case`` on this rank (every rank of the default group calls it); raise on mismatch.
    ``device``: see :func:`matrix_device`."""
    dev = matrix_device(rank, device)

    def batch_on(step: int, micro: int):  # the same values on every device
        x, y = batch(step, micro)
        return x.to(dev), y.to(dev)

    dtype = torch.bfloat16 if case.usage == "bf16" else torch.float32
    phases = [(case.world, case.stage, range(STEPS))]
    if case.usage == "reshard":
        phases = [(case.world, case.stage, range(2)), (case.load_world, case.load_stage, range(2, STEPS + 1))]
    world_all = dist.get_world_size()
    groups = {w: dist.new_group(list(range(w))) if w < world_all else None for w, _, _ in phases}

    torch.manual_seed(123)
    ref = Reference(MatrixModel(case.features).to(dev), dtype, "groups" in case.features)
    ema_inputs: list[torch.Tensor] = []
    engine = None
    plan = micro_plan(case.usage)
    grad_scale = 0.0  # the largest reference gradient of the run
    terms_so_far = 0  # gradient terms summed since the start (rounding that reached the parameters)
    for phase, (world, stage, steps) in enumerate(phases):
        member = rank < world
        if phase == 0:
            engine = _build(case, 123, stage, groups[world], dev, world) if member else None
        else:
            full, scalars = _gather_state(engine, list(range(phases[0][0])))
            engine = None
            if member:
                engine = _build(case, 999, stage, groups[world], dev, world)  # other values: loading must win
                engine.load_scalar_state(scalars)
                engine.load_state_pieces(lambda n, k, a, b: full[(n, k)][a:b].to(dev))
        for step in steps:
            ref.sync_compute()
            for micro, sync in plan:
                x, y = batch_on(step, micro)
                scale = 1.0 / len(plan)
                xs, ys = shard(x, rank, world), shard(y, rank, world)
                if member:
                    ctx = engine.no_sync() if not sync else _nullcontext()
                    with ctx:
                        if case.usage == "two_forwards":
                            x2, y2 = batch_on(step, micro + 5)
                            spare = use_spare(step, rank)
                            loss = (engine(xs, ys, spare)
                                    + engine(shard(x2, rank, world), shard(y2, rank, world), spare)) * 0.5
                        else:
                            loss = engine(xs, ys, use_spare(step, rank)) * scale
                        if case.usage == "nograd_forward":
                            with torch.no_grad():
                                x3, y3 = batch_on(step, micro + 7)
                                engine(shard(x3, rank, world), shard(y3, rank, world))
                        loss.backward()
                ema_inputs.append(shard(x, 0, world))
                if case.usage == "two_forwards":
                    x2, y2 = batch_on(step, micro + 5)
                    ema_inputs.append(shard(x2, 0, world))
                    (ref.loss(x, y, step, world, 0.5) + ref.loss(x2, y2, step, world, 0.5)).backward()
                else:
                    ref.loss(x, y, step, world, scale).backward()
                if case.usage == "nograd_forward":
                    ema_inputs.append(shard(batch_on(step, micro + 7)[0], 0, world))
            ref.grads_to_master()
            grad_scale = max([grad_scale] + [g.abs().max().item() for g in ref.grad_dict().values() if g is not None])
            # This step's gradients sum world × micro-batches terms in another order; the
            # parameters they are taken at already carry the rounding of the earlier steps, which
            # reaches the gradients about one for one: the bound counts every term summed so far.
            n_terms = world * len(plan) * (2 if case.usage == "two_forwards" else 1)
            terms_so_far += n_terms
            if case.usage == "clip":
                with_grad = [p for p in ref.master.parameters() if p.grad is not None]
                ref_norm = torch.nn.utils.clip_grad_norm_(with_grad, CLIP)
                if member:
                    norm = engine.clip_grad_norm_(CLIP)
                    torch.testing.assert_close(norm.float(), ref_norm.float(), rtol=tolerance(dtype, terms_so_far),
                                               atol=0.0, msg=lambda m: f"[{case}] step {step}: gradient norm: {m}")
            if member:
                _compare_grads(case, step, engine.full_grad_dict(), ref.grad_dict(), dtype, terms_so_far)
                engine.step()
                engine.zero_grad()
            ref.opt.step()
            ref.opt.zero_grad(set_to_none=True)
    if engine is not None:
        _compare_final(case, engine, ref, ema_inputs, dtype, grad_scale)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _compare_grads(case, step, got: dict, want: dict, dtype, n_terms) -> None:
    rtol = tolerance(dtype, n_terms)
    scale = max((g.abs().max().item() for g in want.values() if g is not None), default=1.0)
    for name, g in want.items():
        expected = torch.zeros_like(got[name]).cpu() if g is None else g.float().cpu()
        torch.testing.assert_close(got[name].float().cpu(), expected, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"[{case}] step {step}: gradient of {name}: {m}")


def _compare_final(case, engine, ref: Reference, ema_inputs, dtype, grad_scale: float) -> None:
    state = engine.full_state_dict()
    steps = STEPS + (1 if case.usage == "reshard" else 0)
    n_terms = 4 * 3 * 2  # the most terms any usage sums (world 4, 3 micro-batches, 2 forwards)
    grad_rtol = tolerance(dtype, n_terms)
    for name, p in ref.master.named_parameters():
        # |Δθ| ≤ Σ_steps lr · (momentum-accumulated gradient error) ≤ lr · steps² · atol_grad, with
        # atol_grad relative to the largest reference gradient of the run.
        atol = LR * steps * steps * grad_rtol * grad_scale + 4 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(state[name].float().cpu(), p.detach().float().cpu(), rtol=grad_rtol, atol=atol,
                                   msg=lambda m, name=name: f"[{case}] final parameter {name}: {m}")
    if "buffer" in case.features:
        ema = torch.zeros(5, dtype=torch.float64)
        for x in ema_inputs:
            ema = ema * 0.9 + 0.1 * x.double().mean(0).cpu()
        tol = 4 * len(ema_inputs) * torch.finfo(dtype).eps  # one rounding per update, in the buffer's dtype
        torch.testing.assert_close(state["stats.ema"].double().cpu(), ema, rtol=tol, atol=tol,
                                   msg=lambda m: f"[{case}] buffer stats.ema (rank 0's, broadcast): {m}")
        torch.testing.assert_close(state["stats.mix"].float().cpu(), (torch.eye(5) * 0.5 + 0.05).to(dtype).float(),
                                   msg=lambda m: f"[{case}] buffer stats.mix: {m}")


# ---- a group of cases on one spawned process group -----------------------------------------------
def run_cases(rank: int, world: int, cases: list[Case], device: str | None = None) -> list[tuple[str, str | None]]:
    """Run every case (all needing at most ``world`` ranks) on this rank; return (case, error).
    On CUDA (:func:`matrix_device`) this rank uses ``cuda:rank``, made current before any collective."""
    import traceback

    if matrix_device(rank, device).type == "cuda":
        torch.cuda.set_device(rank)
    out = []
    for case in cases:
        try:
            run_case(case, rank, device)
            out.append((str(case), None))
        except Exception as e:  # noqa: BLE001 - reported with the case, which can be rerun alone
            out.append((str(case), f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        dist.barrier()
    return out


if __name__ == "__main__":
    from zerodp.spawn import run_local

    one = Case.parse(" ".join(sys.argv[1:]))
    results = run_local(run_cases, one.ranks_needed, [one], timeout=300, backend=matrix_backend())
    errors = {err for rank_results in results for _, err in rank_results if err}
    print(f"{one}: " + ("ok" if not errors else "FAILED\n" + "\n".join(sorted(errors))))
    sys.exit(1 if errors else 0)
