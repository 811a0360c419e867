"""Predict a training step from a calibration profile, with the planner's simulator.

Closing the loop (guide §12): ``zerodp calibrate`` measured α, W per collective and the model's
compute on this machine; here the planner's event simulation (guide §4 for buckets, §9.3/§10.2
for FSDP units) turns them into a predicted step per stage, which ``zerodp bench`` prints next to
the measured one.

The model is cut into the simulator's layers in forward order — embeddings, each block, the
final norm + head — with each layer's share of the measured forward and backward time in
proportion to its FLOPs (2·P·tokens forward, 4·P·tokens backward for P weights used in a matmul,
plus attention's scores 4·T²·d per sequence forward; the embedding lookup costs none), and its
gradient bytes from its parameter count and the gradient dtype.

Per stage (what the engine does, see ``zerodp.engine``):

- stage 0: forward + backward + the AllReduce tail exposed after backward (bucketed) + the
  optimizer over all Ψ parameters;
- stages 1, 2: the ReduceScatter tail after backward + the optimizer over Ψ/N + the parameter
  AllGather, which runs alongside the next buckets' updates: max(optimizer, AllGather);
- stage 3: the FSDP simulation (per-unit AllGather with prefetch, ReduceScatter per unit, the
  kept last unit) + the optimizer over Ψ/N;

and, every stage, the contention: the simulator lets hidden communication cost nothing, which
holds only where it does not share the processor with compute. The profile's measured overlap
efficiency η (:mod:`zerodp.bench.overlap`) charges (1 − η) of the hidden communication's time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zerodp.bench.compute import compute_times, optimizer_time
from zerodp.bench.overlap import contention_s, efficiency
from zerodp.plan.calibrated import LayerShape, PerKindCost, gpt_layer_shapes, split_compute  # noqa: F401
from zerodp.plan.timeline import simulate_backward, simulate_fsdp



@dataclass(frozen=True)
class Prediction:
    stage: int
    world_size: int
    tokens_per_rank: int
    bucket_bytes: float
    forward_s: float
    backward_s: float
    exposed_comm_s: float
    optimizer_s: float
    param_sync_s: float  # stages 1-2: AllGather of updated params not hidden by the update
    contention_s: float  # (1 − η) of the communication hidden under compute (bench.overlap)
    step_s: float
    comm_s: float  # total time of all collectives of the step

    def to_dict(self) -> dict:
        return asdict(self)


def predict_step(cal: dict, cfg, stage: int, micro_batch: int, seq_len: int | None = None,
                 bucket_mb: float = 25.0, grad_bytes_per_param: int = 4,
                 world_size: int | None = None) -> Prediction:
    """Predicted step of the GPT ``cfg`` at ``micro_batch`` × ``seq_len`` tokens per rank.

    ``cal`` is the ``calibration`` table of a profile. Compute and optimizer time at this token
    count are interpolated between the calibrated sizes (a fixed part + a part linear in tokens,
    guide §7.1), measured with the ranks in lock-step as in training.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    n = world_size or cal["world_size"]
    if n != cal["world_size"]:
        raise ValueError(f"profile was calibrated on {cal['world_size']} ranks; predict for that many")
    seq = seq_len or cfg.seq_len
    tokens = micro_batch * seq
    comp = cal["compute"]
    shapes = gpt_layer_shapes(cfg, seq)
    params = sum(s.params for s in shapes)
    layers = split_compute(shapes, tokens, *compute_times(comp, tokens), grad_bytes_per_param)
    fwd = sum(l.forward_s for l in layers)
    bwd = sum(l.backward_s for l in layers)
    opt_full = optimizer_time(comp, tokens, params)
    cost = PerKindCost(cal)
    bucket_bytes = bucket_mb * 2**20
    if stage == 0:
        tl = simulate_backward(layers, cost, bucket_bytes, "all_reduce", split_layers=False)
        exposed, opt, sync, comm = tl.exposed_comm_s, opt_full, 0.0, tl.comm_s
    elif stage in (1, 2):
        tl = simulate_backward(layers, cost, bucket_bytes, "reduce_scatter", split_layers=False)
        opt = opt_full / n
        gather = sum(cost.time("all_gather", b.nbytes) for b in tl.buckets())
        sync = max(0.0, gather - opt)
        exposed, comm = tl.exposed_comm_s, tl.comm_s + gather
    else:
        tl = simulate_fsdp(layers, cost, prefetch=True, keep_last=True)
        exposed, opt, sync, comm = tl.exposed_comm_s, opt_full / n, 0.0, tl.comm_s
    # What the simulator hid under compute still costs (1 − η) of its time where communication
    # and compute share the processor (measured by zerodp calibrate, bench.overlap).
    contention = contention_s(comm - exposed - sync, efficiency(cal))
    step = fwd + bwd + exposed + opt + sync + contention
    return Prediction(stage, n, tokens, bucket_bytes, fwd, bwd, exposed, opt, sync, contention, step, comm)


def predictions_table(preds: list[Prediction]) -> str:
    lines = [f"{'stage':>5} {'tokens/rank':>11} {'forward':>9} {'backward':>9} {'exposed':>9} "
             f"{'optimizer':>9} {'param AG':>9} {'contention':>10} {'step':>9}   (ms)"]
    for p in preds:
        lines.append(f"{p.stage:>5} {p.tokens_per_rank:>11} {p.forward_s * 1e3:>9.1f} "
                     f"{p.backward_s * 1e3:>9.1f} {p.exposed_comm_s * 1e3:>9.1f} "
                     f"{p.optimizer_s * 1e3:>9.1f} {p.param_sync_s * 1e3:>9.1f} "
                     f"{p.contention_s * 1e3:>10.1f} {p.step_s * 1e3:>9.1f}")
    return "\n".join(lines)
