"""Replica groups that talk rarely: DiLoCo and Streaming DiLoCo over hybrid ZeRO (guide §16).

The N = R·g ranks form R replica groups of g ranks (the shard groups of :mod:`zerodp.plan.hybrid`:
ranks ``[i·g, (i+1)·g)`` are group i; the R ranks with the same shard index are a replica
group). Each group trains alone at stage s for H inner steps, then the groups average the
*pseudo-gradient* Δ = θ_outer − θ_local and an outer Nesterov SGD moves θ_outer.

What one rank sends (the engine's accounting; Ψ the padded flat numel, b_d the pseudo-gradient's
bytes per element on the wire: 4 in fp32, 1 + 4/B in blockwise int8, B = ``QUANT_BLOCK``):

* **inner step**: stage s over the shard group only, :func:`~zerodp.plan.hybrid.step_bytes_per_leg`
  flat over g; nothing crosses the groups;
* **outer sync**, once per H inner steps per fragment: an AllReduce over the R replica peers of the
  rank's own shard of Δ, 2(R−1)/R · Ψ/g · b_d (int8: the int8 exchange and the int8 AllGather of
  an int8 AllReduce, guide §14.4); at stage 0 the new parameters are then AllGathered inside the
  shard group, (g−1)/g · 4Ψ;
* **fragments** (Streaming DiLoCo): the flat buffer is cut into F contiguous fragments; fragment f
  syncs at the inner steps k (k = 1, 2, ...) where (k − o_f) mod H = 0, o_f = ⌊f·H/F⌋
  (:func:`fragment_offsets`). Per step on average a rank sends the sync's bytes over H; the
  busiest step carries the largest fragment's share (1/F of it for equal fragments);
* **delay** τ: the exchange runs behind τ inner steps of compute, and hides up to τ inner-step
  compute times of the fragment's exchange;
* **outer state** per rank: θ_outer and the momentum buffer in fp32, 8Ψ/g bytes (4Ψ/g without
  momentum).

The inter-group link (:func:`group_link`) is priced as the bench's simulated link: a collective
over k ranks costs ``latency · ring steps + bytes sent per rank / bandwidth`` (2(k−1) steps for an
AllReduce). DDP runs its one AllReduce over all N ranks on that link; hybrid ZeRO its replica
AllReduce of the 1/g shard over R on it and the rest inside the group on the hardware's own links
(:func:`~zerodp.plan.hybrid.step_comm` over g); DiLoCo the inner step inside the group and the
fragment exchanges on the link. Cross-group collectives are exposed unless ``hidden_s`` (DDP and
hybrid ZeRO: the compute they run behind) or τ (DiLoCo) hides them; the outer step's own work is
:data:`OUTER_STEP_BYTES` per shard element at HBM bandwidth unless measured (``outer_s``).

The **crossover bandwidth** (:func:`crossover`) is the inter-group bandwidth below which DiLoCo's
average step is faster than hybrid ZeRO's at the same stage: in x = 1/W the difference of the two
step times is a sum of hinge terms max(0, p + q·x), linear between breakpoints, solved exactly
piece by piece; :func:`crossover_bisection` finds the same figure from the step times alone.
With τ = 0, nothing hidden and equal fragments (guide §16):

    W* = 2(R−1)/R · Ψ/g · (b_h − b_d/H) / (K − 2(R−1)·α·(1 − F/H)),

b_h the replica AllReduce's bytes per element, α the link's latency per ring step and K the
outer step's local time per inner step; a denominator ≤ 0 means DiLoCo's step is faster at every
bandwidth. What DiLoCo costs in loss is read from measurements only (:func:`measured_loss`,
``diloco_loss.json``), never predicted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from zerodp.plan._common import InputError, ToDict, check_count, check_positive
from zerodp.plan.collectives import bus_factor, network_cost, ring_steps
from zerodp.plan.hardware import Hardware, get_hardware, sustained
from zerodp.plan.hybrid import QUANT_BLOCK, check_groups, int8_bytes, step_bytes_per_leg, step_comm
from zerodp.plan.memory import check_shard_size
from zerodp.plan.units import STAGE_NAMES, STAGES

#: bytes per element of the fp32 pseudo-gradient, outer parameters and momentum
FP32 = 4
#: compressions of the pseudo-gradient exchange
OUTER_COMPRESSIONS = ("none", "int8")
#: HBM bytes one outer step moves per element of the rank's shard, fp32: Δ = θ_outer − θ_local
#: (read 2, write 1), the momentum (read 2, write 1), θ_outer (read 3, write 1), θ_local = θ_outer
#: (read 1, write 1): 16 passes of 4 bytes, fused to 8 — an estimate; ``outer_s`` takes a
#: measured time instead
OUTER_STEP_BYTES = 8 * FP32
#: the measured loss of DiLoCo against DDP at equal tokens (schema in the file)
LOSS_TABLE = Path(__file__).with_name("diloco_loss.json")
#: bandwidths the bisection searches, bytes/s per GPU (1 mB/s to 1 EB/s)
BISECT_RANGE = (1e-3, 1e18)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiLoCoSettings(ToDict):
    """The outer loop (guide §16), as ``zerodp.DiLoCo`` takes it: ``every`` (H, inner steps between
    a fragment's syncs), ``fragments`` (F, 1 ≤ F ≤ H), ``compress`` ("none": fp32, "int8":
    blockwise int8 with one fp32 scale per ``block`` elements), ``delay`` (τ inner steps the
    exchange runs behind, 0 ≤ τ < H), ``lr``, ``momentum``, ``nesterov`` (the outer SGD)."""

    every: int
    fragments: int = 1
    compress: str = "none"
    delay: int = 0
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    block: int = QUANT_BLOCK

    def __post_init__(self):
        every = check_count("every (H, inner steps per outer step)", self.every)
        fragments = check_count("fragments (F)", self.fragments)
        if fragments > every:
            raise InputError(f"fragments (F = {fragments}) must be at most every (H = {every}): each "
                             "fragment syncs at its own inner step", "fragments",
                             f"分段数 F = {fragments} 不能超过 H = {every}：每段在各自的内步同步")
        compress = "none" if self.compress is None else str(self.compress)
        if compress not in OUTER_COMPRESSIONS:
            raise InputError(f"compress must be one of {', '.join(OUTER_COMPRESSIONS)} for the "
                             f"pseudo-gradient exchange; got {self.compress!r}", "compress")
        delay = check_count("delay (τ, inner steps)", self.delay, minimum=0)
        if delay >= every:
            raise InputError(f"delay (τ = {delay}) must be below every (H = {every}): a fragment's "
                             "exchange must land before its next sync", "delay")
        check_positive("lr (outer learning rate)", self.lr)
        if not 0 <= self.momentum < 1:
            raise InputError(f"momentum must be in [0, 1), got {self.momentum!r}", "momentum")
        check_count("block (elements per int8 scale)", self.block)
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "fragments", fragments)
        object.__setattr__(self, "compress", compress)
        object.__setattr__(self, "delay", delay)

    @property
    def wire_bytes(self) -> float:
        """b_d: bytes per pseudo-gradient element on the wire, 4 (fp32) or 1 + 4/B (int8)."""
        return int8_bytes(self.block) if self.compress == "int8" else float(FP32)

    def label(self) -> str:
        """"H = 100, F = 4, int8, τ = 2" (what the tables print)."""
        parts = [f"H = {self.every}"]
        if self.fragments > 1:
            parts.append(f"F = {self.fragments}")
        parts.append("int8" if self.compress == "int8" else "fp32")
        if self.delay:
            parts.append(f"τ = {self.delay}")
        return ", ".join(parts)


def fragment_offsets(every: int, fragments: int) -> list[int]:
    """o_f = ⌊f·H/F⌋: fragment f syncs at the inner steps k with (k − o_f) mod H = 0 (guide §16)."""
    return [f * every // fragments for f in range(fragments)]


def fragments_due(step: int, every: int, fragments: int) -> list[int]:
    """The fragments that sync after inner step ``step`` (1, 2, ...)."""
    return [f for f, o in enumerate(fragment_offsets(every, fragments)) if (step - o) % every == 0]


def fragment_numels(numel: float, fragments: int, sizes=None) -> list[float]:
    """Elements of each fragment: ``sizes`` as given (they must add up to ``numel``; the engine
    cuts by units), else F equal parts."""
    if sizes is None:
        return [numel / fragments] * fragments
    sizes = [check_positive("fragment size", float(s)) for s in sizes]
    if len(sizes) != fragments or not math.isclose(sum(sizes), numel, rel_tol=1e-9):
        raise InputError(f"fragment sizes must be {fragments} numbers adding up to {numel:g}; got "
                         f"{len(sizes)} adding up to {sum(sizes):g}", "fragment_sizes")
    return sizes


def outer_state_bytes(numel: float, shard_size: int, momentum: float = 0.9) -> float:
    """θ_outer (and the momentum buffer when momentum > 0) in fp32 over the rank's shard:
    8Ψ/g bytes, 4Ψ/g without momentum (guide §16)."""
    return (2 if momentum > 0 else 1) * FP32 * numel / shard_size


def sync_bytes(numel: float, replicas: int, shard_size: int, wire_bytes: float) -> float:
    """Bytes one rank sends to sync ``numel`` elements of the flat buffer: an AllReduce of its
    1/g shard over the R replica peers, 2(R−1)/R · Ψ/g · b_d (guide §16)."""
    return bus_factor("all_reduce", replicas) * numel / shard_size * wire_bytes


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiLoCoBytes(ToDict):
    """Bytes one rank sends per inner step (guide §16). ``to_dict()`` keys: ``numel`` (Ψ, padded),
    ``world`` (N), ``shard_size`` (g), ``replicas`` (R), ``stage``, ``settings``
    (:class:`DiLoCoSettings`), ``wire_bytes_per_element`` (b_d), ``shard_numel`` (Ψ/g),
    ``fragment_numels`` (each fragment, whole buffer), ``fragment_offsets`` (o_f),
    ``sync_cross_bytes`` (one sync of every fragment), ``fragment_cross_bytes`` (each fragment's
    sync), ``cross_bytes_per_step`` (average: the sync over H), ``peak_cross_bytes_per_step`` (the
    largest fragment), ``sync_intra_bytes`` (stage 0's AllGather after a full sync),
    ``inner_intra_bytes_per_step`` (the inner step's shard-group collectives),
    ``intra_bytes_per_step`` (that plus the sync's intra bytes over H), ``outer_state_bytes``,
    ``grad_bytes`` (DDP's and hybrid ZeRO's gradient bytes per element),
    ``ddp_cross_bytes_per_step``, ``hybrid_cross_bytes_per_step`` (per step, across the groups),
    ``ddp_ratio`` and ``hybrid_ratio`` (their cross-group bytes over DiLoCo's; null with one
    group)."""

    numel: float
    world: int
    shard_size: int
    replicas: int
    stage: int
    settings: dict
    wire_bytes_per_element: float
    shard_numel: float
    fragment_numels: list
    fragment_offsets: list
    sync_cross_bytes: float
    fragment_cross_bytes: list
    cross_bytes_per_step: float
    peak_cross_bytes_per_step: float
    sync_intra_bytes: float
    inner_intra_bytes_per_step: float
    intra_bytes_per_step: float
    outer_state_bytes: float
    grad_bytes: float
    ddp_cross_bytes_per_step: float
    hybrid_cross_bytes_per_step: float
    ddp_ratio: float | None
    hybrid_ratio: float | None


def _settings(settings=None, **kw) -> DiLoCoSettings:
    if isinstance(settings, DiLoCoSettings):
        return settings
    if isinstance(settings, dict):
        return DiLoCoSettings(**settings)
    return DiLoCoSettings(**kw)


def diloco_bytes(numel: float, world: int, shard_size: int, settings: DiLoCoSettings | dict,
                 stage: int = 3, *, param_bytes: float = FP32, grad_bytes: float = FP32,
                 gathers_per_step: int = 2, fragment_sizes=None) -> DiLoCoBytes:
    """What one rank sends per inner step under DiLoCo, DDP and hybrid ZeRO (guide §16; module
    docstring). ``numel``: Ψ, the padded flat numel; ``param_bytes``/``grad_bytes``: bytes per
    element of the inner step's parameter AllGathers and gradient reductions, and of DDP's and
    hybrid ZeRO's (4: fp32, as the engine's CPU runs).

    DDP: one AllReduce of Ψ·b over all N per step, 2(N−1)/N·Ψ·b. Hybrid ZeRO at stage s ≥ 1: the
    replica AllReduce of the 1/g shard, 2(R−1)/R·Ψ/g·b (stage 0: DDP's). DiLoCo:
    2(R−1)/R·Ψ/g·b_d per full sync, over H."""
    s = _settings(settings)
    if stage not in STAGES:
        raise InputError(f"stage must be one of 0, 1, 2, 3; got {stage!r}", "stage")
    check_positive("numel", numel)
    n = check_count("world", world)
    g = check_shard_size(n, shard_size)
    r = n // g
    parts = fragment_numels(numel, s.fragments, fragment_sizes)
    b = s.wire_bytes
    per_fragment = [sync_bytes(p, r, g, b) for p in parts]
    full = sum(per_fragment)
    intra_sync = bus_factor("all_gather", g) * FP32 * numel if stage == 0 else 0.0
    inner = step_bytes_per_leg(stage, numel, g, None, param_bytes=param_bytes, grad_bytes=grad_bytes,
                               gathers_per_step=gathers_per_step)["intra"]
    ddp = step_bytes_per_leg(0, numel, n, g, grad_bytes=grad_bytes)["inter"]
    hybrid = step_bytes_per_leg(stage, numel, n, g, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                gathers_per_step=gathers_per_step)["inter"]
    avg = full / s.every
    return DiLoCoBytes(
        numel=float(numel), world=n, shard_size=g, replicas=r, stage=stage, settings=s.to_dict(),
        wire_bytes_per_element=b, shard_numel=numel / g, fragment_numels=parts,
        fragment_offsets=fragment_offsets(s.every, s.fragments), sync_cross_bytes=full,
        fragment_cross_bytes=per_fragment, cross_bytes_per_step=avg,
        peak_cross_bytes_per_step=_peak(per_fragment, s), sync_intra_bytes=intra_sync,
        inner_intra_bytes_per_step=inner, intra_bytes_per_step=inner + intra_sync / s.every,
        outer_state_bytes=outer_state_bytes(numel, g, s.momentum), grad_bytes=float(grad_bytes),
        ddp_cross_bytes_per_step=ddp, hybrid_cross_bytes_per_step=hybrid,
        ddp_ratio=ddp / avg if avg > 0 else None, hybrid_ratio=hybrid / avg if avg > 0 else None)


def _peak(per_fragment: list[float], s: DiLoCoSettings) -> float:
    """The most one inner step carries: fragments with the same offset sync on the same step."""
    by_step: dict[int, float] = {}
    for o, x in zip(fragment_offsets(s.every, s.fragments), per_fragment):
        by_step[o] = by_step.get(o, 0.0) + x
    return max(by_step.values())


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupLink(ToDict):
    """The link between replica groups (guide §16): ``bandwidth_bytes_per_s`` (per GPU, one
    way), ``latency_s`` (per ring step) and ``source`` (given, or which default)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str

    def time(self, kind: str, ranks: int, nbytes: float) -> float:
        """A ring collective of V = ``nbytes`` over ``ranks`` on this link: latency · ring steps +
        bytes sent per rank / bandwidth (the bench's simulated link)."""
        if ranks <= 1:
            return 0.0
        return (self.latency_s * ring_steps(kind, ranks)
                + bus_factor(kind, ranks) * nbytes / self.bandwidth_bytes_per_s)


def group_link(hardware: Hardware | str, n: int, shard_size: int | None = None,
               bandwidth: float | None = None, latency: float | None = None) -> GroupLink:
    """The inter-group link of ``hardware`` for R = n/g groups: ``bandwidth``/``latency`` when
    given, else the hardware's ``inter_group_bw``/``inter_group_alpha``, else the inter-node
    figures (each GPU's share of its node's NICs, inter_bw/min(g, p), as hybrid.step_comm prices
    the replica AllReduce, and ``inter_alpha``); NVLink's when all N fit in one node and no
    bandwidth is given."""
    hw = get_hardware(hardware)
    n = check_count("n (GPUs)", n)
    g = check_shard_size(n, shard_size)
    p = hw.devices_per_node
    if bandwidth is None:
        bandwidth = hw.inter_group_bw
    if latency is None:
        latency = hw.inter_group_alpha
    one_node = n <= p and bandwidth is None
    if bandwidth is not None:
        source = "bandwidth given"
    elif one_node:
        bandwidth, source = hw.intra_bw, f"{hw.name} NVLink: every group in one node"
    elif hw.inter_bw > 0:
        bandwidth = hw.inter_bw / min(g, p)
        source = f"{hw.name} inter-node bandwidth: each GPU's share of its node's NICs"
    else:
        raise InputError(f"{hw.name} has no inter-node network: give the inter-group bandwidth",
                         "inter_group_bw")
    if latency is not None:
        source += ", latency given"
    elif one_node:
        latency = hw.alpha
    else:
        latency = hw.node_alpha
        source += f", {hw.name} inter-node latency"
    check_positive("inter-group bandwidth", bandwidth)
    check_positive("inter-group latency", latency, allow_zero=True)
    return GroupLink(float(bandwidth), float(latency), source)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MethodStep(ToDict):
    """One method's inner step per GPU (guide §16). ``to_dict()`` keys: ``method`` ("ddp",
    "hybrid", "diloco"), ``label``, ``stage``, ``cross_bytes_per_step`` (average, across the
    groups), ``peak_cross_bytes_per_step``, ``intra_bytes_per_step`` (inside the group, average),
    ``compute_s``, ``intra_s`` (the shard group's collectives on the hardware's links),
    ``cross_s`` (the cross-group collectives' time per step, average, before hiding),
    ``exposed_cross_s`` (what of it is not hidden), ``outer_s`` (the outer steps' local work per
    inner step, average), ``step_s`` (average), ``peak_step_s`` (the busiest step) and
    ``outer_state_bytes`` (per GPU, beyond the stage's own states)."""

    method: str
    label: str
    stage: int
    cross_bytes_per_step: float
    peak_cross_bytes_per_step: float
    intra_bytes_per_step: float
    compute_s: float
    intra_s: float
    cross_s: float
    exposed_cross_s: float
    outer_s: float
    step_s: float
    peak_step_s: float
    outer_state_bytes: float = 0.0


@dataclass(frozen=True)
class _Terms:
    """What the step times depend on, bandwidth apart (the crossover's inputs)."""

    n: int
    g: int
    r: int
    stage: int
    every: int
    delay: int
    compute_s: float
    hidden_s: float
    intra_s: float          # the inner step's collectives inside the group
    ddp_intra_s: float      # DDP on one group's links when R = 1
    ddp_nbytes: float       # V of DDP's AllReduce over N
    replica_nbytes: float   # V of hybrid ZeRO's replica AllReduce over R (the 1/g shard)
    fragment_nbytes: list   # V of each fragment's exchange over R (its 1/g shard at b_d)
    fragment_local_s: list  # each fragment's outer step: update (+ stage 0's AllGather)
    offsets: list
    latency_s: float


def _times(t: _Terms, bandwidth: float) -> dict[str, MethodStep]:
    """Every method's step at inter-group ``bandwidth`` (module docstring)."""
    link = GroupLink(bandwidth, t.latency_s, "")
    out = {}
    if t.r > 1:
        ddp_cross = link.time("all_reduce", t.n, t.ddp_nbytes)
        ddp = dict(intra_s=0.0, cross_s=ddp_cross)
    else:
        ddp = dict(intra_s=t.ddp_intra_s, cross_s=0.0)
    exp = max(0.0, ddp["cross_s"] - t.hidden_s)
    out["ddp"] = dict(ddp, exposed_cross_s=exp, outer_s=0.0,
                      step_s=t.compute_s + ddp["intra_s"] + exp)
    out["ddp"]["peak_step_s"] = out["ddp"]["step_s"]
    if t.stage == 0:
        out["hybrid"] = dict(out["ddp"])
    else:
        cross = link.time("all_reduce", t.r, t.replica_nbytes)
        exp = max(0.0, cross - t.hidden_s)
        step = t.compute_s + t.intra_s + exp
        out["hybrid"] = dict(intra_s=t.intra_s, cross_s=cross, exposed_cross_s=exp, outer_s=0.0,
                             step_s=step, peak_step_s=step)
    ex = [link.time("all_reduce", t.r, v) for v in t.fragment_nbytes]
    hidden = [max(0.0, x - t.delay * t.compute_s) for x in ex]
    by_step: dict[int, float] = {}
    for o, h, loc in zip(t.offsets, hidden, t.fragment_local_s):
        by_step[o] = by_step.get(o, 0.0) + h + loc
    step = t.compute_s + t.intra_s + (sum(hidden) + sum(t.fragment_local_s)) / t.every
    out["diloco"] = dict(intra_s=t.intra_s, cross_s=sum(ex) / t.every,
                         exposed_cross_s=sum(hidden) / t.every,
                         outer_s=sum(t.fragment_local_s) / t.every, step_s=step,
                         peak_step_s=t.compute_s + t.intra_s + max(by_step.values()))
    return out


def _hinges(t: _Terms) -> tuple[float, list[tuple[float, float, float]]]:
    """hybrid step − DiLoCo step as const + Σ w·max(0, p + q·x), x = 1/bandwidth (module
    docstring): every cross-group collective is latency·steps + (bytes sent)·x, less what hides."""
    const = 0.0
    hinges = []
    if t.stage == 0:  # hybrid sharding at stage 0 is DDP (guide §14.3)
        if t.r > 1:
            hinges.append((1.0, ring_steps("all_reduce", t.n) * t.latency_s - t.hidden_s,
                           bus_factor("all_reduce", t.n) * t.ddp_nbytes))
        else:
            const += t.ddp_intra_s
    else:
        const += t.intra_s
        if t.r > 1:
            hinges.append((1.0, ring_steps("all_reduce", t.r) * t.latency_s - t.hidden_s,
                           bus_factor("all_reduce", t.r) * t.replica_nbytes))
    const -= t.intra_s + sum(t.fragment_local_s) / t.every
    if t.r > 1:
        for v in t.fragment_nbytes:
            hinges.append((-1.0 / t.every,
                           ring_steps("all_reduce", t.r) * t.latency_s - t.delay * t.compute_s,
                           bus_factor("all_reduce", t.r) * v))
    return const, hinges


def _hinge_value(const, hinges, x):
    return const + sum(w * max(0.0, p + q * x) for w, p, q in hinges)


def crossover(const: float, hinges: list[tuple[float, float, float]]) -> tuple[str, float | None]:
    """Where D(x) = const + Σ w·max(0, p + q·x) turns positive for good, x = 1/W ≥ 0: the exact
    root of the linear piece it crosses in. Returns ("below", W*) — D > 0, DiLoCo faster, for
    every W < W*; ("always", None) — D > 0 down to x = 0 (every bandwidth); ("never", None) — D
    is not positive as x grows without bound."""
    breaks = sorted({-p / q for _, p, q in hinges if q > 0 and -p / q > 0})
    xs = [0.0] + breaks
    slope_inf = sum(w * q for w, _, q in hinges if q > 0)
    const_inf = const + sum(w * p for w, p, q in hinges if q > 0) + sum(
        w * max(0.0, p) for w, p, q in hinges if q <= 0)
    last = _hinge_value(const, hinges, xs[-1])
    if slope_inf < 0 or (slope_inf == 0 and last <= 0):
        return "never", None
    # the last ray [xs[-1], ∞): D = const_inf + slope_inf·x there
    if last <= 0:
        if const_inf >= 0:  # D(0) = 0 and positive beyond: a tie at infinite bandwidth
            return "always", None
        return "below", slope_inf / -const_inf
    for lo, hi in zip(reversed(xs[:-1]), reversed(xs[1:])):
        d_lo, d_hi = _hinge_value(const, hinges, lo), _hinge_value(const, hinges, hi)
        if d_lo <= 0:
            x = lo + (hi - lo) * (-d_lo) / (d_hi - d_lo)  # D linear on [lo, hi]
            return ("below", 1.0 / x) if x > 0 else ("always", None)
    return "always", None


def crossover_bisection(terms: _Terms, lo: float = BISECT_RANGE[0], hi: float = BISECT_RANGE[1],
                        rel: float = 1e-12) -> tuple[str, float | None]:
    """The crossover from the step times alone (:func:`_times`): the bandwidth where hybrid
    ZeRO's step and DiLoCo's are equal, by bisection in log W over [``lo``, ``hi``]; assumes
    one crossing (DiLoCo exchanges no more per step than hybrid ZeRO: b_d ≤ H·b_h)."""
    def diff(w):
        x = _times(terms, w)
        return x["hybrid"]["step_s"] - x["diloco"]["step_s"]

    if diff(hi) > 0:
        return "always", None
    if diff(lo) <= 0:
        return "never", None
    a, b = math.log(lo), math.log(hi)
    while b - a > rel:
        m = (a + b) / 2
        if diff(math.exp(m)) > 0:
            a = m
        else:
            b = m
    return "below", math.exp((a + b) / 2)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiLoCoPlan(ToDict):
    """DDP, hybrid ZeRO and DiLoCo side by side (guide §16). ``to_dict()`` keys: ``model``,
    ``hardware``, ``n``, ``shard_size`` (g), ``replicas`` (R), ``stage``, ``stage_name``,
    ``precision``, ``settings`` (:class:`DiLoCoSettings`), ``link`` (:class:`GroupLink`),
    ``compute_s`` and ``compute_source``, ``hidden_s`` (compute DDP's and hybrid ZeRO's
    cross-group collectives hide behind), ``bytes`` (:class:`DiLoCoBytes`), ``methods``
    (:class:`MethodStep` dicts: ddp, hybrid, diloco), ``crossover`` ("below", "always",
    "never", "one group"), ``crossover_bandwidth_bytes_per_s`` (W*, bytes/s per GPU, when
    "below"), ``crossover_bisection_bytes_per_s`` (the same from the step times),
    ``speedup_vs_hybrid`` (hybrid step / DiLoCo step at this link), ``loss`` (the measured rows
    that match: :func:`measured_loss`), ``loss_note`` and ``notes``."""

    model: str
    hardware: str
    n: int
    shard_size: int
    replicas: int
    stage: int
    stage_name: str
    precision: str
    settings: dict
    link: dict
    compute_s: float
    compute_source: str
    hidden_s: float
    bytes: dict
    methods: list = field(default_factory=list)
    crossover: str = ""
    crossover_bandwidth_bytes_per_s: float | None = None
    crossover_bisection_bytes_per_s: float | None = None
    speedup_vs_hybrid: float | None = None
    loss: list = field(default_factory=list)
    loss_note: str = ""
    notes: list = field(default_factory=list)


def _model_numel(model):
    from zerodp.plan.models import get_model

    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return None, f"Ψ = {model:,.0f}", float(model)
    m = get_model(model)
    return m, m.name, float(m.params)


def diloco_plan(model, hardware: Hardware | str = "H100", n: int = 4, shard_size: int | None = 2,
                stage: int = 3, settings: DiLoCoSettings | dict | None = None, *,
                precision: str = "bf16", numel: float | None = None,
                compute_s: float | None = None, seq: int | None = None, micro_batch: int = 1,
                inter_group_bw: float | None = None, inter_group_latency: float | None = None,
                overlap: bool = False, hidden_s: float | None = None, outer_s: float | None = None,
                intra_s: float | None = None, fragment_sizes=None, gathers_per_step: int = 2,
                loss_table=None, **settings_kw) -> DiLoCoPlan:
    """DDP, hybrid ZeRO and DiLoCo/Streaming DiLoCo on ``n`` GPUs of ``hardware`` in replica groups
    of g = ``shard_size`` (guide §16; module docstring).

    ``model``: a preset, a :class:`~zerodp.plan.Model` or a parameter count; ``numel``: the padded
    flat numel Ψ (default: the parameter count); ``settings``: a :class:`DiLoCoSettings` (or its
    fields as keywords: ``every``, ``fragments``, ``compress``, ``delay``, ``momentum``, ...).
    ``precision``: the inner step's (its collectives' bytes per element, DDP's and hybrid ZeRO's
    gradients); the pseudo-gradient is fp32 or int8 whatever it is.

    Compute of one inner step per GPU: ``compute_s`` (measured), else the hardware's compute model
    at ``seq`` × ``micro_batch`` tokens (forward, backward, the optimizer over the GPU's shard),
    else not counted (0: the step times are then communication only; the crossover at τ = 0 does
    not depend on it). ``overlap``: DDP's and hybrid ZeRO's cross-group collectives hide behind
    backward (``hidden_s`` seconds when given; default: exposed, as the bench's simulated link).
    ``outer_s``: a measured outer step (one full sync's local work); ``intra_s``: a measured
    inner step's shard-group collectives. ``inter_group_bw`` (bytes/s per GPU) and
    ``inter_group_latency`` (s per ring step): the link, else :func:`group_link`'s defaults."""
    s = _settings(settings, **settings_kw) if settings is not None or settings_kw else None
    if s is None:
        raise InputError("give the outer loop: settings=DiLoCoSettings(every=H, ...) or every=H",
                         "every")
    hw = get_hardware(hardware)
    m, name, params = _model_numel(model)
    psi = params if numel is None else check_positive("numel", numel)
    n = check_count("n (GPUs)", n)
    if stage not in STAGES:
        raise InputError(f"stage must be one of 0, 1, 2, 3; got {stage!r}", "stage")
    g, prec = check_groups(hw, n, shard_size, precision)
    r = n // g
    link = group_link(hw, n, g, inter_group_bw, inter_group_latency)
    by = diloco_bytes(psi, n, g, s, stage, param_bytes=prec["param_bytes"],
                      grad_bytes=prec["grad_bytes"], gathers_per_step=gathers_per_step,
                      fragment_sizes=fragment_sizes)
    # compute of one inner step
    backward_s = None
    if compute_s is not None:
        compute = check_positive("compute_s", compute_s, allow_zero=True)
        source = "given"
    elif seq is not None and m is not None and m.layers and m.hidden and m.heads:
        from zerodp.plan.compute import step_compute

        ct = step_compute(m, hw, check_count("seq", seq), check_count("micro_batch", micro_batch),
                          params_stepped=psi / (g if stage > 0 else 1))
        compute, backward_s = ct.forward_s + ct.backward_s + ct.optimizer_s, ct.backward_s
        source = (f"{hw.name} compute model, {seq * micro_batch:,} tokens per GPU (forward, "
                  "backward, optimizer)")
    else:
        compute, source = 0.0, "not counted (give a measured compute time or a sequence length)"
    if hidden_s is not None:
        hidden = check_positive("hidden_s", hidden_s, allow_zero=True)
    elif overlap:
        hidden = backward_s if backward_s is not None else 2 * compute / 3
    else:
        hidden = 0.0
    inner_intra = (check_positive("intra_s", intra_s, allow_zero=True) if intra_s is not None
                   else step_comm(hw, g, stage, psi, None, precision, "none",
                                  gathers_per_step=gathers_per_step).time_s)
    ddp_intra = step_comm(hw, n, 0, psi, None, precision).time_s if r == 1 else 0.0
    parts = by.fragment_numels
    if outer_s is not None:
        local = [check_positive("outer_s", outer_s, allow_zero=True) * p / psi for p in parts]
    else:
        hbm = sustained(hw)["hbm_bw"]
        local = [OUTER_STEP_BYTES * p / g / hbm
                 + (network_cost(hw, g).time("all_gather", FP32 * p) if stage == 0 and g > 1 else 0.0)
                 for p in parts]
    terms = _Terms(n=n, g=g, r=r, stage=stage, every=s.every, delay=s.delay, compute_s=compute,
                   hidden_s=hidden, intra_s=inner_intra, ddp_intra_s=ddp_intra,
                   ddp_nbytes=psi * prec["grad_bytes"], replica_nbytes=psi / g * prec["grad_bytes"],
                   fragment_nbytes=[p / g * s.wire_bytes for p in parts], fragment_local_s=local,
                   offsets=fragment_offsets(s.every, s.fragments), latency_s=link.latency_s)
    times = _times(terms, link.bandwidth_bytes_per_s)
    sname = STAGE_NAMES[stage]
    labels = {"ddp": "DDP (stage 0 over all N)",
              "hybrid": f"hybrid {sname}" if stage > 0 else "hybrid stage 0 = DDP",
              "diloco": f"DiLoCo over {sname} ({s.label()})"}
    cross = {"ddp": (by.ddp_cross_bytes_per_step,) * 2,
             "hybrid": (by.hybrid_cross_bytes_per_step,) * 2,
             "diloco": (by.cross_bytes_per_step, by.peak_cross_bytes_per_step)}
    # DDP's ring crosses the groups whole (R > 1); with one group it is all inside
    ddp_intra_bytes = 0.0 if r > 1 else step_bytes_per_leg(0, psi, n, None,
                                                           grad_bytes=prec["grad_bytes"])["intra"]
    intra = {"ddp": ddp_intra_bytes,
             "hybrid": by.inner_intra_bytes_per_step if stage > 0 else ddp_intra_bytes,
             "diloco": by.intra_bytes_per_step}
    methods = [MethodStep(method=k, label=labels[k], stage=0 if k == "ddp" else stage,
                          cross_bytes_per_step=cross[k][0], peak_cross_bytes_per_step=cross[k][1],
                          intra_bytes_per_step=intra[k], compute_s=compute,
                          outer_state_bytes=by.outer_state_bytes if k == "diloco" else 0.0,
                          **times[k]) for k in ("ddp", "hybrid", "diloco")]
    notes = []
    if r == 1:
        where, w_star, w_bis = "one group", None, None
        notes.append("one replica group (G = N): nothing crosses groups; DiLoCo is plain ZeRO "
                     "with an outer step")
    else:
        where, w_star = crossover(*_hinges(terms))
        _, w_bis = crossover_bisection(terms)
        if s.wire_bytes > s.every * prec["grad_bytes"]:
            notes.append("DiLoCo sends more per inner step than hybrid ZeRO here (b_d > H·b_h)")
    rows, note = loss_figure(name, s, loss_table)
    hyb, dil = times["hybrid"]["step_s"], times["diloco"]["step_s"]
    return DiLoCoPlan(
        model=name, hardware=hw.name, n=n, shard_size=g, replicas=r, stage=stage,
        stage_name=sname, precision=precision, settings=s.to_dict(), link=link.to_dict(),
        compute_s=compute, compute_source=source, hidden_s=hidden, bytes=by.to_dict(),
        methods=[x.to_dict() for x in methods], crossover=where,
        crossover_bandwidth_bytes_per_s=w_star if where == "below" else None,
        crossover_bisection_bytes_per_s=w_bis, speedup_vs_hybrid=hyb / dil if dil > 0 else None,
        loss=rows, loss_note=note, notes=notes)


# ---------------------------------------------------------------------------------------------
def load_loss_table(path=None) -> list[dict]:
    """The measured rows of ``diloco_loss.json`` (or ``path``): each {model, H, compress,
    fragments, loss_ratio_vs_ddp, tokens, ...}."""
    with open(path or LOSS_TABLE, encoding="utf-8") as f:
        data = json.load(f)
    rows = data.get("measurements", []) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{path or LOSS_TABLE}: 'measurements' must be a list of rows")
    return rows


def measured_loss(model: str, every: int, compress: str = "none", fragments: int = 1,
                  table=None, warmup: int = 0) -> list[dict]:
    """The measured rows for ``model`` at H = ``every`` with this compression and F, most tokens
    first: nothing here predicts a loss (guide §16). ``table``: rows, or a path (default the
    shipped ``diloco_loss.json``). ``warmup``: the rows whose DiLoCo started after so many
    data-parallel steps (a row's ``"warmup"``, 0 when absent: from the first step)."""
    rows = table if isinstance(table, list) else load_loss_table(table)
    key = (str(model).lower(), int(every), compress or "none", int(fragments), int(warmup))
    hits = [r for r in rows
            if (str(r.get("model", "")).lower(), int(r.get("H", -1)), r.get("compress") or "none",
                int(r.get("fragments", 1)), int(r.get("warmup", 0))) == key]
    return sorted(hits, key=lambda r: -float(r.get("tokens", 0)))


def loss_figure(model: str, settings: DiLoCoSettings, table=None) -> tuple[list[dict], str]:
    """(matching rows, one sentence): the measured final validation loss against DDP's at equal
    tokens, or that none was measured for this H."""
    rows = measured_loss(model, settings.every, settings.compress, settings.fragments, table)
    what = (f"{model} at H = {settings.every} ({'int8' if settings.compress == 'int8' else 'fp32'}"
            f", F = {settings.fragments})")
    if not rows:
        return [], (f"no measured loss figure for {what}: {LOSS_TABLE.name} holds none, so what "
                    "this H costs in loss is unknown here (guide §16)")
    r = rows[0]
    note = (f"measured for {what}: final validation loss {float(r['loss_ratio_vs_ddp']):.3f}x "
            f"DDP's at equal tokens ({float(r['tokens']):,.0f} tokens)")
    table_rows = table if isinstance(table, list) else load_loss_table(table)
    warm = sorted({int(x["warmup"]) for x in table_rows if int(x.get("warmup", 0)) > 0})
    found = [(w, measured_loss(model, settings.every, settings.compress, settings.fragments, table_rows, w))
             for w in warm]
    after = [f"{float(hits[0]['loss_ratio_vs_ddp']):.3f}x after {w} data-parallel steps" for w, hits in found if hits]
    return rows, note + (f"; started from a data-parallel warm-up: {', '.join(after)}" if after else "")


__all__ = ["DiLoCoSettings", "DiLoCoBytes", "DiLoCoPlan", "GroupLink", "MethodStep",
           "OUTER_COMPRESSIONS", "OUTER_STEP_BYTES", "LOSS_TABLE", "crossover",
           "crossover_bisection", "diloco_bytes", "diloco_plan", "fragment_numels",
           "fragment_offsets", "fragments_due", "group_link", "load_loss_table", "loss_figure",
           "measured_loss", "outer_state_bytes", "sync_bytes"]


# ---------------------------------------------------------------------------------------------
def _bw(x: float) -> str:
    from zerodp.plan._common import fmt_bytes

    return fmt_bytes(x) + "/s"


def text(plan: DiLoCoPlan) -> str:
    """The table ``zerodp plan comm --diloco-every H`` prints (guide §16)."""
    from zerodp.plan._common import fmt_bytes, fmt_count, fmt_time, table

    s = DiLoCoSettings(**plan.settings)
    by, link = plan.bytes, plan.link
    head = (f"DiLoCo over {plan.stage_name} (guide §16): {plan.model}, Ψ = {fmt_count(by['numel'])} "
            f"on {plan.n:,} GPUs ({plan.hardware}) in R = {plan.replicas} replica groups of "
            f"G = {plan.shard_size}; {s.label()} ({by['wire_bytes_per_element']:.4g} B per "
            f"pseudo-gradient element), outer Nesterov SGD lr {s.lr:g}, momentum {s.momentum:g}; "
            f"inner step in {plan.precision}")
    rows = []
    for m in plan.methods:
        rows.append([m["label"], fmt_bytes(m["cross_bytes_per_step"]),
                     fmt_bytes(m["peak_cross_bytes_per_step"]),
                     fmt_bytes(m["intra_bytes_per_step"]) if m["intra_bytes_per_step"] else "-",
                     fmt_time(m["cross_s"]), fmt_time(m["exposed_cross_s"]),
                     fmt_time(m["outer_s"]) if m["outer_s"] else "-", fmt_time(m["step_s"]),
                     fmt_time(m["peak_step_s"]),
                     fmt_bytes(m["outer_state_bytes"]) if m["outer_state_bytes"] else "-"])
    lines = [table(["method", "cross-group B/GPU", "busiest step", "intra-group B/GPU",
                    "cross-group time", "exposed", "outer step", "step", "busiest step time",
                    "outer state/GPU"], rows, title=head, align="lrrrrrrrrr"),
             f"per GPU per inner step, averaged over H (busiest step: the one a fragment syncs "
             f"on); inter-group link {_bw(link['bandwidth_bytes_per_s'])} per GPU, "
             f"{fmt_time(link['latency_s'])} per ring step ({link['source']}); a cross-group "
             "collective costs latency x ring steps + bytes sent / bandwidth",
             f"compute of one inner step: {fmt_time(plan.compute_s)} ({plan.compute_source})"
             + (f"; DDP's and hybrid ZeRO's cross-group collectives hide behind "
                f"{fmt_time(plan.hidden_s)} of it" if plan.hidden_s else
                "; cross-group collectives exposed unless τ hides them")]
    if by["ddp_ratio"] is not None:
        lines.append(f"cross-group bytes per step: DDP / DiLoCo {by['ddp_ratio']:,.0f}x, hybrid "
                     f"{plan.stage_name} / DiLoCo {by['hybrid_ratio']:,.0f}x; outer state "
                     f"{fmt_bytes(by['outer_state_bytes'])} per GPU "
                     f"({'8' if s.momentum > 0 else '4'}Ψ/G)")
    if plan.speedup_vs_hybrid is not None and plan.replicas > 1:
        lines.append(f"on this link: hybrid {plan.stage_name}'s step / DiLoCo's = "
                     f"{plan.speedup_vs_hybrid:.3f}x")
    if plan.crossover == "below":
        lines.append(f"crossover: DiLoCo's step is faster than hybrid {plan.stage_name}'s below "
                     f"{_bw(plan.crossover_bandwidth_bytes_per_s)} per GPU on the inter-group "
                     f"link (exact; bisection {_bw(plan.crossover_bisection_bytes_per_s)})")
    elif plan.crossover == "always":
        lines.append(f"crossover: none — DiLoCo's step is faster than hybrid {plan.stage_name}'s "
                     "at every inter-group bandwidth (what it saves in latency outweighs its "
                     "outer step)")
    elif plan.crossover == "never":
        lines.append(f"crossover: none — DiLoCo's step is never faster than hybrid "
                     f"{plan.stage_name}'s, however slow the link")
    lines.append(f"loss: {plan.loss_note}")
    lines += [f"note: {x}" for x in plan.notes]
    return "\n".join(lines)


def outer_step_seconds(numel: float, n: int, shard_size: int, settings: DiLoCoSettings | dict,
                       link: GroupLink, compute_s: float = 0.0, *, hbm_bw: float,
                       stage: int = 3, hardware: Hardware | str | None = None,
                       fragment_sizes=None, outer_s: float | None = None) -> tuple[float, float]:
    """(average, busiest) seconds the outer loop adds to one inner step (guide §16): each
    fragment's exchange on ``link`` less τ × ``compute_s``, and its outer step (the update at
    ``hbm_bw``, :data:`OUTER_STEP_BYTES` per shard element, or its share of a measured
    ``outer_s``; at stage 0 the shard group's AllGather on ``hardware``'s links), over H."""
    s = _settings(settings)
    g = check_shard_size(n, shard_size)
    r = n // g
    parts = fragment_numels(numel, s.fragments, fragment_sizes)
    by_step: dict[int, float] = {}
    total = 0.0
    for o, p in zip(fragment_offsets(s.every, s.fragments), parts):
        exchange = link.time("all_reduce", r, p / g * s.wire_bytes)
        if outer_s is not None:
            local = outer_s * p / numel
        else:
            local = OUTER_STEP_BYTES * p / g / hbm_bw
            if stage == 0 and g > 1:
                local += network_cost(get_hardware(hardware), g).time("all_gather", FP32 * p)
        cost = max(0.0, exchange - s.delay * compute_s) + local
        by_step[o] = by_step.get(o, 0.0) + cost
        total += cost
    return total / s.every, max(by_step.values())
