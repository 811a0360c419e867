"""Past one node: hybrid sharding and compressed collectives (guide §14).

Two levers move the bandwidth term of a step once it spans nodes.

**Hybrid sharding** (shard-group size g). The N ranks form R = N/g replicas of g-rank shard groups
(ranks ``[i·g, (i+1)·g)`` are one group; the R ranks holding the same shard index form a replica
group). Stages 1–3 shard inside the shard group only, so model-state memory per GPU is the
guide §9 formula with N replaced by g. Per optimizer step:

=========  =====================================================================================
stage      collectives of one rank (V = Ψ·bytes of what moves)
=========  =====================================================================================
0          one AllReduce of Ψ·b_g over all N ranks (hybrid sharding changes nothing: plain DP)
1, 2       ReduceScatter of Ψ·b_g over g, AllReduce of Ψ/g·b_g over R, AllGather of Ψ·b_p over g
3          ``gathers_per_step`` AllGathers of Ψ·b_p over g (forward, again in backward), then the
           ReduceScatter over g and AllReduce over R of stages 1–2
=========  =====================================================================================

g = N is flat sharding (guide §9): R = 1 and the AllReduce over replicas vanishes.

**Compression** (bytes per element on the wire, :func:`wire_bytes`): ``bf16-reduce`` sends
gradients in 2 bytes whatever the parameters are; ``int8-params`` quantizes every parameter
AllGather blockwise to int8 with one fp32 scale per block of B elements (ZeRO++ "qwZ"),
1 + 4/B bytes per element; ``int8-grads`` reduces gradients as int8 chunks plus scales, exchanged
all-to-all and summed in fp32 by the rank that owns the chunk (ZeRO++ "qgZ"): per rank
(k−1)/k·Ψ·(1 + 4/B) bytes, the shape of a ReduceScatter at 1 + 4/B bytes per element; an
AllReduce of gradients (stage 0, the replica AllReduce) is that exchange followed by an int8
AllGather of the reduced chunks, 2(k−1)/k·Ψ·(1 + 4/B) — the engine does that exchange inside a
shard group only: under hybrid sharding the averaged 1/g shard crosses the replicas in the reduce
dtype (:attr:`Wire.wire_replica_grad_bytes`), and at stage 0 it offers bf16-reduce only. ``int8``
is both. Compression never widens
the wire: a 1-byte fp8 parameter is not "compressed" to 1 + 4/B bytes.

Placement on hardware (:func:`step_comm`): a shard group of g ≤ GPUs per node p runs on NVLink;
g > p must fill whole nodes (a multiple of p) and its collectives take the two legs of
:func:`~zerodp.plan.collectives.network_cost`; g < p must divide p, so no group straddles nodes.
When the N ranks span nodes the replica AllReduce crosses the NICs: each node's p GPUs run their
replica rings at once, min(g, p) of them through one node's egress, so each ring gets
inter_bw/min(g, p) (with g < p the ring's hops inside a node are faster and not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerodp.plan._common import InputError, ToDict, check_count, check_positive
from zerodp.plan.collectives import RingCost, bus_factor, network_cost
from zerodp.plan.hardware import Hardware, get_hardware
from zerodp.plan._common import BF16
from zerodp.plan.memory import (ADAM_K, FP32, PRECISIONS, ModelStates, check_shard_size,  # noqa: F401
                                model_states)
from zerodp.plan.units import STAGE_NAMES, STAGES

#: elements that share one fp32 scale in blockwise int8 quantization (ZeRO++ uses 256-2048)
QUANT_BLOCK = 256
#: one fp32 scale per block
SCALE_BYTES = FP32
INT8 = 1
#: --compress choices: which of the two wires (parameters, gradients) each one narrows
COMPRESSIONS = {
    "none": (False, False, False),           # (bf16 gradients, int8 parameters, int8 gradients)
    "bf16-reduce": (True, False, False),
    "int8-params": (False, True, False),
    "int8-grads": (False, False, True),
    "int8": (False, True, True),
}
COMPRESSION_ABOUT = {
    "none": "parameters and gradients travel in their working precision",
    "bf16-reduce": "gradients travel in bf16 (2 bytes) whatever the parameters are",
    "int8-params": "parameter AllGathers in blockwise int8 + one fp32 scale per block (ZeRO++ qwZ)",
    "int8-grads": "gradient reduction in blockwise int8 + scales, all-to-all, fp32 sums (ZeRO++ qgZ)",
    "int8": "int8-params and int8-grads",
}


def int8_bytes(block: int = QUANT_BLOCK) -> float:
    """Bytes per element of a blockwise-int8 tensor: 1 + 4/B (guide §14)."""
    return INT8 + SCALE_BYTES / check_count("block (elements per int8 scale)", block)


@dataclass(frozen=True)
class Wire(ToDict):
    """Bytes per element on the wire (guide §14). ``to_dict()`` keys: ``compress``, ``block``,
    ``param_bytes`` (working parameter), ``grad_bytes`` (working gradient), ``wire_param_bytes``
    (what a parameter AllGather moves per element), ``wire_grad_bytes`` (what a gradient
    reduction moves per element), ``param_ratio`` and ``grad_ratio`` (wire / working)."""

    compress: str
    block: int
    param_bytes: float
    grad_bytes: float
    wire_param_bytes: float
    wire_grad_bytes: float
    param_ratio: float
    grad_ratio: float
    #: the replica AllReduce of hybrid sharding: int8 only inside the shard group's exchange; the
    #: averaged shard crosses the replicas in the reduce dtype (2 bytes with bf16-reduce)
    wire_replica_grad_bytes: float = 0.0


def wire_bytes(compress: str = "none", param_bytes: float = BF16, grad_bytes: float = BF16,
               block: int = QUANT_BLOCK) -> Wire:
    """The bytes per element each collective of a step moves under ``compress`` (guide §14)."""
    if compress not in COMPRESSIONS:
        raise InputError(f"compress must be one of {', '.join(COMPRESSIONS)}; got {compress!r}",
                         "compress", f"压缩方式必须是 {'、'.join(COMPRESSIONS)} 之一，收到的是 {compress!r}")
    check_positive("param_bytes", param_bytes)
    check_positive("grad_bytes", grad_bytes)
    bf16_grads, q_params, q_grads = COMPRESSIONS[compress]
    q = int8_bytes(block)
    wp = min(param_bytes, q) if q_params else param_bytes
    wg = min(grad_bytes, q) if q_grads else (min(grad_bytes, BF16) if bf16_grads else grad_bytes)
    wr = min(grad_bytes, BF16) if bf16_grads else grad_bytes
    return Wire(compress, block, param_bytes, grad_bytes, wp, wg, wp / param_bytes, wg / grad_bytes, wr)


def check_placement(hw: Hardware, g: int) -> None:
    """Shard groups must not straddle nodes: g divides the GPUs per node p, or is a multiple of it."""
    p = hw.devices_per_node
    if (g < p and p % g) or (g > p and g % p):
        raise InputError(f"a shard group of {g} GPUs straddles nodes of {p} on {hw.name}: choose a "
                         f"divisor or a multiple of {p}", "shard_size",
                         f"{g} 张卡的分片组跨越了 {hw.name} 每节点 {p} 张卡的边界：请选 {p} 的约数或倍数")


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCollective(ToDict):
    """One collective of a step as one rank sees it: ``kind``, ``group`` ("all": the N ranks,
    "shard": the g ranks of a shard group, "replica": the R ranks holding one shard), ``ranks``,
    ``nbytes`` (V, the full buffer), ``count`` (how many per step), ``leg`` ("intra": inside the
    shard group, "inter": across it) and ``bytes_per_rank`` (count × ring factor × V)."""

    kind: str
    group: str
    ranks: int
    nbytes: float
    count: int
    leg: str
    bytes_per_rank: float


def step_collectives(stage: int, numel: float, world: int, shard_size: int | None = None, *,
                     param_bytes: float = FP32, grad_bytes: float = FP32,
                     gathers_per_step: int = 2, replica_grad_bytes: float | None = None) -> list[StepCollective]:
    """The collectives one rank runs per optimizer step (guide §14; the table in the module
    docstring), each with the bytes it sends in a ring. Flat (``shard_size`` None or ``world``):
    everything over ``world`` ranks, leg "intra"."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0 (DP), 1, 2, 3 (ZeRO-1/2/3); got {stage!r}")
    check_positive("numel", numel, allow_zero=True)
    check_positive("param_bytes", param_bytes)
    check_positive("grad_bytes", grad_bytes)
    gathers = check_count("gathers_per_step", gathers_per_step, minimum=0)
    n = check_count("world", world)
    g = check_shard_size(n, shard_size)
    flat = g == n
    grads, params = numel * grad_bytes, numel * param_bytes

    def op(kind, group, k, nbytes, leg, count=1):
        return StepCollective(kind, group, k, float(nbytes), count, leg,
                              float(count * bus_factor(kind, k) * nbytes))

    if stage == 0:
        return [op("all_reduce", "all", n, grads, "intra" if flat else "inter")]
    group, leg = ("all", "intra") if flat else ("shard", "intra")
    out = []
    if stage == 3:
        out.append(op("all_gather", group, g, params, leg, gathers))
    out.append(op("reduce_scatter", group, g, grads, leg))
    if not flat:
        replica = grads if replica_grad_bytes is None else numel * replica_grad_bytes
        out.append(op("all_reduce", "replica", n // g, replica / g, "inter"))
    if stage in (1, 2):
        out.append(op("all_gather", group, g, params, leg))
    return out


def step_bytes_per_leg(stage: int, numel: int, world: int, shard_size: int | None = None, *,
                       param_bytes: float = 4, grad_bytes: float = 4, gathers_per_step: int = 2,
                       replica_grad_bytes: float | None = None) -> dict[str, float]:
    """Bytes ONE rank sends per optimizer step (one synchronizing backward), ring algorithm, by
    leg: ``{"intra": ..., "inter": ...}`` (guide §14). ``numel`` = padded elements of the model's
    flat buffers (Ψ); ``param_bytes``/``grad_bytes``: bytes per element of what the parameter
    AllGathers and the gradient reductions move (compression: :func:`wire_bytes`).

    A ring collective over k ranks on a V-byte full buffer sends per rank: AllReduce 2(k−1)/k·V,
    ReduceScatter (k−1)/k·V, AllGather (k−1)/k·V.

    * Flat (``shard_size`` None or == ``world``): every collective runs over the ``world`` ranks
      and all its bytes are reported under "intra"; "inter" is 0. Stage 0: one AllReduce of
      Ψ·grad_bytes; stages 1–2: ReduceScatter of Ψ·grad_bytes + AllGather of Ψ·param_bytes;
      stage 3: ``gathers_per_step`` AllGathers of Ψ·param_bytes + one ReduceScatter.
    * Hybrid (g = ``shard_size`` < ``world``, g must divide it; R = world/g): stage 0 is plain
      DP, one AllReduce of Ψ·grad_bytes over all ``world`` ranks, counted as "inter"; stages 1–2:
      ReduceScatter over g of Ψ·grad_bytes ("intra") + AllReduce over R of Ψ/g·grad_bytes
      ("inter") + AllGather over g of Ψ·param_bytes ("intra"); stage 3: ``gathers_per_step``
      AllGathers over g of Ψ·param_bytes ("intra") + the ReduceScatter and AllReduce of
      stages 1–2.
    """
    out = {"intra": 0.0, "inter": 0.0}
    for c in step_collectives(stage, numel, world, shard_size, replica_grad_bytes=replica_grad_bytes,
                              param_bytes=param_bytes,
                              grad_bytes=grad_bytes, gathers_per_step=gathers_per_step):
        out[c.leg] += c.bytes_per_rank
    return out


# ---------------------------------------------------------------------------------------------
def hybrid_model_states(params: float, n: int, stage: int, shard_size: int | None = None,
                        k: float = ADAM_K, fp32_grad_acc: bool = False, unit_params: float = 0.0,
                        layers: int | None = None, param_bytes: float = BF16,
                        grad_bytes: float = BF16) -> ModelStates:
    """Model-state bytes per GPU under hybrid sharding (guide §14): :func:`~zerodp.plan.memory.model_states`
    with N replaced by the shard-group size g (``None``: g = n, flat). The result's ``n`` is g,
    the ranks a state is divided among."""
    g = check_shard_size(n, shard_size)
    return model_states(params, g, stage, k, fp32_grad_acc, unit_params, layers, param_bytes,
                        grad_bytes)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CollectiveLegs(ToDict):
    """One collective of a step on hardware: the :class:`StepCollective` fields plus
    ``intra_bytes`` (bytes each GPU sends over NVLink), ``inter_bytes`` (each GPU's share of its
    node's NIC egress: node bytes / GPUs per node), ``intra_s`` and ``inter_s`` (each leg's time,
    latency + bandwidth; 0 for a leg not used), ``time_s`` (the slower leg) and ``bottleneck``."""

    kind: str
    group: str
    ranks: int
    nbytes: float
    count: int
    bytes_per_rank: float
    intra_bytes: float
    inter_bytes: float
    intra_s: float
    inter_s: float
    time_s: float
    bottleneck: str


@dataclass(frozen=True)
class StepComm(ToDict):
    """Communication of one optimizer step on hardware (guide §14). ``to_dict()`` keys:
    ``hardware``, ``stage``, ``stage_name``, ``params`` (Ψ), ``n``, ``shard_size`` (g),
    ``replicas`` (R = n/g), ``gpus_per_node``, ``wire`` (:class:`Wire`), ``gathers_per_step``,
    ``collectives`` (:class:`CollectiveLegs` dicts), ``intra_bytes`` and ``inter_bytes`` (sums:
    NVLink bytes per GPU, NIC bytes per GPU), ``intra_s`` and ``inter_s`` (each leg's time, summed
    over the step's collectives), ``time_s`` (the slower leg's sum: the two legs are separate
    links and a bucketed step keeps both busy at once, as one two-leg collective does, guide §7.2;
    nothing is overlapped with compute), ``bottleneck`` ("intra"/"inter") and ``ring_bytes``
    (:func:`step_bytes_per_leg`: bytes per rank by group, the engine's convention)."""

    hardware: str
    stage: int
    stage_name: str
    params: float
    n: int
    shard_size: int
    replicas: int
    gpus_per_node: int
    wire: dict
    gathers_per_step: int
    collectives: list = field(default_factory=list)
    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    intra_s: float = 0.0
    inter_s: float = 0.0
    time_s: float = 0.0
    bottleneck: str = "intra"
    ring_bytes: dict = field(default_factory=dict)


def _on_hardware(c: StepCollective, hw: Hardware, n: int, g: int) -> CollectiveLegs:
    """Price one collective on ``hw``: NVLink and NIC legs (module docstring)."""
    p = hw.devices_per_node
    if c.group == "replica":
        if n <= p:  # every replica in one node
            legs = [("intra", RingCost(hw.alpha, hw.intra_bw, c.ranks), 1.0)]
        else:
            share = min(g, p)
            legs = [("inter", RingCost(hw.node_alpha, hw.inter_bw / share, c.ranks), share / p)]
    else:  # a group of contiguous ranks filling nodes: the two legs of network_cost
        cost = network_cost(hw, c.ranks)
        legs = [("intra", cost.intra, 1.0)]
        if cost.inter is not None and cost.inter.n > 1:
            legs.append(("inter", cost.inter, 1.0 / p))
    bytes_, times = {"intra": 0.0, "inter": 0.0}, {"intra": 0.0, "inter": 0.0}
    for name, ring, scale in legs:
        bytes_[name] += c.count * bus_factor(c.kind, ring.n) * c.nbytes * scale
        times[name] += c.count * ring.time(c.kind, c.nbytes)
    slow = max(times, key=times.get)
    return CollectiveLegs(c.kind, c.group, c.ranks, c.nbytes, c.count, c.bytes_per_rank,
                          bytes_["intra"], bytes_["inter"], times["intra"], times["inter"],
                          times[slow], slow if len(legs) > 1 else legs[0][0])


def check_groups(hw: Hardware, n: int, shard_size: int | None, precision: str) -> tuple[int, dict]:
    """The shard-group size g for ``n`` GPUs of ``hw`` (checked to divide n and to sit on the
    nodes, :func:`check_placement`) and the byte sizes of ``precision``, or one sentence saying what is wrong."""
    g = check_shard_size(n, shard_size)
    if g < n:
        check_placement(hw, g)
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}",
                         "precision")
    return g, PRECISIONS[precision]


