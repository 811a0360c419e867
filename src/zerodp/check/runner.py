"""One spawned group runs every row of ``zerodp check``: per (world, stage), the engine on the
first ``world`` ranks against a single-process reference on rank 0 (guide §2.2, §5, §12.3).

Each step, as a training script runs it: ``micro_batches`` forwards and backwards on each rank's
rows, all but the last under ``engine.no_sync()`` (guide §5), each loss divided by the number of
micro-batches; the engine's averaged gradients (``engine.full_grad_dict()``) are checked against
the reference's — the same model on the whole global batch, one rank's rows at a time (its loss
the mean of the ranks' losses, which is what data parallelism computes; BatchNorm and other
buffers follow rank 0, as the engine's do) — within :func:`zerodp.check.core.tolerance` of every
gradient term summed so far. The reference then takes the engine's gradients (an adaptive or
orthogonalizing optimizer has no trajectory bound, so both step from the same gradients, as the
differential matrix does), both clip them to ``clip`` (the norms are compared) and step. The
parameters, buffers and the optimizer's state (torch's format, by name) are compared at the end
within :func:`zerodp.check.core.fed_tolerance` of the steps taken.

With ``reshard``, the last step runs on another engine: every rank's checkpoint pieces are
gathered (:func:`zerodp.check.core.gather_state`) and loaded into an engine at the next stage and
another world size (1 ↔ the row's), built from other weights, so that loading must win.

Every rank makes the same collectives whatever the values are, so a mismatch never hangs: it is
a number in the row. An exception on one rank ends the whole group (:func:`zerodp.spawn.run_local`).
"""

from __future__ import annotations

import copy
import resource
import sys
import time

import torch
import torch.distributed as dist

from zerodp.check import core
from zerodp.check.spec import (CheckConfig, build_model, engine_optimizer, find_units, loss_of, make_batch,
                               reference_optimizer, shard)


def _device(cfg: CheckConfig, rank: int) -> torch.device:
    return torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")


def progress(cfg: CheckConfig, text: str) -> None:
    """One line on stderr (rank 0): which row and step is running."""
    print(f"zerodp check: {text}", file=sys.stderr, flush=True)


class Reference:
    """The single-process model: an fp32 master with the stock optimizer, computing in the
    engine's dtype (a bf16 copy under mixed precision)."""

    def __init__(self, cfg: CheckConfig, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.master = build_model(cfg).to(device)
        self.dtype = dtype
        self.compute = self.master if dtype == torch.float32 else copy.deepcopy(self.master).to(dtype)
        self.opt = reference_optimizer(cfg, self.master)
        self.names = [n for n, p in self.master.named_parameters() if p.requires_grad]
        self.unused: set[str] = set()  # parameters no rank used in this step

    def sync_compute(self) -> None:
        if self.compute is not self.master:
            with torch.no_grad():
                for pc, pm in zip(self.compute.parameters(), self.master.parameters()):
                    pc.copy_(pm)

    def _buffers(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self.compute.buffers()]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for b, s in zip(self.compute.buffers(), saved):
                b.copy_(s)

    def backward(self, batch, step: int, micro: int, world: int) -> None:
        """Every rank's rows of one micro-batch, backwarded as that rank's engine does it: the
        loss over the micro-batches and averaged over the ranks; buffers as rank 0 leaves them."""
        rows = self.cfg.rows * world
        before, after0 = self._buffers(), None
        for r in range(world):
            if r:
                self._restore(before)
            args, kwargs = _cast(shard(batch, r, world, rows), self.dtype)
            torch.manual_seed(_forward_seed(self.cfg, step, micro, r))
            loss = loss_of(self.cfg, self.compute(*args, **kwargs), (args, kwargs))
            (loss * (1.0 / self.cfg.micro_batches) * (1.0 / world)).backward()
            if r == 0:
                after0 = self._buffers()
        self._restore(after0)

    def grads(self) -> dict[str, torch.Tensor]:
        """The master gradients by name (from the compute copy under mixed precision)."""
        out = {}
        compute = dict(self.compute.named_parameters())
        self.unused = set()
        for name, p in self.master.named_parameters():
            if p.requires_grad:
                g = compute[name].grad
                if g is None:  # no rank used it this step: the engine leaves it alone (as DDP)
                    self.unused.add(name)
                out[name] = torch.zeros(p.shape, device=p.device) if g is None else g.detach().float()
        return out

    def master_grads(self) -> dict[str, torch.Tensor]:
        return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for n, p in self.master.named_parameters() if p.requires_grad}

    def clip(self, grads: dict[str, torch.Tensor], max_norm: float) -> torch.Tensor:
        """Put ``grads`` on the master and clip them there with ``torch.nn.utils.clip_grad_norm_``."""
        self.feed(grads)
        return torch.nn.utils.clip_grad_norm_([p for p in self.master.parameters() if p.requires_grad], max_norm)

    def compare(self, state: dict[str, torch.Tensor], rtol: float, buffer_rtol: float) -> core.Closeness:
        """The engine's parameters (``full_state_dict()``) against the master's, each tensor within
        ``rtol`` of its own largest element; buffers (rank 0's) within ``buffer_rtol``."""
        worst = core.NONE
        for name, p in self.master.named_parameters():
            want = p.detach()
            worst = worst.worse(core.measure(state[name], want, rtol, rtol * float(want.abs().max()), name)
                                if name in state else core.Closeness(float("inf"), 0.0, float("inf"), name))
        for name, b in self.compute.named_buffers():
            if name in state and b.is_floating_point():
                want = b.detach().float()
                scale = float(want.abs().max()) if want.numel() else 0.0
                worst = worst.worse(core.measure(state[name], want, buffer_rtol, buffer_rtol * scale, name))
            elif name in state and not torch.equal(state[name].cpu(), b.detach().cpu()):
                worst = worst.worse(core.Closeness(float("inf"), 0.0, float("inf"), name))
        return worst

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Start the next step from the engine's parameters and buffers (checked just before)."""
        for name, p in self.master.named_parameters():
            p.copy_(state[name])
        for name, b in self.compute.named_buffers():
            if name in state:
                b.copy_(state[name])
        self.sync_compute()

    def feed(self, grads: dict[str, torch.Tensor]) -> None:
        for name, p in self.master.named_parameters():
            if p.requires_grad:
                p.grad = None if name in self.unused else grads[name].to(p.device, p.dtype).clone()
        for p in self.compute.parameters():
            if self.compute is not self.master:
                p.grad = None

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for p in self.compute.parameters():
            p.grad = None


