"""Event simulation of one training step's overlap (guide §3, §4, §9.3, §10.2, §10.3).

**Buckets (stages 0–2).** Backward runs the layers last to first; a layer's gradients are final when
its backward ends (guide §3). Gradient bytes fill buckets in that reverse order; a bucket is
launched when it is full (the last one when backward ends), on ONE serialized communication stream:
``start = max(ready, previous end)``, ``end = start + T(bucket)`` with T from the alpha-beta model.
Exposed communication is what runs past the end of backward; step = forward + backward + exposed.

By default a layer's bytes are a stream that may straddle buckets (``split_layers=True``), so tiny
buckets give the guide's "thousands of buckets"; ``split_layers=False`` closes a bucket only at a
layer boundary, as DDP does with whole parameters. Runs of equal buckets that become ready at the
same moment are simulated in one go (``BucketRun``), so a 1 kB bucket on a 16 GB model is fast.

**FSDP (stage 3).** Per unit: forward AllGather (unit i+1 prefetched when unit i starts computing,
so at most two units are gathered), backward AllGather in reverse with the same prefetch, the last
unit kept from forward (2L−1 AllGathers, guide §9.3), and a ReduceScatter of each unit's gradients
when its backward ends, all on one FIFO communication stream.

Everything takes explicit :class:`Layer` lists (measured or estimated) and any collective cost with
a ``time(kind, nbytes)`` method (:class:`~zerodp.plan.collectives.RingCost`,
:class:`~zerodp.plan.collectives.HierarchicalCost`); :func:`model_layers` builds layers from a
model preset and the FLOP counts of guide §7.4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from zerodp.plan._common import BF16, ToDict, check_count, check_positive
from zerodp.plan.collectives import normalize_kind
from zerodp.plan.hardware import Hardware, get_hardware
from zerodp.plan.models import Model, get_model
from zerodp.plan.roofline import BACKWARD_FLOPS_PER_TOKEN_PARAM, FORWARD_FLOPS_PER_TOKEN_PARAM

#: PyTorch DDP's default bucket_cap_mb (guide §4)
DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20
#: the bucket ``zerodp plan simulate`` and the page start from (zerodp.plan.defaults): DDP's
#: bucket_cap_mb = 25, which is MiB, as ``zerodp train --bucket-mb 25`` (guide §4)
DEFAULT_BUCKET_BYTES = float(DDP_DEFAULT_BUCKET_BYTES)
#: buckets listed one by one in ``to_dict()``; the runs always describe all of them
MAX_LISTED_BUCKETS = 2000
#: buckets one simulation may make: keeps any request under a second (2M buckets take ~0.2 s)
MAX_BUCKETS = 2_000_000
_EPS = 1e-9


class CollectiveCost(Protocol):
    def time(self, kind: str, nbytes: float) -> float: ...


@dataclass(frozen=True)
class Layer(ToDict):
    """One layer (or FSDP unit): ``param_bytes`` communicated (bf16 gradients / parameters),
    ``backward_s`` and ``forward_s`` of compute."""

    name: str
    param_bytes: float
    backward_s: float
    forward_s: float = 0.0

    def __post_init__(self):
        check_positive(f"layer {self.name!r} param_bytes", self.param_bytes, allow_zero=True)
        check_positive(f"layer {self.name!r} backward_s", self.backward_s, allow_zero=True)
        check_positive(f"layer {self.name!r} forward_s", self.forward_s, allow_zero=True)


def _check_layers(layers: Sequence[Layer]) -> list[Layer]:
    layers = list(layers)
    if not layers:
        raise ValueError("need at least one layer")
    for layer in layers:
        if not isinstance(layer, Layer):
            raise ValueError(f"layers must be Layer objects, got {type(layer).__name__}")
    return layers


def _check_cost(cost) -> None:
    if not callable(getattr(cost, "time", None)):
        raise ValueError("cost must have a time(kind, nbytes) method (e.g. RingCost)")


@dataclass(frozen=True)
class Bucket(ToDict):
    """One bucket: ``index`` (launch order), ``nbytes``, ``ready_s``, ``start_s``, ``end_s``
    (seconds from the start of backward)."""

    index: int
    nbytes: float
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class BucketRun(ToDict):
    """``count`` consecutive buckets of ``nbytes`` each, ready at ``ready_s`` when layer ``layer``
    finished backward; they run back to back from ``start_s`` to ``end_s``; ``first`` is the
    index of the first; ``seconds_each`` the time of one."""

    first: int
    count: int
    nbytes: float
    layer: str
    ready_s: float
    start_s: float
    end_s: float
    seconds_each: float

    def buckets(self) -> list[Bucket]:
        return [Bucket(self.first + j, self.nbytes, self.ready_s,
                       self.start_s + j * self.seconds_each,
                       self.start_s + (j + 1) * self.seconds_each) for j in range(self.count)]


@dataclass(frozen=True)
class LayerSpan(ToDict):
    """A compute interval: ``name``, ``phase`` ("forward"/"backward"), ``start_s``, ``end_s``."""

    name: str
    phase: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class BackwardTimeline(ToDict):
    """Result of :func:`simulate_backward`. ``to_dict()`` keys: ``collective``, ``bucket_bytes``
    (cap), ``split_layers``, ``num_buckets``, ``total_bytes``, ``forward_s``, ``backward_s``,
    ``comm_s`` (sum of bucket times), ``latency_s`` and ``bandwidth_s`` (its two parts),
    ``comm_end_s``, ``exposed_comm_s`` (after backward ends), ``exposed_fraction``
    (exposed / backward), ``step_s`` (forward + backward + exposed), ``compute`` (backward
    LayerSpans), ``runs`` (all BucketRuns), ``buckets`` (the first MAX_LISTED_BUCKETS Buckets) and
    ``buckets_truncated``. Times are seconds from the start of backward."""

    collective: str
    bucket_bytes: float
    split_layers: bool
    num_buckets: int
    total_bytes: float
    forward_s: float
    backward_s: float
    comm_s: float
    latency_s: float
    bandwidth_s: float
    comm_end_s: float
    exposed_comm_s: float
    exposed_fraction: float
    step_s: float
    compute: list = field(default_factory=list)
    runs: list = field(default_factory=list)

    def buckets(self, limit: int | None = None) -> list[Bucket]:
        out = []
        for run in self.runs:
            for b in run.buckets():
                if limit is not None and len(out) >= limit:
                    return out
                out.append(b)
        return out

    @property
    def last_bucket(self) -> Bucket:
        if not self.runs:
            raise ValueError("no buckets: the layers have no parameter bytes")
        run = self.runs[-1]
        return run.buckets()[-1] if run.count < 10 else Bucket(
            run.first + run.count - 1, run.nbytes, run.ready_s,
            run.end_s - run.seconds_each, run.end_s)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["buckets"] = [b.to_dict() for b in self.buckets(MAX_LISTED_BUCKETS)]
        d["buckets_truncated"] = self.num_buckets > MAX_LISTED_BUCKETS
        return d


def simulate_backward(layers: Sequence[Layer], cost: CollectiveCost, bucket_bytes: float,
                      collective: str = "all_reduce", split_layers: bool = True) -> BackwardTimeline:
    """Simulate one backward with bucketed gradient communication (module docstring).

    ``layers`` in forward order; ``cost.time(kind, nbytes)`` gives one collective's seconds;
    ``collective``: "all_reduce" (DP) or "reduce_scatter" (ZeRO-2).
    """
    layers = _check_layers(layers)
    _check_cost(cost)
    check_positive("bucket_bytes", bucket_bytes)
    total = sum(layer.param_bytes for layer in layers)
    ratio = total / bucket_bytes
    if ratio > MAX_BUCKETS:
        from zerodp.plan._common import fmt_bytes, fmt_count
        count = f"{math.ceil(ratio):,}" if ratio < 1e15 else fmt_count(ratio)
        from zerodp.plan._common import InputError
        raise InputError(
            f"bucket size (bucket_bytes, --bucket) {fmt_bytes(bucket_bytes)} cuts "
            f"{fmt_bytes(total)} of gradients into {count} buckets, over the {MAX_BUCKETS:,} one "
            f"simulation makes: use a bucket of at least {fmt_bytes(math.ceil(total / MAX_BUCKETS))}",
            "bucket_bytes",
            f"桶大小 {fmt_bytes(bucket_bytes)} 会把 {fmt_bytes(total)} 的梯度分成 {count} 个桶，超过单次模拟"
            f"上限 {MAX_BUCKETS:,}：请用至少 {fmt_bytes(math.ceil(total / MAX_BUCKETS))} 的桶")
    kind = normalize_kind(collective)
    runs: list[BucketRun] = []
    compute: list[LayerSpan] = []
    state = {"comm_free": 0.0, "count": 0, "latency": 0.0, "comm": 0.0}
    t0 = cost.time(kind, 0.0)

    def launch(count: int, nbytes: float, ready: float, layer: str) -> None:
        each = cost.time(kind, nbytes)
        start = max(ready, state["comm_free"])
        end = start + count * each
        runs.append(BucketRun(state["count"], count, nbytes, layer, ready, start, end, each))
        state.update(comm_free=end, count=state["count"] + count,
                     latency=state["latency"] + count * t0, comm=state["comm"] + count * each)

    t = 0.0
    pending = 0.0
    for layer in reversed(layers):
        start, t = t, t + layer.backward_s
        compute.append(LayerSpan(layer.name, "backward", start, t))
        remaining = layer.param_bytes
        if not split_layers:
            pending += remaining
            if pending >= bucket_bytes * (1 - _EPS):
                launch(1, pending, t, layer.name)
                pending = 0.0
            continue
        if pending > 0:
            need = bucket_bytes - pending
            if remaining >= need * (1 - _EPS):
                launch(1, bucket_bytes, t, layer.name)
                remaining -= need
                pending = 0.0
            else:
                pending += remaining
                remaining = 0.0
        full = int(math.floor(remaining / bucket_bytes + _EPS))
        if full:
            launch(full, bucket_bytes, t, layer.name)
            remaining -= full * bucket_bytes
        if remaining > bucket_bytes * _EPS:
            pending += remaining
    if pending > 0:
        launch(1, pending, t, layers[0].name)
    backward = t
    total = sum(layer.param_bytes for layer in layers)
    comm_end = state["comm_free"]
    exposed = max(0.0, comm_end - backward)
    forward = sum(layer.forward_s for layer in layers)
    return BackwardTimeline(
        collective=kind, bucket_bytes=bucket_bytes, split_layers=split_layers,
        num_buckets=state["count"], total_bytes=total, forward_s=forward, backward_s=backward,
        comm_s=state["comm"], latency_s=state["latency"], bandwidth_s=state["comm"] - state["latency"],
        comm_end_s=comm_end, exposed_comm_s=exposed,
        exposed_fraction=exposed / backward if backward > 0 else math.inf,
        step_s=forward + backward + exposed, compute=compute, runs=runs)


@dataclass(frozen=True)
class SweepPoint(ToDict):
    """One bucket size: ``bucket_bytes``, ``num_buckets``, ``comm_s``, ``exposed_comm_s``,
    ``exposed_fraction``, ``step_s``."""

    bucket_bytes: float
    num_buckets: int
    comm_s: float
    exposed_comm_s: float
    exposed_fraction: float
    step_s: float


@dataclass(frozen=True)
class BucketSweep(ToDict):
    """``points`` (SweepPoints, increasing size), ``best_bucket_bytes`` (least exposed comm, the
    smallest such size on ties), ``best_exposed_comm_s``, ``backward_s``, ``bandwidth_s`` (the
    whole model's bandwidth term, the floor of total comm)."""

    points: list
    best_bucket_bytes: float
    best_exposed_comm_s: float
    backward_s: float
    bandwidth_s: float


def default_bucket_sizes(total_bytes: float, smallest: float = 1e4, per_decade: int = 4) -> list[float]:
    """Log-spaced sizes from ``smallest`` up to (and including) ``total_bytes``."""
    check_positive("total_bytes", total_bytes)
    sizes, k = [], 0
    while True:
        s = smallest * 10 ** (k / per_decade)
        if s >= total_bytes:
            break
        sizes.append(s)
        k += 1
    return sizes + [float(total_bytes)]


def sweep_buckets(layers: Sequence[Layer], cost: CollectiveCost,
                  sizes: Sequence[float] | None = None, collective: str = "all_reduce",
                  split_layers: bool = True) -> BucketSweep:
    """:func:`simulate_backward` over bucket sizes (default: :func:`default_bucket_sizes`)."""
    layers = _check_layers(layers)
    total = sum(layer.param_bytes for layer in layers)
    sizes = sorted(default_bucket_sizes(total, smallest=max(1e4, total / MAX_BUCKETS))
                   if sizes is None else
                   [check_positive("bucket size", float(s)) for s in sizes])
    if not sizes:
        raise ValueError("need at least one bucket size")
    points = []
    backward = bandwidth = 0.0
    for s in sizes:
        r = simulate_backward(layers, cost, s, collective, split_layers)
        points.append(SweepPoint(s, r.num_buckets, r.comm_s, r.exposed_comm_s,
                                 r.exposed_fraction, r.step_s))
        backward, bandwidth = r.backward_s, r.bandwidth_s
    best = min(points, key=lambda p: (p.exposed_comm_s, p.bucket_bytes))
    return BucketSweep(points, best.bucket_bytes, best.exposed_comm_s, backward, bandwidth)


@dataclass(frozen=True)
class CommOp(ToDict):
    """One FSDP collective: ``kind``, ``unit``, ``phase``, ``nbytes``, ``issue_s``, ``start_s``,
    ``end_s`` (seconds from the start of forward)."""

    kind: str
    unit: str
    phase: str
    nbytes: float
    issue_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class FsdpTimeline(ToDict):
    """Result of :func:`simulate_fsdp`. ``to_dict()`` keys: ``units``, ``prefetch``,
    ``num_allgathers`` (2L−1 with the kept last unit), ``num_reduce_scatters``, ``compute_s``
    (forward + backward compute), ``forward_end_s``, ``step_s``, ``exposed_comm_s``
    (step − compute: time compute waits for communication), ``comm_s`` (sum of collective times),
    ``compute`` (LayerSpans) and ``comm`` (CommOps), times from the start of forward."""

    units: int
    prefetch: bool
    num_allgathers: int
    num_reduce_scatters: int
    compute_s: float
    forward_end_s: float
    step_s: float
    exposed_comm_s: float
    comm_s: float
    compute: list = field(default_factory=list)
    comm: list = field(default_factory=list)


def simulate_fsdp(units: Sequence[Layer], cost: CollectiveCost, prefetch: bool = True,
                  keep_last: bool = True) -> FsdpTimeline:
    """Simulate ZeRO-3/FSDP forward + backward with per-unit AllGather and ReduceScatter.

    ``units`` in forward order; ``param_bytes`` is the unit's full bf16 size (AllGather output,
    ReduceScatter input). With ``prefetch`` unit i+1 is gathered while unit i computes (forward;
    reversed in backward); ``keep_last`` keeps the last unit gathered from forward into backward.
    """
    units = _check_layers(units)
    _check_cost(cost)
    comm: list[CommOp] = []
    spans: list[LayerSpan] = []
    state = {"free": 0.0}

    def issue(kind: str, unit: Layer, phase: str, at: float) -> CommOp:
        start = max(at, state["free"])
        op = CommOp(kind, unit.name, phase, unit.param_bytes, at, start,
                    start + cost.time(kind, unit.param_bytes))
        state["free"] = op.end_s
        comm.append(op)
        return op

    n = len(units)
    gathered = {0: issue("all_gather", units[0], "forward", 0.0)}
    t = 0.0
    for i, unit in enumerate(units):
        if i not in gathered:  # no prefetch: gather when the previous unit is done
            gathered[i] = issue("all_gather", unit, "forward", t)
        start = max(t, gathered[i].end_s)
        if prefetch and i + 1 < n:
            gathered[i + 1] = issue("all_gather", units[i + 1], "forward", start)
        t = start + unit.forward_s
        spans.append(LayerSpan(unit.name, "forward", start, t))
    forward_end = t
    ready = {n - 1: forward_end} if keep_last else {}
    for j in range(n - 1, -1, -1):
        unit = units[j]
        if j not in ready:
            ready[j] = issue("all_gather", unit, "backward", t).end_s
        start = max(t, ready[j])
        if prefetch and j - 1 >= 0 and (j - 1) not in ready:
            ready[j - 1] = issue("all_gather", units[j - 1], "backward", start).end_s
        t = start + unit.backward_s
        spans.append(LayerSpan(unit.name, "backward", start, t))
        issue("reduce_scatter", unit, "backward", t)
    compute = sum(u.forward_s + u.backward_s for u in units)
    step = max(t, state["free"])
    return FsdpTimeline(
        units=n, prefetch=prefetch,
        num_allgathers=sum(op.kind == "all_gather" for op in comm),
        num_reduce_scatters=sum(op.kind == "reduce_scatter" for op in comm),
        compute_s=compute, forward_end_s=forward_end, step_s=step, exposed_comm_s=step - compute,
        comm_s=sum(op.end_s - op.start_s for op in comm), compute=spans, comm=comm)


def model_layers(model: Model | str, hardware: Hardware | str | float, tokens_per_device: float,
                 efficiency: float = 1.0) -> list[Layer]:
    """Layers of a model preset for the simulator, in forward order: embedding, L blocks, head.

    Compute from guide §7.4: forward 2·tokens·P/C, backward 4·tokens·P/C with P the layer's active
    parameters and C = ``hardware``'s FLOP/s (or a number) × ``efficiency``; gradient bytes are
    bf16 (2·P with P all parameters, all experts included). The embedding lookup costs no FLOPs.
    """
    m = get_model(model)
    m.require_shape("layers")
    flops = hardware if isinstance(hardware, (int, float)) else get_hardware(hardware).flops
    check_positive("flops", flops)
    check_positive("tokens_per_device", tokens_per_device)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    c = flops * efficiency

    def layer(name, params, active):
        return Layer(name, BF16 * params,
                     BACKWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * active / c,
                     FORWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * active / c)

    emb = float(m.vocab * m.hidden) if (m.vocab and m.hidden) else 0.0
    head_params = 0.0 if m.tied_embeddings else emb
    out = [Layer("embedding", BF16 * emb, 0.0, 0.0)] if emb else []
    out += [layer(f"block{i}", m.block_params, m.active_block_params) for i in range(m.layers)]
    if emb:
        out.append(Layer("head", BF16 * head_params,
                         BACKWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * emb / c,
                         FORWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * emb / c))
    return out


def uniform_layers(num_layers: int, params: float, tokens_per_device: float, flops: float) -> list[Layer]:
    """``num_layers`` equal layers sharing ``params`` (bf16), compute as :func:`model_layers`."""
    num_layers = check_count("num_layers", num_layers)
    check_positive("params", params)
    p = params / num_layers
    return [Layer(f"layer{i}", BF16 * p,
                  BACKWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * p / flops,
                  FORWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * p / flops)
            for i in range(num_layers)]
