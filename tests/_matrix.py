"""The differential test matrix of the engine: stage × world size × model features × usage.

Every case trains a small model a few steps with ``zerodp.parallelize`` on W ranks and, in the
same rank process, an independent single-process reference: a plain ``torch.nn.Module`` with the
case's stock optimizer (``torch.optim.SGD`` with momentum and weight decay, ``Adafactor``, ``Muon``
for the matrices with ``AdamW`` for the rest, or a custom per-tensor optimizer; optionally two param
groups), whose loss is the mean over the W ranks' per-shard losses (what data parallelism computes,
guide §2.2) — so rank-dependent control flow (a parameter used on one rank only) has a reference
too. Gradients are compared before every step, parameters and buffers at the end.

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

The per-tensor optimizers have no such bound: Adafactor and AdamW divide by a root mean square of
past gradients (an element whose gradient is near zero turns the gradient's rounding into an
update of order lr), and Muon orthogonalizes the update in bf16 (a rounding of the gradient may
move the result by a bf16 unit). Their cases therefore check each step in two parts: the
gradients against the reference's own, as above; then the reference steps on the engine's checked
gradients, so that the stock optimizer and the engine's ownership path (guide §12.3) start each
step from the same point. Given the same gradients, state and parameters, the stock optimizer
repeats the same arithmetic on the same tensors; what may differ is how its kernels group
tensors, at most one float32 rounding of each element per step, which the update carries forward
(weight decay only shrinks it): after k steps the parameters agree within rtol = atol/max|θ| =
2·k·ε(float32) (:func:`fed_tolerance`). The optimizer's state is compared too, in torch's own
format (``engine.optimizer.state_dict()``), within the same bound relative to each state's
largest element.

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

# The differential core is the package's, shared with ``zerodp check`` (src/zerodp/check/core.py):
# the tolerances' formulas, the elementwise bound, the checkpoint gather and the reference of a list
# of optimizers (Stepped: stock torch optimizers stepped one after the other; the engine imports
# nothing from zerodp.check, so the reference stays independent of it). The cases, the model and
# the derivation of each bound stay here.
from zerodp.check.core import assert_within as _assert_within
from zerodp.check.core import Stepped, fed_tolerance, tolerance
from zerodp.check.core import gather_state as _core_gather_state

from _engine_common import LARS, regression_batch

STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 3, 4)
#: "owner": the same SGD declared per-tensor (``optimizer_layout="owner"``), so stages 1-3 take the
#: tensor-ownership path of guide §12.3 (each tensor whole on one rank, owner-aligned layouts)
FEATURES = ("tied", "frozen", "buffer", "unused", "groups", "twice", "reduce_once", "owner")
#: flat: one shard group of every rank; hybrid (guide §14): shard groups of 2 ranks at world 4
#: (2 × 2), of 1 rank at worlds 2-3 (every rank a replica: ReduceScatter over 1, AllReduce across)
MESHES = ("flat", "hybrid")
USAGES = ("no_sync", "multi_backward", "two_forwards", "nograd_forward", "clip", "bf16", "reshard")
#: compressed collectives (guide §15): none; ``reduce_dtype="bf16"`` (every stage); int8 (ZeRO++
#: qwZ + qgZ together, stages 1-3 — a case drawn at stage 0 has no such combination)
COMPRESS = ("none", "bf16", "int8")
#: the case's optimizer: "sgd" (elementwise: flat shards, or whole tensors with the "owner"
#: feature); "adafactor" and "muon_adamw" (stock per-tensor optimizers: Adafactor, and Muon for the
#: 2-D weights with AdamW for the rest, the way Muon is used: the tensor-ownership path of guide
#: §12.3 at stages 1-3); "lars" (a custom per-tensor optimizer, declared ``optimizer_layout="owner"``)
OPTIMIZERS = ("sgd", "adafactor", "muon_adamw", "lars")
QUANT_BLOCK = 16  # elements per int8 scale: several blocks, and partial ones, in the tiny model's shards
U_BF16 = 2.0 ** -8  # unit roundoff of bf16
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
    compress: str = "none"
    optimizer: str = "sgd"

    def __str__(self) -> str:
        feats = ",".join(sorted(self.features)) or "-"
        return (f"stage={self.stage} world={self.world} mesh={self.mesh} compress={self.compress} "
                f"optimizer={self.optimizer} usage={self.usage} features={feats}")

    @classmethod
    def parse(cls, text: str) -> "Case":
        kv = dict(part.split("=", 1) for part in text.split())
        feats = frozenset() if kv["features"] == "-" else frozenset(kv["features"].split(","))
        unknown = feats - set(FEATURES)
        mesh, compress = kv.get("mesh", "flat"), kv.get("compress", "none")
        optimizer = kv.get("optimizer", "sgd")
        if (unknown or kv["usage"] not in USAGES or mesh not in MESHES or compress not in COMPRESS
                or optimizer not in OPTIMIZERS):
            raise ValueError(f"unknown features {sorted(unknown)}, usage {kv['usage']!r}, mesh {mesh!r}, "
                             f"compress {compress!r} or optimizer {optimizer!r}")
        case = cls(int(kv["stage"]), int(kv["world"]), kv["usage"], feats, mesh, compress, optimizer)
        if not valid(case.stage, case.compress):
            raise ValueError(f"{case}: int8 compresses the AllGather and ReduceScatter of stages 1-3 only")
        return case

    def quantized(self, stage: int) -> bool:
        """Whether the phase at ``stage`` runs int8 collectives (stage 0 has none to quantize)."""
        return self.compress == "int8" and stage >= 1

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
def valid(stage: int, compress: str) -> bool:
    """The one combination of values that does not exist: int8 collectives at stage 0."""
    return not (stage == 0 and compress == "int8")


def _columns() -> list[tuple[str, tuple]]:
    return ([("stage", STAGES), ("world", WORLDS), ("usage", USAGES), ("mesh", MESHES), ("compress", COMPRESS),
             ("optimizer", OPTIMIZERS)] + [(f, (False, True)) for f in FEATURES])


def _as_case(row: dict) -> Case:
    return Case(row["stage"], row["world"], row["usage"], frozenset(f for f in FEATURES if row[f]), row["mesh"],
                row["compress"], row["optimizer"])


def _repair(row: list, cols, rng: random.Random, keep: tuple[int, ...] = ()) -> list:
    """Make a drawn row valid (:func:`valid`), changing a column not in ``keep``."""
    s, c = [i for i, (name, _) in enumerate(cols) if name in ("stage", "compress")]
    if valid(row[s], row[c]):
        return row
    if c not in keep:
        row[c] = rng.choice([v for v in COMPRESS if valid(row[s], v)])
    else:
        row[s] = rng.choice([v for v in STAGES if valid(v, row[c])])
    return row


def shard_size(mesh: str, world: int, whole_job: bool = True) -> int:
    """Ranks per shard group of a case's mesh (see :data:`MESHES`). Hybrid sharding needs the
    engine on every rank of the job: a phase on a subgroup (resharding) runs flat."""
    return world if mesh == "flat" or not whole_job else (2 if world == 4 else 1)


def pairwise_cases(seed: int = 0, candidates: int = 60) -> list[Case]:
    """A covering array of strength 2: every value of every dimension meets every value of every
    other dimension in at least one case (greedy, seeded: the same list on every machine)."""
    rng = random.Random(seed)
    cols = _columns()
    names = [name for name, _ in cols]

    def possible(i, a, j, b) -> bool:
        row = {names[i]: a, names[j]: b}
        return valid(row.get("stage", 1), row.get("compress", "none"))
    uncovered = {(i, a, j, b) for (i, (_, va)), (j, (_, vb)) in itertools.combinations(enumerate(cols), 2)
                 for a in va for b in vb if possible(i, a, j, b)}
    rows = []
    while uncovered:
        best, best_new = None, -1
        target = next(iter(sorted(uncovered, key=repr)))  # always cover at least this pair
        for _ in range(candidates):
            row = [rng.choice(v) for _, v in cols]
            row[target[0]], row[target[2]] = target[1], target[3]
            row = _repair(row, cols, rng, keep=(target[0], target[2]))
            new = sum((i, row[i], j, row[j]) in uncovered for i, j in itertools.combinations(range(len(cols)), 2))
            if new > best_new:
                best, best_new = row, new
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(cols)), 2)}
        rows.append(best)
    return sorted({_as_case({name: v for (name, _), v in zip(cols, r)}) for r in rows}, key=str)


def random_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cols = _columns()
    return [_as_case(dict(zip([name for name, _ in cols], _repair([rng.choice(v) for _, v in cols], cols, rng))))
            for _ in range(n)]


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
        out = self.head(h).float()
        # both operands in one dtype: mixed_precision casts the target y to bf16 with the input, and before
        # torch 2.12 mse_loss's backward rejects a target whose dtype differs (zerodp.compat)
        return F.mse_loss(out, y.to(out.dtype))


def use_spare(step: int, rank: int) -> bool:
    """``spare`` is used on rank 0 only in step 1, and by no rank in the other steps."""
    return step == 1 and rank == 0


def param_groups(name, p):
    return {"weight_decay": 0.0, "lr": LR / 2} if p.ndim < 2 else {}


def make_optimizer(groups):
    return torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=0.1)


def _adafactor(groups):
    return torch.optim.Adafactor(groups, lr=0.02, weight_decay=0.01)


def _lars(groups):
    return LARS(groups, lr=0.05, momentum=0.9)


def _muon_adamw(model: nn.Module, groups: bool) -> list[torch.optim.Optimizer]:
    """Built by the script over the model, as Muon is used: Muon for the trainable 2-D weights,
    AdamW for the rest (with the "groups" feature, AdamW's vectors take :func:`param_groups`'s
    options, as the other optimizers' do)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    rest = {"params": [p for p in trainable if p.ndim != 2]}
    if groups:
        rest.update(param_groups("", torch.zeros(1)))
    return [torch.optim.Muon([p for p in trainable if p.ndim == 2], lr=0.05, weight_decay=0.01),
            torch.optim.AdamW([rest], lr=0.02, eps=1e-3, weight_decay=0.01)]


#: factories of param groups (the engine calls them over its targets); "muon_adamw" is built
FACTORIES = {"sgd": make_optimizer, "adafactor": _adafactor, "lars": _lars}


def engine_optimizer(case: Case, model: nn.Module):
    """(what ``parallelize`` takes as ``optimizer``, its options) for the case's optimizer."""
    options: dict = {}
    if case.optimizer == "lars" or "owner" in case.features:
        options["optimizer_layout"] = "owner"
    if case.optimizer == "muon_adamw":
        return _muon_adamw(model, "groups" in case.features), options
    if "groups" in case.features:
        options["param_groups"] = param_groups
    return FACTORIES[case.optimizer], options


def per_tensor(case: Case) -> bool:
    """Whether the case's optimizer has no trajectory bound, so that the reference steps on the
    engine's checked gradients and the state is compared after them (the module docstring)."""
    return case.optimizer != "sgd"


def batch(step: int, micro: int):
    return regression_batch(10_000 + 100 * step + micro, ROWS)


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


# ---- the reference -------------------------------------------------------------------------
class Reference:
    """Single process: fp32 master parameters, compute in ``dtype`` (a bf16 copy under bf16, and
    a copy that forward's parameters can be loaded into under a quantized AllGather)."""

    def __init__(self, model: MatrixModel, dtype: torch.dtype, groups: bool, separate_compute: bool = False,
                 optimizer: str = "sgd"):
        self.master = model
        model.stats is not None and setattr(model.stats, "track", False)
        self.dtype = dtype
        self.compute = model if dtype == torch.float32 and not separate_compute else copy.deepcopy(model).to(dtype)
        params = list(model.named_parameters())
        trainable = [(n, p) for n, p in params if p.requires_grad]
        if groups:
            spec = [{"params": [p for n, p in trainable if p.ndim >= 2]},
                    {"params": [p for n, p in trainable if p.ndim < 2], **param_groups("", torch.zeros(1))}]
        else:
            spec = [{"params": [p for _, p in trainable]}]
        if optimizer == "muon_adamw":
            self.opt = Stepped(_muon_adamw(model, groups))
        else:
            self.opt = FACTORIES[optimizer](spec)

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

    def load_compute(self, values: dict[str, torch.Tensor]) -> None:
        """Forward computes with ``values`` (by name) instead of the master's."""
        with torch.no_grad():
            for name, p in self.compute.named_parameters():
                if name in values:
                    p.copy_(values[name])

    def local_grads(self, x, y, step, rank, world, scale) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s own gradient, ∂(scale · its loss)/∂θ, in float64 by name: what that
        rank's engine puts into its gradient reduction (its own micro-batch only)."""
        params = [(n, p) for n, p in self.compute.named_parameters() if p.requires_grad]
        loss = self.compute(shard(x, rank, world), shard(y, rank, world), use_spare(step, rank)) * scale
        grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
        return {n: torch.zeros(p.shape, dtype=torch.float64) if g is None else g.detach().double().cpu()
                for (n, p), g in zip(params, grads)}

    def feed(self, grads: dict[str, torch.Tensor]) -> None:
        """Take ``grads`` (checked against this reference's own) as the step's master gradients,
        where the reference has one: a compressed run's parameters then follow the engine's
        trajectory, and each later step is checked from the same point."""
        for name, p in self.master.named_parameters():
            if p.grad is not None:
                p.grad = grads[name].to(p.device, p.dtype).clone()

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
    optimizer, more = engine_optimizer(case, model)
    options.update(more)
    if "reduce_once" in case.features and stage >= 2:
        options["reduce_every_microbatch"] = False
    if case.compress == "bf16":
        options["reduce_dtype"] = "bf16"
    if case.quantized(stage):
        options.update(quantize_params=True, quantize_grads=True, quant_block=QUANT_BLOCK)
    engine = zerodp.parallelize(model, optimizer=optimizer, stage=stage,
                                mixed_precision="bf16" if case.usage == "bf16" else None,
                                units=list(model.blocks) if stage == 3 else None,
                                bucket_mb=0.0002, first_bucket_mb=0.0001, group=group,
                                shard_size=shard_size(case.mesh, world, group is None), **options)
    return engine


def _gather_state(engine, members: list[int]):
    """Every rank's checkpoint pieces and scalars, assembled into full flat tensors (rank
    ``members[0]``'s scalars): :func:`zerodp.check.core.gather_state`."""
    return _core_gather_state(engine, lead=members[0])


def run_case(case: Case, rank: int, device: str | None = None) -> None:
    """Run ``case`` on this rank (every rank of the default group calls it); raise on mismatch.
    ``device``: see :func:`matrix_device`.

    Compressed cases (guide §15) are checked step by step: the parameters forward used under a
    quantized AllGather against the reference's master within qwZ's bound, then loaded into the
    reference; the reduced gradients against the reference's exact mean within the order
    tolerance plus the option's bound (:func:`compression_bound`, from every rank's own gradient);
    then the reference takes the engine's checked gradients, so that the next step starts from
    the same parameters and the optimizer, the clipping and the final state are checked as in
    the uncompressed cases."""
    dev = matrix_device(rank, device)

    def batch_on(step: int, micro: int):  # the same values on every device
        x, y = batch(step, micro)
        return x.to(dev), y.to(dev)

    dtype = torch.bfloat16 if case.usage == "bf16" else torch.float32
    compressed = case.compress != "none"
    phases = [(case.world, case.stage, range(STEPS))]
    if case.usage == "reshard":
        phases = [(case.world, case.stage, range(2)), (case.load_world, case.load_stage, range(2, STEPS + 1))]
    world_all = dist.get_world_size()
    groups = {w: dist.new_group(list(range(w))) if w < world_all else None for w, _, _ in phases}

    torch.manual_seed(123)
    ref = Reference(MatrixModel(case.features).to(dev), dtype, "groups" in case.features,
                    separate_compute=case.compress == "int8", optimizer=case.optimizer)
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
                engine.checkpoint.load_scalar_state(scalars)
                engine.checkpoint.load_state_pieces(lambda n, k, a, b: full[(n, k)][a:b].to(dev))
        quantized = case.quantized(stage)
        used = _UsedParams(engine.module if member and quantized else None)
        layouts = _everyones(engine.layout() if member else None) if compressed else None
        for step in steps:
            ref.sync_compute()
            used.seen.clear()
            local: list[list[dict]] = []  # [backward][rank]: each rank's own gradient (compressed cases)
            for i, (micro, sync) in enumerate(plan):
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
                if quantized and i == 0:
                    _check_used_params(case, step, ref, _merged(used.seen), layouts, world, dtype,
                                       param_tol(dtype, steps.stop, grad_scale))
                ema_inputs.append(shard(x, 0, world))
                if case.usage == "two_forwards":
                    x2, y2 = batch_on(step, micro + 5)
                    ema_inputs.append(shard(x2, 0, world))
                    (ref.loss(x, y, step, world, 0.5) + ref.loss(x2, y2, step, world, 0.5)).backward()
                    if compressed:
                        local.append([_add(ref.local_grads(x, y, step, r, world, 0.5),
                                           ref.local_grads(x2, y2, step, r, world, 0.5)) for r in range(world)])
                else:
                    ref.loss(x, y, step, world, scale).backward()
                    if compressed:
                        local.append([ref.local_grads(x, y, step, r, world, scale) for r in range(world)])
                if case.usage == "nograd_forward":
                    ema_inputs.append(shard(batch_on(step, micro + 7)[0], 0, world))
            ref.grads_to_master()
            grad_scale = max([grad_scale] + [g.abs().max().item() for g in ref.grad_dict().values() if g is not None])
            # This step's gradients sum world × micro-batches terms in another order; the
            # parameters they are taken at already carry the rounding of the earlier steps, which
            # reaches the gradients about one for one: the bound counts every term summed so far.
            n_terms = world * len(plan) * (2 if case.usage == "two_forwards" else 1)
            terms_so_far += n_terms
            if compressed:
                bound = compression_bound(layouts, local, plan, world, quantized=quantized,
                                          wire_bf16=case.compress == "bf16")
                got = _everyones(engine.full_grad_dict() if member else None)
                _compare_grads(case, step, got, ref.grad_dict(), dtype, terms_so_far, bound)
                ref.feed(got)
            if case.usage == "clip":
                with_grad = [p for p in ref.master.parameters() if p.grad is not None]
                ref_norm = torch.nn.utils.clip_grad_norm_(with_grad, CLIP)
                if member:
                    norm = engine.clip_grad_norm_(CLIP)
                    torch.testing.assert_close(norm.float(), ref_norm.float(), rtol=tolerance(dtype, terms_so_far),
                                               atol=0.0, msg=lambda m: f"[{case}] step {step}: gradient norm: {m}")
            if member and (not compressed or case.usage == "clip"):
                _compare_grads(case, step, engine.full_grad_dict(), ref.grad_dict(), dtype, terms_so_far)
            if per_tensor(case):  # checked: the stock optimizer now steps on the engine's gradients
                ref.feed(_everyones(engine.full_grad_dict() if member else None))
            if member:
                engine.step()
                engine.zero_grad()
            ref.opt.step()
            ref.opt.zero_grad(set_to_none=True)
        used.remove()
    if engine is not None:
        _compare_final(case, engine, ref, ema_inputs, dtype, grad_scale)


# ---- compressed cases: the bounds of guide §15 ------------------------------------------------
class _UsedParams:
    """The parameters forward computes with, by name, as each module with parameters runs (under
    a quantized AllGather they are the dequantized ones; at stage 3 only gathered while in use)."""

    def __init__(self, module: nn.Module | None):
        self.seen: dict[str, torch.Tensor] = {}
        self._handles = []
        for prefix, sub in ([] if module is None else module.named_modules()):
            if next(sub.parameters(recurse=False), None) is not None:
                self._handles.append(sub.register_forward_hook(self._hook(prefix)))

    def _hook(self, prefix: str):
        def record(sub, args, out):
            for name, p in sub.named_parameters(recurse=False):
                self.seen.setdefault(f"{prefix}.{name}" if prefix else name, p.detach().float().cpu().clone())
        return record

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _everyones(value):
    """Rank 0's ``value`` on every rank (rank 0 takes part in every phase): the ranks outside a
    smaller phase follow the same reference."""
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, value)
    return everything[0]


