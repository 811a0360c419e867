"""What a step cost: measured bytes per rank by kind, collectives, exposed communication.

Memory is *measured*, not computed: the engine lists the tensors it holds by kind and this module
sums the sizes of their distinct storages (a view into a flat buffer counts once, with the first
kind that names the buffer). The guide's ledger (§1, §8, §9) then says what it should be; with bf16
mixed precision and AdamW (k = 12), per rank with Ψ parameters on N ranks:

==========  ===========  ============  ===========  ======================
stage       params       grads         master       optimizer states (m, v)
==========  ===========  ============  ===========  ======================
0 DP        2Ψ           2Ψ (+4Ψ)      4Ψ           8Ψ
1 ZeRO-1    2Ψ           2Ψ (+4Ψ)      4Ψ/N         8Ψ/N
2 ZeRO-2    2Ψ           2Ψ/N (+4Ψ/N)  4Ψ/N         8Ψ/N
3 ZeRO-3    2Ψ/N         2Ψ/N (+4Ψ/N)  4Ψ/N         8Ψ/N
==========  ===========  ============  ===========  ======================

(+…: fp32 gradient accumulation. Stage 3 then keeps no bf16 gradient shard at rest — the
ReduceScatter lands in a buffer that lives only while it is added to the fp32 shard — so it
measures 2Ψ/N below the guide's count; stage 3's gathered units are listed apart.)
``python -m zerodp.bench.memory`` runs every stage on local ranks and prints formula vs measured per
kind; the formulas come from the planner
(:func:`zerodp.plan.memory.model_states`), written independently of the engine.

Communication of the last completed step is grouped by collective kind; ``wait_s`` is how long
the host was blocked waiting for it (guide §4: the *exposed* part, what overlap did not hide).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from zerodp.plan.units import fmt_mib
from zerodp.engine.trace import COMM, COMPUTE

#: guide §1: what each kind of tensor is, for ``stats()``; the first four are the "model states".
MEMORY_KINDS = ("params", "grads", "master", "optimizer_states", "gathered", "comm_buffers")
MODEL_STATE_KINDS = MEMORY_KINDS[:4]
#: θ_outer and momentum of the DiLoCo outer loop (guide §16.3), listed only where there is one
OUTER_KIND = "outer_states"


@dataclass
class CollectiveStats:
    """All collectives of one kind in a step: how many, full-buffer bytes V, ring bytes sent."""

    kind: str
    count: int = 0
    bytes: int = 0
    sent_bytes: float = 0.0
    seconds: float = 0.0  # issue to completion, summed
    wait_s: float = 0.0  # host blocked on them: exposed communication


@dataclass
class EngineStats:
    stage: int
    rank: int
    world_size: int
    num_params: int  # Ψ: trainable parameters
    param_dtype: str
    step: int  # the step the per-step figures describe (last completed)
    memory: dict[str, int] = field(default_factory=dict)  # bytes per rank by kind
    collectives: dict[str, CollectiveStats] = field(default_factory=dict)
    exposed_comm_s: float = 0.0
    compute_s: dict[str, float] = field(default_factory=dict)  # forward / backward / step spans
    step_time_s: float | None = None
    nonfinite: dict = field(default_factory=dict)  # the skip guard's counters (engine.guard)
    # The optimizer's placement and its price over every flat group (CheckpointContract.layout_cost):
    # "flat" or "owner", padding elements and bytes, elements each rank owns, imbalance bytes.
    layout: dict = field(default_factory=dict)
    # The DiLoCo outer loop (guide §16; zerodp.engine.outer): its settings, step, state and the
    # bytes of θ_outer and momentum this rank holds against 8Ψ/g ({} without one). Those bytes are
    # memory["outer_states"] too (not a model state of the stage's ledger: on top of it, guide §16.3).
    outer: dict = field(default_factory=dict)

    @property
    def model_state_bytes(self) -> int:
        return sum(self.memory.get(k, 0) for k in MODEL_STATE_KINDS)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_state_bytes"] = self.model_state_bytes
        return d

    def table(self) -> str:
        """A readable table with units."""
        lines = [f"stage {self.stage}, rank {self.rank}/{self.world_size}, Ψ = {self.num_params:,} "
                 f"params ({self.param_dtype}), step {self.step}",
                 f"{'memory kind':<18}{'bytes':>14}{'per param':>11}"]
        for kind in MEMORY_KINDS + ((OUTER_KIND,) if OUTER_KIND in self.memory else ()):
            v = self.memory.get(kind, 0)
            lines.append(f"  {kind:<16}{fmt_bytes(v):>14}{v / self.num_params:>11.3f}")
        lines.append(f"  {'model states':<16}{fmt_bytes(self.model_state_bytes):>14}"
                     f"{self.model_state_bytes / self.num_params:>11.3f}")
        lines.append(f"{'collective':<18}{'count':>7}{'bytes V':>12}{'sent':>12}{'time':>10}{'exposed':>10}")
        for c in self.collectives.values():
            lines.append(f"  {c.kind:<16}{c.count:>7}{fmt_bytes(c.bytes):>12}{fmt_bytes(c.sent_bytes):>12}"
                         f"{c.seconds * 1e3:>8.2f}ms{c.wait_s * 1e3:>8.2f}ms")
        spans = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.compute_s.items())
        step = "n/a" if self.step_time_s is None else f"{self.step_time_s * 1e3:.2f} ms"
        lines.append(f"compute: {spans or 'n/a'}; exposed comm {self.exposed_comm_s * 1e3:.2f} ms; step {step}")
        if self.layout:
            lo = self.layout
            lines.append(f"optimizer layout: {lo['placement']}; padding {lo['padding']:,} elements "
                         f"({fmt_bytes(lo['padding_bytes'])}); most owned {lo['max_owned_numel']:,} elements; "
                         f"imbalance {fmt_bytes(lo['imbalance_bytes'])} of fp32 master")
        return "\n".join(lines)


fmt_bytes = fmt_mib  # measured memory is shown in binary units


def measured_bytes(by_kind: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of distinct storages per kind; a storage already counted under an earlier kind
    (in :data:`MEMORY_KINDS` order) is not counted again."""
    seen: set[tuple[str, int]] = set()
    out = {}
    for kind in MEMORY_KINDS:
        total = 0
        for t in by_kind.get(kind, []):
            if t is None:
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[kind] = total
    return out