def _forward_seed(cfg: CheckConfig, step: int, micro: int, rank: int) -> int:
    """Each rank's forward draws (dropout) from a seed of its own, the reference's the same."""
    return 7_919 * (cfg.seed + 1) + 104_729 * step + 1_013 * micro + rank


def _cast(batch, dtype: torch.dtype):
    """Floating inputs in the compute dtype, as the engine casts them under mixed precision."""
    if dtype == torch.float32:
        return batch
    args, kwargs = batch

    def c(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return tuple(c(a) for a in args), {k: c(v) for k, v in kwargs.items()}


def _build_engine(cfg: CheckConfig, stage: int, group, device: torch.device, seed_offset: int):
    import dataclasses

    from zerodp.engine.api import parallelize

    built = dataclasses.replace(cfg, seed=cfg.seed + seed_offset)
    model = build_model(built).to(device)
    optimizer = engine_optimizer(cfg, model)
    engine = parallelize(model, optimizer=optimizer, stage=stage,
                         mixed_precision="bf16" if cfg.precision == "bf16" else None,
                         units=find_units(model, cfg.units) if stage == 3 else None,
                         find_unused_parameters=stage < 3, group=group)
    return engine


def _perturb(cfg: CheckConfig, engine, base: list[float]) -> None:
    """The test-only seam (:class:`CheckConfig`): the engine's learning rates × (1 + perturb_lr),
    set through the engine's public ``engine.optimizer.param_groups``."""
    if cfg.perturb_lr:
        for g, lr in zip(engine.optimizer.param_groups, base):
            g["lr"] = lr * (1.0 + cfg.perturb_lr)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def run_row(cfg: CheckConfig, rank: int, world: int, stage: int, groups: dict) -> dict | None:
    """One row on every rank of the default group (ranks ≥ ``world`` only join the collectives of
    the default group); rank 0 returns the row's figures, the others None."""
    dev = _device(cfg, rank)
    lead = rank == 0
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    world_all = dist.get_world_size()
    load_world = (1 if world > 1 else min(2, world_all)) if cfg.reshard else world
    load_stage = (stage + 1) % 4
    before = cfg.steps - 1 if cfg.reshard else cfg.steps
    phases = [(world, stage, range(before))]
    if cfg.reshard:
        phases.append((load_world, load_stage, range(before, cfg.steps)))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    started = time.perf_counter()

    ref = Reference(cfg, dev, dtype) if lead else None
    grad_worst, norm_worst, param_worst = core.NONE, core.NONE, core.NONE
    engine, base_lr, stats = None, [], None
    for phase, (w, s, steps) in enumerate(phases):
        member = rank < w
        if phase == 0:
            engine = _build_engine(cfg, s, groups[w], dev, 0) if member else None
            base_lr = [g["lr"] for g in engine.optimizer.param_groups] if member else []
        else:
            full, scalars = core.gather_state(engine)
            engine = None
            if member:
                engine = _build_engine(cfg, s, groups[w], dev, 1)  # other weights: loading must win
                engine.checkpoint.load_scalar_state(scalars)
                engine.checkpoint.load_state_pieces(lambda n, k, a, b: full[(n, k)][a:b].to(dev))
        if member:
            _perturb(cfg, engine, base_lr)
        for step in steps:
            if lead:
                progress(cfg, f"stage {stage}, world {world}: step {step + 1}/{cfg.steps}"
                         + (f" (resharded to stage {s}, world {w})" if phase else ""))
                ref.sync_compute()
            rows = cfg.rows * w
            for micro in range(cfg.micro_batches):
                batch = make_batch(cfg, step, micro, rows, dev)
                if member:
                    args, kwargs = shard(batch, rank, w, rows)
                    with engine.no_sync(micro < cfg.micro_batches - 1):
                        torch.manual_seed(_forward_seed(cfg, step, micro, rank))
                        loss = loss_of(cfg, engine(*args, **kwargs), (args, kwargs))
                        (loss * (1.0 / cfg.micro_batches)).backward()
                if lead:
                    ref.backward(batch, step, micro, w)
            terms = w * cfg.micro_batches  # gradient terms summed this step (ranks × micro-batches)
            rtol = core.tolerance(dtype, terms)
            got = engine.full_grad_dict() if member else None
            if lead:
                grad_worst = grad_worst.worse(core.compare_dicts(got, ref.grads(), rtol))
            if cfg.clip is not None:
                norm = engine.clip_grad_norm_(cfg.clip) if member else None
                clipped = engine.full_grad_dict() if member else None
                if lead:
                    # The norm: |‖g_e‖ − ‖g_r‖| ≤ ‖g_e − g_r‖ ≤ √Ψ · (the elementwise bound above), plus
                    # its own rounding (rtol·‖g‖). Both sides clip by max_norm/‖g‖: the engine's
                    # clipped gradients are the engine's own scaled by the reference's coefficient,
                    # within the coefficient's relative error.
                    want = ref.grads()
                    numel = sum(t.numel() for t in want.values())
                    gmax = max(float(t.abs().max()) for t in want.values() if t.numel())
                    ref_norm = ref.clip(want, cfg.clip)
                    allowed = rtol * float(ref_norm) + numel ** 0.5 * rtol * gmax
                    gap = abs(float(norm) - float(ref_norm))
                    norm_worst = norm_worst.worse(core.Closeness(gap, allowed, gap / allowed if gap else 0.0,
                                                                 "gradient norm"))
                    ref.clip(got, cfg.clip)
                    coef_rtol = allowed / max(float(ref_norm), cfg.clip) + core.tolerance(torch.float32, 1)
                    grad_worst = grad_worst.worse(core.compare_dicts(clipped, ref.master_grads(), coef_rtol))
                    got = clipped
            if lead:
                ref.feed(got)  # both step from the same (checked) gradients
            if member:
                engine.step()
                engine.zero_grad()
            if lead:
                ref.step()
            now = engine.full_state_dict() if member else None
            if lead:  # both stepped from the same parameters and gradients: one fp32 rounding apart
                param_worst = param_worst.worse(ref.compare(now, core.fed_tolerance(1), core.tolerance(dtype, terms)))
                ref.load(now)  # the next step starts from the same parameters again
        if phase == 0:
            mine = _row_stats(engine, dev) if member else None
            stats = [None] * world_all
            dist.all_gather_object(stats, mine)

    result = None
    optim = engine.optimizer_state_dict() if rank < phases[-1][0] else None
    if lead:
        rtol = core.fed_tolerance(cfg.steps)  # one rounding per step, carried in the states
        state_worst = _compare_optimizer(optim, ref, rtol)
        result = {"stage": stage, "world": world, "reshard": [load_stage, load_world] if cfg.reshard else None,
                  "steps": cfg.steps, "micro_batches": cfg.micro_batches, "precision": cfg.precision,
                  "grad": _as_dict(grad_worst.worse(norm_worst)), "param": _as_dict(param_worst),
                  "optimizer_state": _as_dict(state_worst), "ranks": [s for s in stats if s is not None],
                  "planned_state_numel": planned_state_numel(ref),
                  "planned_exchange_numel": planned_exchange_numel(ref) if stage == 3 else 0,
                  "stateless_numel": sum(p.numel() for p in ref.master.parameters()
                                         if p.requires_grad and not ref.opt.state.get(p)),
                  "own_gathers": (2 if cfg.clip is not None else 1) + (len(phases[0][2]) > 1),
                  "seconds": time.perf_counter() - started}
        result["ok"] = all(result[k]["ratio"] <= 1.0 for k in ("grad", "param", "optimizer_state"))
    dist.barrier()
    return result


#: torch.optim classes the planner prices (zerodp.plan.ownership.state_numel), by lower-case name
_PRICED = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd", "muon": "muon", "adafactor": "adafactor"}


def planned_state_numel(ref: Reference) -> int | None:
    """The planner's count of optimizer-state elements (and step scalars) for the reference's
    optimizers over their tensors (None: an optimizer it does not price)."""
    from zerodp.plan.ownership import state_numel

    total = 0
    for opt in getattr(ref.opt, "optimizers", [ref.opt]):
        name = _PRICED.get(type(opt).__name__.lower())
        if name is None:
            return None
        for g in opt.param_groups:
            if name == "sgd" and not g.get("momentum"):
                continue
            for p in g["params"]:
                if p.requires_grad:
                    elements, scalars = state_numel(name, tuple(p.shape))
                    total += elements + scalars
    return total


def planned_exchange_numel(ref: Reference) -> int:
    """Elements of the tensors a per-tensor optimizer steps whole (Ψ_m): what stage 3's owner
    exchange brings to their owners and back (guide §12.3)."""
    from zerodp.engine.optimizer_plan import PER_TENSOR_OPTIMIZERS

    return sum(p.numel() for opt in getattr(ref.opt, "optimizers", [ref.opt]) if type(opt) in PER_TENSOR_OPTIMIZERS
               for g in opt.param_groups for p in g["params"] if p.requires_grad)


def _as_dict(c: core.Closeness) -> dict:
    return {"diff": c.diff, "allowed": c.allowed, "ratio": c.ratio, "where": c.name}


def _compare_optimizer(optim: dict, ref: Reference, rtol: float) -> core.Closeness:
    """The engine's ``optimizer_state_dict()`` (torch's layout by name) against the stock
    optimizer's state, each tensor within ``rtol`` of its own largest element; a state the
    one has and the other lacks is infinitely off."""
    got = optim["state"]
    name_of = {id(p): n for n, p in ref.master.named_parameters()}
    want = {name_of[id(p)]: s for p, s in ref.opt.state.items() if s}
    worst = core.NONE
    if sorted(got) != sorted(want):
        return core.Closeness(float("inf"), 0.0, float("inf"),
                              f"state for {len(got)} parameters, the stock optimizer for {len(want)}")
    for name, entry in want.items():
        if sorted(got[name]) != sorted(entry):
            return core.Closeness(float("inf"), 0.0, float("inf"), f"{name}: kinds {sorted(got[name])}, "
                                  f"stock {sorted(entry)}")
        for k, v in entry.items():
            v = torch.as_tensor(v).double().cpu()
            scale = float(v.abs().max()) if v.numel() else 0.0
            worst = worst.worse(core.measure(torch.as_tensor(got[name][k]), v, rtol, rtol * scale, f"{name}:{k}"))
    return worst


def _row_stats(engine, device: torch.device) -> dict:
    """This rank's figures of the row's last step before the checkpoint: the engine's measured
    model-state bytes (``engine.stats()``), bytes sent, padding, and the peak memory."""
    st = engine.stats()
    return {"rank": st.rank, "num_params": st.num_params, "memory": dict(st.memory),
            "model_state_bytes": st.model_state_bytes,
            "sent_bytes": sum(c.sent_bytes for c in st.collectives.values()),
            "collectives": {k: {"count": c.count, "bytes": c.bytes, "sent_bytes": c.sent_bytes}
                            for k, c in st.collectives.items()},
            "padding": (st.layout or {}).get("padding", 0),
            "padding_bytes": (st.layout or {}).get("padding_bytes", 0),
            "imbalance_bytes": (st.layout or {}).get("imbalance_bytes", 0),
            "state_imbalance_bytes": (st.layout or {}).get("state_imbalance_bytes", 0),
            "exchange_imbalance_bytes": (st.layout or {}).get("exchange_imbalance_bytes", 0),
            "placement": (st.layout or {}).get("placement"),
            "peak_bytes": _peak_bytes(device), "peak_kind": "cuda" if device.type == "cuda" else "rss"}


def rank_main(rank: int, world_all: int, cfg: CheckConfig) -> list[dict] | None:
    """Every row, on one rank of the spawned group; rank 0 returns the rows."""
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    worlds = sorted({int(w) for w in cfg.worlds} | ({1, min(2, world_all)} if cfg.reshard else set()))
    groups = {w: (dist.new_group(list(range(w))) if w < world_all else None) for w in worlds}
    rows = []
    for world in cfg.worlds:
        for stage in cfg.stages:
            row = run_row(cfg, rank, int(world), int(stage), groups)
            if row is not None:
                progress(cfg, f"stage {stage}, world {world}: {'PASS' if row['ok'] else 'FAIL'} "
                         f"({row['seconds']:.1f} s)")
                rows.append(row)
    return rows if rank == 0 else None