def _merged(seen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's used parameters in one dict (a parameter may run on one rank only); those two
    ranks both ran must agree bitwise — they gathered the same shards."""
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, seen)
    out: dict[str, torch.Tensor] = {}
    for r, theirs in enumerate(everything):
        for name, t in theirs.items():
            if name in out and not torch.equal(out[name], t):
                raise AssertionError(f"rank {r} computed with other values of {name} than a lower rank")
            out.setdefault(name, t)
    return out


def _add(a: dict, b: dict) -> dict:
    return {n: a[n] + b[n] for n in a}


def _to_flat(layout: dict, values: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = torch.zeros(layout["padded_numel"], dtype=torch.float64)
    for slot in layout["slots"]:
        if slot["name"] in values:
            v = values[slot["name"]].double().cpu().reshape(-1)
            flat[slot["offset"]:slot["offset"] + v.numel()] = v
    return flat


def _from_flat(layouts: list[dict], flats: list[torch.Tensor], names) -> dict[str, torch.Tensor]:
    out = {}
    for layout, flat in zip(layouts, flats):
        for slot in layout["slots"]:
            numel = 1
            for d in slot["shape"]:
                numel *= d
            out[slot["name"]] = flat[slot["offset"]:slot["offset"] + numel].reshape(slot["shape"])
    missing = set(names) - set(out)
    if missing:
        raise AssertionError(f"parameters in no flat group of engine.layout(): {sorted(missing)}")
    return out


def block_max(flat: torch.Tensor, chunk: int, block: int = QUANT_BLOCK) -> torch.Tensor:
    """Per element: the largest |value| in its block of ``block`` elements, blocks counted from
    the start of each rank's chunk of ``chunk`` (a shard: what one rank quantizes)."""
    ranks = flat.numel() // chunk
    blocks = -(-chunk // block)
    padded = torch.zeros(ranks, blocks * block, dtype=flat.dtype)
    padded[:, :chunk] = flat.abs().reshape(ranks, chunk)
    m = padded.reshape(ranks, blocks, block).amax(-1, keepdim=True).expand(ranks, blocks, block)
    return m.reshape(ranks, blocks * block)[:, :chunk].reshape(-1)


def compression_bound(layouts: list[dict], local: list[list[dict]], plan, world: int, *, quantized: bool,
                      wire_bf16: bool) -> dict[str, torch.Tensor]:
    """Per element, the most a step's compressed reductions may move the averaged gradient off the
    exact mean (guide §15), from every rank's own gradient of each backward (``local``):

    - int8 all-to-all (qgZ), per reduction: (1/N)·Σ_r m_r/254·(1 + 2^-15) + 2^-23·Σ_r m_r + 2^-147,
      m_r the block maximum of rank r's input;
    - gradients reduced in bf16, per reduction: (N + 1)·u·(1/N)·Σ_r |x_r| + u·|mean| ≤
      (N + 2)·u·(1/N)·Σ_r |x_r|, u = 2^-8, with (1 + (N + 2)·u) for the second-order terms.

    A reduction's input on rank r is bounded by what it may hold: the sum of |its gradients| of
    every backward up to this one (a shard overwritten or added to, full gradients kept across
    no_sync) plus the average already reduced (re-reduced where full gradients stay at rest);
    block maxima add up per backward, in case a backward reduces on its own. Summed over the
    step's synchronizing backwards."""
    n = world
    bounds = []
    for layout in layouts:
        chunk = layout["shard_numel"]
        mag = [[_to_flat(layout, {k: v.abs() for k, v in g.items()}) for g in per_rank] for per_rank in local]
        peak = [[block_max(a, chunk) if quantized else a for a in per_rank] for per_rank in mag]  # (int8 only)
        bound = torch.zeros(layout["padded_numel"], dtype=torch.float64)
        seen_mag = [torch.zeros_like(bound) for _ in range(n)]
        seen_peak = [torch.zeros_like(bound) for _ in range(n)]
        prior_mag, prior_peak = torch.zeros_like(bound), torch.zeros_like(bound)
        for i, (_, sync) in enumerate(plan):
            for r in range(n):
                seen_mag[r] += mag[i][r]
                seen_peak[r] += peak[i][r]
            if not sync:
                continue
            inputs = [a + prior_mag for a in seen_mag]
            input_peaks = [m + prior_peak for m in seen_peak]
            if quantized and n > 1:
                total = sum(input_peaks)
                bound += total / n / 254 * (1 + 2 ** -15) + 2 ** -23 * total + 2 ** -147
            if wire_bf16:  # (at N = 1 too: the one gradient is still cast to bf16)
                bound += (n + 2) * U_BF16 * sum(inputs) / n * (1 + (n + 2) * U_BF16)
            prior_mag, prior_peak = sum(seen_mag) / n, sum(seen_peak) / n
        bounds.append(bound)
    return _from_flat(layouts, bounds, local[0][0].keys())


def param_tol(dtype: torch.dtype, steps: int, grad_scale: float) -> tuple[float, float]:
    """(rtol, atol) between the engine's and the reference's parameters: see :func:`_compare_final`."""
    rtol = tolerance(dtype, 4 * 3 * 2)
    return rtol, LR * steps * steps * rtol * grad_scale + 4 * torch.finfo(torch.float32).eps


def _check_used_params(case, step, ref: Reference, used: dict, layouts, world, dtype, tol) -> None:
    """qwZ (guide §15): |θ̂ − θ| ≤ m/254·(1 + 2^-15) + 2^-148 per element, m the block maximum of
    |θ| in the owner's shard, θ the reference's master (within ``tol`` of the engine's), plus
    u·(|θ| + |θ̂|) where forward computes in bf16; then forward's θ̂ is the reference's too."""
    rtol, atol = tol
    u = U_BF16 if dtype == torch.bfloat16 else 0.0
    master = {n: p.detach().double().cpu() for n, p in ref.master.named_parameters()}
    peaks = [block_max(_to_flat(layout, master), layout["shard_numel"]) * (1 + rtol) + atol for layout in layouts]
    trainable = [n for n, p in ref.master.named_parameters() if p.requires_grad]
    peak = _from_flat(layouts, peaks, trainable)  # frozen parameters may stay outside the flat groups
    for name, theta in master.items():
        if name not in used:
            continue
        quant = peak[name] / 254 * (1 + 2 ** -15) + 2 ** -148 if name in peak else 0.0  # outside: not gathered
        bound = quant + u * (theta.abs() + used[name].double().abs())
        _assert_within(used[name], theta, rtol, atol, bound,
                       f"[{case}] step {step}: parameter {name} as forward used it (quantized AllGather)")
    ref.load_compute(used)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _compare_grads(case, step, got: dict, want: dict, dtype, n_terms, bound: dict | None = None) -> None:
    """``bound``: a compressed case's documented error per element, added to the tolerance."""
    rtol = tolerance(dtype, n_terms)
    scale = max((g.abs().max().item() for g in want.values() if g is not None), default=1.0)
    for name, g in want.items():
        expected = torch.zeros_like(got[name]).cpu() if g is None else g.float().cpu()
        if bound is not None:
            _assert_within(got[name], expected, rtol, rtol * scale, bound[name],
                           f"[{case}] step {step}: gradient of {name} (within the compression bound)")
            continue
        torch.testing.assert_close(got[name].float().cpu(), expected, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"[{case}] step {step}: gradient of {name}: {m}")


def _compare_optimizer_state(case, engine, ref: Reference, rtol: float) -> None:
    """``engine.optimizer.state_dict()`` (torch's format, full tensors) against the stock
    optimizer's, matched by parameter name; tensors within ``rtol`` of their largest element."""
    got = engine.optimizer.state_dict()["state"]
    names = engine.optimizer.index_names()
    mine = {names[i]: entry for i, entry in got.items()}
    name_of = {id(p): n for n, p in ref.master.named_parameters()}
    order = [p for grp in ref.opt.param_groups for p in grp["params"]]
    want = {name_of[id(p)]: ref.opt.state[p] for p in order if ref.opt.state.get(p)}
    if sorted(mine) != sorted(want):
        raise AssertionError(f"[{case}] optimizer state for {sorted(mine)}; the stock optimizer has {sorted(want)}")
    for name, entry in want.items():
        if sorted(mine[name]) != sorted(entry):
            raise AssertionError(f"[{case}] optimizer state of {name}: {sorted(mine[name])}, stock {sorted(entry)}")
        for k, v in entry.items():
            v = torch.as_tensor(v).double().cpu()
            scale = v.abs().max().item() if v.numel() else 0.0
            torch.testing.assert_close(torch.as_tensor(mine[name][k]).double().cpu(), v, rtol=rtol,
                                       atol=rtol * scale, msg=lambda m, name=name, k=k:
                                       f"[{case}] optimizer state {k} of {name}: {m}")


def _compare_final(case, engine, ref: Reference, ema_inputs, dtype, grad_scale: float) -> None:
    state = engine.full_state_dict()
    steps = STEPS + (1 if case.usage == "reshard" else 0)
    n_terms = 4 * 3 * 2  # the most terms any usage sums (world 4, 3 micro-batches, 2 forwards)
    grad_rtol = tolerance(dtype, n_terms)
    if per_tensor(case):  # stepped on the same gradients (module docstring)
        rtol = fed_tolerance(steps)
        scale = max(p.detach().abs().max().item() for p in ref.master.parameters())
        for name, p in ref.master.named_parameters():
            torch.testing.assert_close(state[name].float().cpu(), p.detach().float().cpu(), rtol=rtol,
                                       atol=rtol * scale, msg=lambda m, name=name:
                                       f"[{case}] final parameter {name} (stepped on the same gradients): {m}")
        _compare_optimizer_state(case, engine, ref, rtol)
    else:
        for name, p in ref.master.named_parameters():
            # |Δθ| ≤ Σ_steps lr · (momentum-accumulated gradient error) ≤ lr · steps² · atol_grad,
            # with atol_grad relative to the largest reference gradient of the run.
            atol = LR * steps * steps * grad_rtol * grad_scale + 4 * torch.finfo(torch.float32).eps
            torch.testing.assert_close(state[name].float().cpu(), p.detach().float().cpu(), rtol=grad_rtol,
                                       atol=atol, msg=lambda m, name=name: f"[{case}] final parameter {name}: {m}")
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


def run_cases_miscaled(rank: int, world: int, cases: list[Case], factor: float) -> list[tuple[str, str | None]]:
    """:func:`run_cases` with the int8 codec's dequantization scaled by ``factor``: a check of the
    checks — a compressed case must fail when the codec is wrong by more than its bound allows."""
    from zerodp.engine import quant

    exact = quant._dequantize_rows
    quant._dequantize_rows = lambda q, scales, block: exact(q, scales * factor, block)
    try:
        return run_cases(rank, world, cases)
    finally:
        quant._dequantize_rows = exact


def run_cases_lr_off(rank: int, world: int, cases: list[Case], factor: float) -> list[tuple[str, str | None]]:
    """:func:`run_cases` with every learning rate of the engine's optimizer (not the reference's)
    times ``factor``: a check of the checks — a per-tensor case must fail when the engine's step
    is off by more than one rounding per step."""
    exact = engine_optimizer

    def scaled(optimizer):
        for grp in optimizer.param_groups:
            grp["lr"] *= factor
        return optimizer

    def off(case: Case, model: nn.Module):
        optimizer, options = exact(case, model)
        if isinstance(optimizer, list):
            return [scaled(o) for o in optimizer], options
        return (lambda groups: scaled(optimizer(groups))), options

    globals()["engine_optimizer"] = off
    try:
        return run_cases(rank, world, cases)
    finally:
        globals()["engine_optimizer"] = exact


# ---- DiLoCo (guide §16): the outer loop over replica groups, against its update rule -------------
# ``parallelize(..., shard_size=g, outer=DiLoCo(...))`` makes R = W/g replica groups that train
# alone and sync every H steps; no single-process data-parallel run computes that, so these cases
# have a reference of their own, written here from the update rule (as tests/test_engine_diloco.py's):
# R copies of the model (a :class:`Reference` each: fp32 master, compute in the case's dtype), each
# stepped by the stock SGD on its group's rows (the mean over its g ranks' per-shard losses, each
# rank's backwards as the engine's: micro-batches under no_sync or not, clipped by the *group's*
# gradient norm — the groups share nothing between syncs); fragment f of the outer loop synced after
# the inner steps k with (k − ⌊f·H/F⌋) mod H = 0 (the fragment of each element read from the engine):
# Δ = mean_r(θ_outer − θ_r) there, applied τ steps later by torch.optim.SGD's rule (m ← μ·m + Δ;
# θ_outer ← θ_outer − lr·(Δ + μ·m) with Nesterov, − lr·m without), θ_r ← θ_outer on the fragment.
#
# Tolerances, as the flat cases' (:func:`_compare_final`) and for the same reason — the group's
# gradient sums its n terms (g ranks × micro-batches, every step so far) in another order:
# rtol = tolerance(dtype, n) and atol = lr·k²·rtol·(largest reference gradient) after k SGD steps;
# the outer step turns an error of Δ into one of θ_outer of at most lr_o·(1 + μ)/(1 − μ) times it
# (the momentum's geometric sum, Nesterov's look-ahead), the *gain*, which multiplies that atol;
# and each inner step and outer update rounds every element of θ once or twice in fp32:
# 4·(steps + syncs)·ε₃₂·max|θ|. Checked after every step, on every rank, against its group's copy;
# the replicas' parameters must agree bitwise after a sync of the whole model (F = 1, τ = 0).

DILOCO_USAGES = ("plain", "no_sync", "accumulate", "clip", "bf16")
#: the outer optimizer: (lr, momentum, nesterov) — DiLoCo's Nesterov, heavy-ball momentum, and the
#: plain mean of the groups (lr 1, momentum 0: local SGD)
DILOCO_OUTERS = {"nesterov": (0.7, 0.9, True), "heavy": (0.5, 0.5, False), "average": (1.0, 0.0, False)}
#: shard-group size g per world size: 2 groups of 1 rank, 3 groups of 1, 2 groups of 2
DILOCO_G = {2: 1, 3: 1, 4: 2}


@dataclass(frozen=True)
class DiLoCoStep:
    """One inner step of a DiLoCo sequence: each backward's mode ("sync", "no_sync" — inside
    ``engine.no_sync()`` — or "attr": ``require_backward_grad_sync = False``), the clip norm (None:
    no clipping), the inner learning rate's factor set before the step (None: unchanged), and
    ``zero_grad``'s ``set_to_none``."""

    micros: tuple[str, ...]
    clip: float | None = None
    lr: float | None = None
    to_none: bool = True


@dataclass(frozen=True)
class DiLoCoCase:
    stage: int
    world: int
    every: int
    fragments: int = 1
    delay: int = 0
    outer: str = "nesterov"
    usage: str = "plain"

    def __str__(self) -> str:
        return (f"diloco stage={self.stage} world={self.world} every={self.every} fragments={self.fragments} "
                f"delay={self.delay} outer={self.outer} usage={self.usage}")

    @classmethod
    def parse(cls, text: str) -> "DiLoCoCase":
        words = text.split()
        if not words or words[0] != "diloco":
            raise ValueError(f"{text!r}: a DiLoCo case starts with 'diloco'")
        kv = dict(w.split("=", 1) for w in words[1:])
        case = cls(int(kv["stage"]), int(kv["world"]), int(kv["every"]), int(kv.get("fragments", 1)),
                   int(kv.get("delay", 0)), kv.get("outer", "nesterov"), kv.get("usage", "plain"))
        if (case.usage not in DILOCO_USAGES or case.outer not in DILOCO_OUTERS or case.world not in DILOCO_G
                or case.stage not in STAGES or not 1 <= case.fragments <= case.every
                or not 0 <= case.delay < case.every):
            raise ValueError(f"{text!r}: usage in {DILOCO_USAGES}, outer in {sorted(DILOCO_OUTERS)}, world in "
                             f"{sorted(DILOCO_G)}, 1 <= fragments <= every, 0 <= delay < every")
        return case

    @property
    def ranks_needed(self) -> int:
        return self.world

    @property
    def bf16(self) -> bool:
        return self.usage == "bf16"

    def steps(self) -> list[DiLoCoStep]:
        """Two rounds, and the delay for the last update to land; each step's backwards by usage."""
        micros = {"plain": ("sync",), "no_sync": ("no_sync", "attr", "sync"), "accumulate": ("sync", "sync"),
                  "clip": ("no_sync", "sync"), "bf16": ("no_sync", "sync")}[self.usage]
        clip = CLIP if self.usage in ("clip", "bf16") else None
        return [DiLoCoStep(micros, clip) for _ in range(2 * self.every + self.delay)]


def diloco_cases() -> list[DiLoCoCase]:
    """make test's DiLoCo cases (one spawned group of 4 ranks): every stage, every usage, every
    outer optimizer, fragments and delays; the world sizes 2 and 3 are the fuzzer's
    (tests/test_engine_fuzz.py)."""
    return [DiLoCoCase(0, 4, 2, 1, 0, "average", "no_sync"), DiLoCoCase(1, 4, 3, 3, 1, "nesterov", "clip"),
            DiLoCoCase(2, 4, 2, 2, 1, "heavy", "accumulate"), DiLoCoCase(3, 4, 3, 2, 2, "nesterov", "bf16"),
            DiLoCoCase(1, 4, 1, 1, 0, "average", "bf16"), DiLoCoCase(3, 4, 2, 1, 0, "heavy", "no_sync"),
            DiLoCoCase(0, 4, 3, 2, 1, "nesterov", "plain")]


def random_diloco_cases(n: int, seed: int) -> list[DiLoCoCase]:
    rng = random.Random(f"diloco:{seed}")
    out = []
    for _ in range(n):
        every = rng.randint(1, 5)
        out.append(DiLoCoCase(rng.choice(STAGES), rng.choice(sorted(DILOCO_G)), every, rng.randint(1, every),
                              rng.choice([0, 0, rng.randint(0, every - 1)]), rng.choice(sorted(DILOCO_OUTERS)),
                              rng.choice(DILOCO_USAGES)))
    return out


def diloco_fragment_map(engine) -> dict[str, torch.Tensor]:
    """Collective: per parameter, the fragment of each element, from every rank's outer shard."""
    spans: list = [None] * dist.get_world_size()
    dist.all_gather_object(spans, engine.outer.fragment_spans())
    shapes = {n: p.shape for n, p in engine.module.named_parameters()}
    out = {n: torch.full((s.numel(),), -1, dtype=torch.long) for n, s in shapes.items()}
    for name, a, b, f in (x for r in spans for x in r):
        out[name][a:b] = f
    missing = [n for n, v in out.items() if bool((v < 0).any())]
    if missing:
        raise AssertionError(f"elements of {missing} in no fragment of any rank's outer shard")
    return {n: v.view(shapes[n]) for n, v in out.items()}


def run_diloco(label: str, rank: int, *, stage: int, world: int, every: int, fragments: int, delay: int,
               outer: str, bf16: bool, steps: list[DiLoCoStep], device: str | None = None) -> None:
    """Train the engine with DiLoCo through ``steps`` and the reference of the section's comment
    beside it, on this rank; raise, naming ``label``, where they part."""
    import zerodp

    dev = matrix_device(rank, device)
    g = DILOCO_G[world]
    R, me = world // g, rank // g
    lr_o, mu, nesterov = DILOCO_OUTERS[outer]
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(123)
    model = MatrixModel(frozenset()).to(dev)
    engine = zerodp.parallelize(
        model, optimizer=make_optimizer, stage=stage, shard_size=g, mixed_precision="bf16" if bf16 else None,
        outer=zerodp.DiLoCo(every=every, lr=lr_o, momentum=mu, nesterov=nesterov, fragments=fragments, delay=delay),
        units=list(model.blocks) if stage == 3 else None, bucket_mb=0.0002, first_bucket_mb=0.0001, timeout_s=60)
    where = diloco_fragment_map(engine)
    refs = []
    for _ in range(R):
        torch.manual_seed(123)
        refs.append(Reference(MatrixModel(frozenset()).to(dev), dtype, False))
    theta = {n: p.detach().clone() for n, p in refs[0].master.named_parameters()}
    mom = {n: torch.zeros_like(p) for n, p in theta.items()}
    offsets = [f * every // fragments for f in range(fragments)]
    gain = max(1.0, lr_o * (1 + mu) / (1 - mu))
    pending: list[tuple[int, int, dict]] = []
    terms = syncs = 0
    grad_scale = 0.0
    for k, plan in enumerate(steps, start=1):
        if plan.lr is not None:
            for opt in [engine.optimizer] + [ref.opt for ref in refs]:
                for grp in opt.param_groups:
                    grp["lr"] = LR * plan.lr
        scale = 1.0 / len(plan.micros)
        for i, mode in enumerate(plan.micros):
            x, y = batch(k, i)
            x, y = x.to(dev), y.to(dev)
            ctx = engine.no_sync() if mode == "no_sync" else _nullcontext()
            engine.require_backward_grad_sync = mode != "attr"
            try:
                with ctx:
                    (engine(shard(x, rank, world), shard(y, rank, world)) * scale).backward()
            finally:
                engine.require_backward_grad_sync = True
            for r, ref in enumerate(refs):
                if i == 0:
                    ref.sync_compute()
                total = sum(ref.compute(shard(x, q, world), shard(y, q, world)) for q in range(r * g, (r + 1) * g))
                (total * (scale / g)).backward()
        terms += g * len(plan.micros)
        rtol = tolerance(dtype, terms)
        norms = []
        for ref in refs:
            ref.grads_to_master()
            grad_scale = max([grad_scale] + [p.grad.abs().max().item() for p in ref.master.parameters()
                                             if p.grad is not None])
            if plan.clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_([p for p in ref.master.parameters() if p.grad is not None],
                                                            plan.clip))
        problems: list[str] = []  # this step's mismatches, raised on every rank together (the ranks stay in step)
        if plan.clip is not None:
            norm = engine.clip_grad_norm_(plan.clip)
            _noted(problems, lambda: torch.testing.assert_close(
                norm.float().cpu(), norms[me].float().cpu(), rtol=rtol, atol=0.0,
                msg=lambda m: f"[{label}] step {k}: the group's gradient norm: {m}"))
        engine.step()
        engine.zero_grad(set_to_none=plan.to_none)
        for ref in refs:
            ref.opt.step()
            ref.opt.zero_grad(set_to_none=plan.to_none)
        local = [dict(ref.master.named_parameters()) for ref in refs]
        with torch.no_grad():
            for f in range(fragments):
                if (k - offsets[f]) % every == 0:
                    delta = {n: sum(theta[n] - local[r][n].detach() for r in range(R)) / R for n in theta}
                    pending.append((k + delay, f, delta))
            for _, f, delta in sorted((p for p in pending if p[0] == k), key=lambda p: p[1]):
                syncs += 1
                for n in theta:
                    mask = where[n].to(dev) == f
                    d = delta[n][mask]
                    mom[n][mask] = mu * mom[n][mask] + d
                    theta[n][mask] -= lr_o * (d + mu * mom[n][mask] if nesterov else mom[n][mask])
                    for r in range(R):
                        local[r][n][mask] = theta[n][mask]
        pending = [p for p in pending if p[0] != k]
        full = engine.full_state_dict()
        want = refs[me].master
        theta_scale = max(p.detach().abs().max().item() for p in want.parameters())
        atol = gain * LR * k * k * rtol * grad_scale + 4 * (k + syncs) * torch.finfo(torch.float32).eps * theta_scale
        for name, p in want.named_parameters():
            _noted(problems, lambda name=name, p=p: torch.testing.assert_close(
                full[name].float().cpu(), p.detach().float().cpu(), rtol=rtol, atol=atol,
                msg=lambda m: f"[{label}] step {k}: parameter {name} of replica group {me}: {m}"))
        if fragments == 1 and delay == 0 and k % every == 0:
            everyone: list = [None] * world
            dist.all_gather_object(everyone, {n: t.cpu() for n, t in full.items()})
            for r in range(1, R):
                differ = [n for n in full if not torch.equal(everyone[0][n], everyone[r * g][n])]
                if differ:
                    problems.append(f"[{label}] step {k}: replica groups 0 and {r} differ after a sync in {differ}")
        said: list = [None] * world
        dist.all_gather_object(said, problems)
        if any(said):
            raise AssertionError("\n".join(f"rank {r}: {p}" for r, ps in enumerate(said) for p in ps[:2]))


def _noted(problems: list[str], check) -> None:
    """Run ``check``; a failed assertion is noted in ``problems`` instead of raised."""
    try:
        check()
    except AssertionError as e:
        problems.append(str(e))


def run_diloco_case(case: DiLoCoCase, rank: int, device: str | None = None) -> None:
    run_diloco(str(case), rank, stage=case.stage, world=case.world, every=case.every, fragments=case.fragments,
               delay=case.delay, outer=case.outer, bf16=case.bf16, steps=case.steps(), device=device)


def run_diloco_cases(rank: int, world: int, cases: list[DiLoCoCase]) -> list[tuple[str, str | None]]:
    """:func:`run_cases` for DiLoCo cases (all on ``world`` ranks)."""
    import traceback

    out = []
    for case in cases:
        try:
            run_diloco_case(case, rank)
            out.append((str(case), None))
        except Exception as e:  # noqa: BLE001 - reported with the case, which can be rerun alone
            out.append((str(case), f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        dist.barrier()
    return out


if __name__ == "__main__":
    from zerodp.spawn import run_local

    text = " ".join(sys.argv[1:])
    if text.startswith("diloco"):
        one = DiLoCoCase.parse(text)
        results = run_local(run_diloco_cases, one.ranks_needed, [one], timeout=300)
    else:
        one = Case.parse(text)
        results = run_local(run_cases, one.ranks_needed, [one], timeout=300, backend=matrix_backend())
    errors = {err for rank_results in results for _, err in rank_results if err}
    print(f"{one}: " + ("ok" if not errors else "FAILED\n" + "\n".join(sorted(errors))))
    sys.exit(1 if errors else 0)
