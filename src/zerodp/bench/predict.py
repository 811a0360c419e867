"""Predict a training step from a calibration profile, with the planner's simulator.

Closing the loop (guide §13): ``zerodp calibrate`` measured α, W per collective and the model's
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

Compressed and hybrid (guide §14-§15): ``compress`` (a name of ``zerodp.plan.hybrid.COMPRESSIONS``)
prices every collective at the planner's bytes per element on the wire
(:func:`zerodp.plan.hybrid.wire_bytes`: bf16 gradients 2 B, blockwise int8 1 + 4/B B; the int8
gradient all-to-all at the shape of a ReduceScatter, as the planner counts it), with the same
calibrated α and W per collective kind; ``shard_size`` g < N runs the AllGathers and
ReduceScatters over the g ranks of a shard group and adds, after each ReduceScatter, the
AllReduce of its 1/g shard over the N/g replicas. ``wire_bytes`` of the prediction is the
planner's bytes per rank per step by leg (:func:`zerodp.plan.hybrid.step_bytes_per_leg`). The
int8 codec's own work (quantize before, dequantize after each compressed collective) is added to
the step at the rates ``zerodp calibrate`` measured (:func:`quant_time`). On gloo a gradient
ReduceScatter is priced as what the engine runs for it (guide §12.5): at stage 1, which keeps full
gradients, an in-place AllReduce; at stages 2-3 an all-to-all of the slices, which the calibration
times as its ReduceScatter.

and, every stage, the contention: the simulator lets hidden communication cost nothing, which
holds only where it does not share the processor with compute. The profile's measured overlap
efficiency η (:mod:`zerodp.bench.overlap`) charges (1 − η) of the hidden communication's time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zerodp.bench.contenders import Compression
from zerodp.plan.calibrated import compute_times, contention_s, efficiency, optimizer_time
from zerodp.plan.calibrated import (
    PerKindCost,
    gpt_layer_shapes,
    gradient_reduce_kind,
    split_compute,
)
from zerodp.plan.collectives import RingCost
from zerodp.plan.hybrid import COMPRESSIONS, step_bytes_per_leg, wire_bytes
from zerodp.plan.timeline import simulate_backward, simulate_fsdp

FP32_BYTES = 4  # the bench trains in fp32: working parameters and gradients



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
    compress: Compression = Compression.NONE
    shard_size: int | None = None
    wire_bytes: dict | None = None  # planner's bytes per rank per step by leg (intra, inter)
    quant_s: float = 0.0  # the int8 codec's work on this rank (quant_time)

    def to_dict(self) -> dict:
        return asdict(self)


class WireCost:
    """The simulator's cost protocol for compressed and hybrid collectives (module docstring).

    The simulator hands full-precision byte counts (fp32 parameters and gradients); each kind is
    priced at its wire ratio — AllGather at the parameters', ReduceScatter and AllReduce at the
    gradients' — on the calibrated ring of that kind, over g ranks (AllGather, ReduceScatter) or N
    (AllReduce of stage 0), plus the replica AllReduce over N/g after a ReduceScatter."""

    def __init__(self, cal: dict, wire, shard_size: int | None = None, keeps_full: bool = False):
        n = cal["world_size"]
        g = shard_size or n
        fits = {f["kind"]: f for f in cal["fits"]}

        def ring(kind: str, k: int) -> RingCost:
            return RingCost(alpha=fits[kind]["alpha_s"], bandwidth=fits[kind]["bandwidth"], n=k)

        self.g = g
        self.scale = {"all_gather": wire.param_ratio, "reduce_scatter": wire.grad_ratio,
                      "all_reduce": wire.grad_ratio}
        # gloo at stage 1: the gradient ReduceScatter runs as an in-place AllReduce in the shard group
        # (guide §12.5); at stages 2-3 as an all-to-all, the calibration's reduce_scatter
        self.rs_as = gradient_reduce_kind(cal, int8_grads=COMPRESSIONS[wire.compress][2], keeps_full=keeps_full)
        self.rings = {"all_gather": ring("all_gather", g), "reduce_scatter": ring(self.rs_as, g),
                      "all_reduce": ring("all_reduce", n)}
        self.replica = ring("all_reduce", n // g) if n // g > 1 else None

    def time(self, kind: str, nbytes: float) -> float:
        b = nbytes * self.scale[kind]
        t = self.rings[kind].time(self.rs_as if kind == "reduce_scatter" else kind, b)
        if kind == "reduce_scatter" and self.replica is not None:
            t += self.replica.time("all_reduce", b / self.g)
        return t


def root_share(shapes) -> float:
    """The GPT's root FSDP unit as a share of its parameters: the embeddings and the final norm +
    head (:func:`gpt_layer_shapes`' first and last), everything outside the blocks. The engine
    gathers it first in forward and keeps it through backward (guide §10.3)."""
    total = sum(s.params for s in shapes)
    return (shapes[0].params + shapes[-1].params) / total if total and len(shapes) > 1 else 0.0


def predicted_wire_bytes(stage: int, params: float, world: int, compress: Compression = Compression.NONE,
                         shard_size: int | None = None, block: int = 256,
                         kept_last_share: float = 0.0) -> dict[str, float]:
    """Bytes one rank sends per step by leg, from the planner (guide §14): fp32 working bytes
    narrowed by ``compress``. Stage 3 gathers every unit in forward and again in backward but the
    one it keeps (``kept_last_share`` of the parameters, :func:`root_share` for the GPT), as the
    engine does."""
    wire = wire_bytes(compress, FP32_BYTES, FP32_BYTES, block)
    kw = dict(param_bytes=wire.wire_param_bytes, grad_bytes=wire.wire_grad_bytes)
    two = step_bytes_per_leg(stage, params, world, shard_size, gathers_per_step=2, **kw)
    if stage != 3:
        return two
    one = step_bytes_per_leg(stage, params, world, shard_size, gathers_per_step=1, **kw)
    return {k: one[k] + (two[k] - one[k]) * (1.0 - kept_last_share) for k in two}


def predict_step(cal: dict, cfg, stage: int, micro_batch: int, seq_len: int | None = None,
                 bucket_mb: float = 25.0, grad_bytes_per_param: int = 4,
                 world_size: int | None = None, compress: Compression = Compression.NONE,
                 shard_size: int | None = None,
                 block: int = 256) -> Prediction:
    """Predicted step of the GPT ``cfg`` at ``micro_batch`` × ``seq_len`` tokens per rank.

    ``cal`` is the ``calibration`` table of a profile. Compute and optimizer time at this token
    count are interpolated between the calibrated sizes (a fixed part + a part linear in tokens,
    guide §7.1), measured with the ranks in lock-step as in training. ``compress``,
    ``shard_size`` and ``block``: compressed and hybrid collectives (module docstring, guide §14).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    compress = Compression.parse(compress, "compress", optional=False)
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
    if shard_size is not None and (stage == 0 or shard_size < 1 or n % shard_size):
        raise ValueError(f"shard_size {shard_size} must divide the world ({n}) at stages 1-3")
    wire = wire_bytes(compress, FP32_BYTES, FP32_BYTES, block)
    plain = compress is Compression.NONE and (shard_size is None or shard_size == n)
    cost = PerKindCost(cal, stage == 1) if plain else WireCost(cal, wire, shard_size, stage == 1)
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
    codec = quant_time(cal, stage, params, shard_size or n, compress, root_share(shapes))
    step = fwd + bwd + exposed + opt + sync + contention + codec
    sent = predicted_wire_bytes(stage, params, n, compress, shard_size, block, root_share(shapes))
    return Prediction(stage, n, tokens, bucket_bytes, fwd, bwd, exposed, opt, sync, contention, step, comm,
                      compress, shard_size, sent, codec)


def quant_time(cal: dict, stage: int, params: float, g: int, compress: Compression,
               kept_last_share: float = 0.0) -> float:
    """Seconds per step of the int8 codec (guide §15) on each rank, from the calibrated rates
    (``cal["quant"]``, :func:`zerodp.bench.calibrate.measure_quant`; 0 without them or without int8).

    A parameter AllGather quantizes this rank's shard (Ψ/g elements) and dequantizes the gathered
    whole (Ψ): once per step at stages 1-2, twice at stage 3 but for the unit kept through backward
    (``kept_last_share`` of Ψ, as :func:`predicted_wire_bytes`). A gradient reduction quantizes the
    full gradients (Ψ) and dequantizes the g chunks it receives (Ψ in all). The codec runs on the
    cores that compute, so it adds to the step."""
    rates = cal.get("quant")
    if not rates or compress not in COMPRESSIONS:
        return 0.0
    _, q_params, q_grads = COMPRESSIONS[compress]
    tq, td = rates["quantize_s_per_elem"], rates["dequantize_s_per_elem"]
    gathers = 0.0
    if q_params and stage >= 1:
        gathers = 2.0 - kept_last_share if stage == 3 else 1.0
    t = gathers * (params / g * tq + params * td)
    if q_grads and stage >= 1:
        t += params * (tq + td)
    return t


def predictions_table(preds: list[Prediction]) -> str:
    lines = [f"{'stage':>5} {'tokens/rank':>11} {'forward':>9} {'backward':>9} {'exposed':>9} "
             f"{'optimizer':>9} {'param AG':>9} {'contention':>10} {'step':>9}   (ms)"]
    wide = any(p.compress is not Compression.NONE or p.shard_size for p in preds)
    if wide:
        lines[0] = (f"{'stage':>5} {'compress':<12}{'g':>3} {'tokens/rank':>11} {'forward':>9} {'backward':>9} "
                    f"{'exposed':>9} {'optimizer':>9} {'param AG':>9} {'contention':>10} {'step':>9}   (ms)"
                    f"{'sent MiB/step intra + inter':>30}")
    for p in preds:
        head = f"{p.stage:>5} "
        if wide:
            head += f"{p.compress:<12}{p.shard_size or p.world_size:>3} "
        line = (f"{head}{p.tokens_per_rank:>11} {p.forward_s * 1e3:>9.1f} "
                f"{p.backward_s * 1e3:>9.1f} {p.exposed_comm_s * 1e3:>9.1f} "
                f"{p.optimizer_s * 1e3:>9.1f} {p.param_sync_s * 1e3:>9.1f} "
                f"{p.contention_s * 1e3:>10.1f} {p.step_s * 1e3:>9.1f}")
        if wide:
            w = p.wire_bytes or {}
            line += f"{w.get('intra', 0) / 2**20:>22.2f} + {w.get('inter', 0) / 2**20:.2f}"
        lines.append(line)
    return "\n".join(lines)