def engine_memory(engine) -> dict[str, int]:
    by_kind = dict(engine.machine.memory_tensors())
    master = engine.master
    by_kind["master"] = [t.tensor for t in master.targets]
    by_kind["optimizer_states"] = [v for state in master.optimizer.state.values()
                                   for v in state.values() if torch.is_tensor(v)]
    out = measured_bytes(by_kind)
    # Transient gradient buffers (in flight to their collective) are gone at rest: report the
    # most that was alive at once during the last step.
    out["comm_buffers"] = max(out.get("comm_buffers", 0), getattr(engine, "last_comm_peak", 0))
    # Gradient shards are freed by zero_grad() until the next reduction: report what the last
    # step's gradients held.
    out["grads"] = max(out.get("grads", 0), getattr(engine, "last_grad_bytes", 0))
    outer = getattr(engine, "outer", None)
    if outer is not None:
        out[OUTER_KIND] = sum(t.untyped_storage().nbytes() for t in outer.state_tensors())
    return out


def collect_stats(engine) -> EngineStats:
    rec = engine.recorder
    step = rec.step - 1
    events = rec.step_events(step)
    colls: dict[str, CollectiveStats] = {}
    compute: dict[str, float] = {}
    for e in events:
        if e.lane == COMM:  # counted when issued; an AllGather of the step may still be in flight
            c = colls.setdefault(e.args["kind"], CollectiveStats(e.args["kind"]))
            c.count += 1
            c.bytes += int(e.args.get("bytes", 0))
            c.sent_bytes += float(e.args.get("sent_bytes", 0.0))
            c.seconds += e.duration if e.end is not None else 0.0
            c.wait_s += float(e.args.get("wait_s", 0.0))
        elif e.lane == COMPUTE and e.end is not None:
            compute[e.name] = compute.get(e.name, 0.0) + e.duration
    return EngineStats(
        stage=engine.stage, rank=engine.rank, world_size=engine.world_size,
        num_params=sum(p.numel() for _, p in engine.named_params),
        param_dtype=str(engine.dtypes.param).replace("torch.", ""),
        step=step, memory=engine_memory(engine), collectives=colls,
        exposed_comm_s=sum(c.wait_s for c in colls.values()), compute_s=compute,
        step_time_s=engine.last_step_time_s,
        nonfinite=asdict(engine.guard.stats()) if getattr(engine, "guard", None) else {},
        layout=engine.checkpoint.layout_cost() if hasattr(engine, "checkpoint") else {},
        outer=engine.outer.describe() if getattr(engine, "outer", None) is not None else {},
    )


# ---- formula vs measured (guide §9) --------------------------------------------------------------
def formula_by_kind(stage: int, num_params: int, world_size: int, fp32_grad_accum: bool,
                    k: float = 12.0, master_bytes: float = 4.0) -> dict[str, float]:
    """The guide's model-state bytes per rank by kind, from the planner's ledger."""
    from zerodp.plan.memory import model_states

    m = model_states(num_params, world_size, stage, k=k, fp32_grad_acc=fp32_grad_accum)
    return {"params": m.param_bytes, "grads": m.grad_bytes + m.grad_acc_bytes,
            "master": m.optimizer_bytes * master_bytes / k,
            "optimizer_states": m.optimizer_bytes * (k - master_bytes) / k,
            "total": m.model_state_bytes}


def compare_table(stats: EngineStats, formula: dict[str, float]) -> str:
    n = stats.num_params
    lines = [f"stage {stats.stage}, N = {stats.world_size}, Ψ = {n:,}",
             f"  {'kind':<18}{'formula':>14}{'measured':>14}{'B/param':>9}{'diff':>10}"]
    rows = [(k, formula[k], stats.memory.get(k, 0)) for k in MODEL_STATE_KINDS]
    rows.append(("model states", formula["total"], stats.model_state_bytes))
    for kind, want, got in rows:
        lines.append(f"  {kind:<18}{fmt_bytes(want):>14}{fmt_bytes(got):>14}{got / n:>9.3f}"
                     f"{(got - want) / max(want, 1) * 100:>9.3f}%")
    return "\n".join(lines)
