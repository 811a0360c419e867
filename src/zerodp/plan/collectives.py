"""Collective times with the alpha-beta model (guide §2.4, §4, §7.2).

Ring algorithm on N ranks, V bytes (the full, unsharded array):

* AllReduce: 2(N−1) steps; each rank sends 2(N−1)/N·V bytes;
  ``T = 2(N−1)·α + 2(N−1)/N · V/W``.
* ReduceScatter and AllGather: half of that, ``T = (N−1)·α + (N−1)/N · V/W``.

The latency and bandwidth terms are equal at the crossover size ``V* = N·α·W`` (guide §4) for all
three. W is the one-direction bandwidth of each rank (or each node, for the inter-node leg).

``algbw`` and ``busbw`` are defined as nccl-tests does: ``algbw = V / T`` and
``busbw = algbw · 2(N−1)/N`` for AllReduce, ``algbw · (N−1)/N`` for ReduceScatter/AllGather, so
busbw approaches W for large messages whatever N is.

Across nodes (guide §7.2, §7.3) a collective runs in two legs, inside each node over NVLink and
between nodes over the NICs, each with its own (n−1)/n; it takes as long as the slower leg.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerodp.plan._common import InputError, ToDict, check_count, check_positive
from zerodp.plan.hardware import Hardware, get_hardware

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
_ALIASES = {"allreduce": "all_reduce", "ar": "all_reduce", "reducescatter": "reduce_scatter",
            "rs": "reduce_scatter", "allgather": "all_gather", "ag": "all_gather"}


def normalize_kind(kind: str) -> str:
    """``"AllReduce"``, ``"all_reduce"``, ``"ar"`` → ``"all_reduce"`` (and likewise RS, AG)."""
    key = str(kind).lower().replace("-", "_")
    key = _ALIASES.get(key.replace("_", ""), key)
    if key not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: use one of {', '.join(KINDS)}")
    return key


def ring_steps(kind: str, n: int) -> int:
    """Sequential ring steps: 2(N−1) for AllReduce, N−1 for ReduceScatter/AllGather."""
    return (2 if normalize_kind(kind) == "all_reduce" else 1) * (n - 1)


def bus_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per byte of V: 2(N−1)/N for AllReduce, (N−1)/N otherwise."""
    return ring_steps(kind, n) / n


@dataclass(frozen=True)
class CollectiveTime(ToDict):
    """Cost of one collective. Keys of ``to_dict()``:

    ``kind``, ``nbytes`` (V), ``n`` (ranks), ``time_s``, ``latency_s`` and ``bandwidth_s`` (the two
    terms of the slower leg), ``bytes_sent_per_rank``, ``algbw`` and ``busbw`` (bytes/s, nccl-tests
    definitions; null when nothing moves), ``crossover_bytes`` (V* = NαW of the slower leg),
    ``latency_bytes`` (what the link moves during the latency term, α′·W), ``bottleneck``
    ("ring", "intra" or "inter") and ``legs`` (one entry per leg with the same keys, flat).
    """

    kind: str
    nbytes: float
    n: int
    time_s: float
    latency_s: float
    bandwidth_s: float
    bytes_sent_per_rank: float
    algbw: float | None
    busbw: float | None
    crossover_bytes: float
    latency_bytes: float
    bottleneck: str = "ring"
    legs: list = field(default_factory=list)


@dataclass(frozen=True)
class RingCost(ToDict):
    """A flat ring of ``n`` ranks: ``alpha`` seconds per step, ``bandwidth`` bytes/s per rank.

    The generic collective cost the timeline simulator takes; build it from measured α and W, or
    from a small-message latency with :meth:`from_latency`.
    """

    alpha: float
    bandwidth: float
    n: int

    def __post_init__(self):
        check_positive("alpha", self.alpha, allow_zero=True)
        check_positive("bandwidth", self.bandwidth)
        check_count("n (ranks)", self.n)

    @classmethod
    def from_latency(cls, latency: float, bandwidth: float, n: int) -> "RingCost":
        """From α′, the small-message AllReduce latency on these ``n`` ranks: α = α′/(2(n−1))."""
        check_positive("latency", latency, allow_zero=True)
        check_count("n (ranks)", n)
        return cls(alpha=latency / (2 * (n - 1)) if n > 1 else 0.0, bandwidth=bandwidth, n=n)

    def latency(self, kind: str) -> float:
        return ring_steps(kind, self.n) * self.alpha

    def bandwidth_time(self, kind: str, nbytes: float) -> float:
        return bus_factor(kind, self.n) * nbytes / self.bandwidth

    def time(self, kind: str, nbytes: float) -> float:
        """Seconds for one ``kind`` collective of ``nbytes`` bytes."""
        check_positive("nbytes", nbytes, allow_zero=True)
        return self.latency(kind) + self.bandwidth_time(kind, nbytes)

    def crossover_bytes(self) -> float:
        """V* = N·α·W: below it the latency term dominates (guide §4)."""
        return self.n * self.alpha * self.bandwidth

    def collective(self, kind: str, nbytes: float, leg: str = "ring") -> CollectiveTime:
        kind = normalize_kind(kind)
        t = self.time(kind, nbytes)
        algbw = nbytes / t if t > 0 and self.n > 1 else None
        lat = self.latency(kind)
        return CollectiveTime(
            kind=kind, nbytes=nbytes, n=self.n, time_s=t, latency_s=lat,
            bandwidth_s=self.bandwidth_time(kind, nbytes),
            bytes_sent_per_rank=bus_factor(kind, self.n) * nbytes,
            algbw=algbw, busbw=None if algbw is None else algbw * bus_factor(kind, self.n),
            crossover_bytes=self.crossover_bytes(), latency_bytes=lat * self.bandwidth,
            bottleneck=leg)