def step_comm(hardware: Hardware | str, n: int, stage: int, params: float,
              shard_size: int | None = None, precision: str = "bf16", compress: str = "none",
              block: int = QUANT_BLOCK, gathers_per_step: int = 2) -> StepComm:
    """Bytes and time of one step's collectives per GPU, by leg (guide §14), for Ψ = ``params``
    on ``n`` GPUs of ``hardware`` with shard groups of ``shard_size`` (None: flat)."""
    hw = get_hardware(hardware)
    check_positive("params", params)
    n = check_count("n (data-parallel GPUs)", n)
    network_cost(hw, n)  # one sentence when n does not fit this hardware's network
    g, prec = check_groups(hw, n, shard_size, precision)
    wire = wire_bytes(compress, prec["param_bytes"], prec["grad_bytes"], block)
    ops = step_collectives(stage, params, n, g, param_bytes=wire.wire_param_bytes,
                           grad_bytes=wire.wire_grad_bytes, gathers_per_step=gathers_per_step,
                           replica_grad_bytes=wire.wire_replica_grad_bytes)
    priced = [_on_hardware(c, hw, n, g) for c in ops]
    ring = {"intra": 0.0, "inter": 0.0}
    for c in ops:
        ring[c.leg] += c.bytes_per_rank
    intra_s, inter_s = sum(c.intra_s for c in priced), sum(c.inter_s for c in priced)
    return StepComm(
        hardware=hw.name, stage=stage, stage_name=STAGE_NAMES[stage], params=params, n=n,
        shard_size=g, replicas=n // g, gpus_per_node=hw.devices_per_node, wire=wire.to_dict(),
        gathers_per_step=gathers_per_step, collectives=[c.to_dict() for c in priced],
        intra_bytes=sum(c.intra_bytes for c in priced), inter_bytes=sum(c.inter_bytes for c in priced),
        intra_s=intra_s, inter_s=inter_s, time_s=max(intra_s, inter_s),
        bottleneck="inter" if inter_s > intra_s else "intra", ring_bytes=ring)