@dataclass(frozen=True)
class HierarchicalCost(ToDict):
    """Two legs: ``intra`` (ring of devices in a node) and ``inter`` (ring of nodes, or None).

    A collective takes as long as its slower leg (guide §7.2: "耗时取两段中慢的那段").
    """

    intra: RingCost
    inter: RingCost | None = None

    @property
    def n(self) -> int:
        return self.intra.n * (self.inter.n if self.inter else 1)

    def _legs(self) -> list[tuple[str, RingCost]]:
        legs = [("intra", self.intra)]
        if self.inter is not None and self.inter.n > 1:
            legs.append(("inter", self.inter))
        return legs

    def time(self, kind: str, nbytes: float) -> float:
        return max(leg.time(kind, nbytes) for _, leg in self._legs())

    def seconds_per_byte(self, kind: str) -> float:
        """Bandwidth term per byte of V of the slower leg: max over legs of factor/W."""
        return max(bus_factor(kind, leg.n) / leg.bandwidth for _, leg in self._legs())

    def collective(self, kind: str, nbytes: float) -> CollectiveTime:
        kind = normalize_kind(kind)
        legs = [(name, leg.collective(kind, nbytes, leg=name)) for name, leg in self._legs()]
        name, slow = max(legs, key=lambda p: p[1].time_s)
        n = self.n
        t = slow.time_s
        algbw = nbytes / t if t > 0 and n > 1 else None
        return CollectiveTime(
            kind=kind, nbytes=nbytes, n=n, time_s=t, latency_s=slow.latency_s,
            bandwidth_s=slow.bandwidth_s, bytes_sent_per_rank=bus_factor(kind, n) * nbytes,
            algbw=algbw, busbw=None if algbw is None else algbw * bus_factor(kind, n),
            crossover_bytes=slow.crossover_bytes, latency_bytes=slow.latency_bytes,
            bottleneck=name if len(legs) > 1 else "ring",
            legs=[dict(leg.to_dict(), leg=leg_name) for leg_name, leg in legs])


def network_cost(hardware: Hardware | str, n: int, axes: int = 1) -> HierarchicalCost:
    """The two-leg cost of ``n`` devices of ``hardware``, filling nodes of ``devices_per_node``.

    ``axes``: how many mesh axes carry DP at once (TPU v5p: up to 3), multiplying ``intra_bw``.
    """
    hw = get_hardware(hardware)
    n = check_count("number of devices", n)
    axes = check_count("axes", axes)
    if axes > hw.axes:
        raise ValueError(f"{hw.name} has {hw.axes} DP axis(es); got axes={axes}")
    g = min(n, hw.devices_per_node)
    nodes = math.ceil(n / hw.devices_per_node)
    intra = RingCost(alpha=hw.alpha, bandwidth=hw.intra_bw * axes, n=g)
    if nodes == 1:
        return HierarchicalCost(intra=intra)
    if hw.inter_bw <= 0:
        raise InputError(f"{hw.name} has no inter-node network (inter_bw = 0): at most "
                         f"{hw.devices_per_node} devices, got {n}", "n",
                         f"{hw.name} 没有节点间网络：最多 {hw.devices_per_node} 个设备，收到 {n}")
    return HierarchicalCost(intra=intra, inter=RingCost(alpha=hw.node_alpha, bandwidth=hw.inter_bw, n=nodes))


def collective_time(kind: str, nbytes: float, n: int, hardware: Hardware | str | None = None,
                    alpha: float | None = None, bandwidth: float | None = None) -> CollectiveTime:
    """Time of one collective of ``nbytes`` on ``n`` ranks.

    Either ``hardware`` (preset name, file or :class:`Hardware`: two legs when ``n`` spans nodes)
    or an explicit flat ring (``alpha`` seconds per step, ``bandwidth`` bytes/s per rank).
    """
    check_positive("nbytes", nbytes, allow_zero=True)
    if hardware is None:
        if bandwidth is None:
            raise ValueError("give hardware, or alpha and bandwidth for a flat ring")
        return RingCost(alpha=alpha or 0.0, bandwidth=bandwidth, n=n).collective(kind, nbytes)
    return network_cost(hardware, n).collective(kind, nbytes)
