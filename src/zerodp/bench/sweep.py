"""Measure collectives the way nccl-tests does, and fit the alpha-beta model to them.

Guide §2.4, §4: a ring collective over V bytes on N ranks takes

    AllReduce:                 t = 2(N−1)·α + 2(N−1)/N · V/W
    ReduceScatter, AllGather:  t =  (N−1)·α +  (N−1)/N · V/W

where α is the per-hop latency and W the per-rank one-way bandwidth. nccl-tests reports, for a
buffer of V bytes (the full, unsharded size) that took t seconds,

    algbw = V / t
    busbw = algbw · 2(N−1)/N  (AllReduce)     busbw = algbw · (N−1)/N  (ReduceScatter, AllGather)

so that busbw is comparable to the link bandwidth whatever N is. Fitting t against V by weighted
least squares (relative error, because sizes span decades) gives α from the intercept and W from
the slope.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from zerodp.plan.collectives import KINDS, RingCost, bus_factor, ring_steps

@dataclass(frozen=True)
class Point:
    kind: str
    bytes: int
    time_s: float  # median over iterations
    algbw: float  # bytes/s
    busbw: float  # bytes/s


@dataclass(frozen=True)
class Fit:
    """α (seconds per ring hop) and W (bytes/s one way per rank) for one collective."""

    kind: str
    world_size: int
    alpha_s: float
    bandwidth: float
    rel_rms: float  # root-mean-square relative residual of the fit

    def cost(self) -> RingCost:
        return RingCost(alpha=self.alpha_s, bandwidth=self.bandwidth, n=self.world_size)

    def predict(self, nbytes: float) -> float:
        return self.cost().time(self.kind, nbytes)


def fit_alpha_beta(points: list[Point], world_size: int) -> Fit:
    """Weighted least squares of t = a + b·V with weights 1/t (minimises relative error)."""
    if len(points) < 2:
        raise ValueError("need at least two sizes to fit alpha and bandwidth")
    kind = points[0].kind
    # minimise Σ ((a + b V_i − t_i) / t_i)^2 → normal equations in (a, b)
    s00 = s01 = s11 = r0 = r1 = 0.0
    for p in points:
        w = 1.0 / (p.time_s * p.time_s)
        s00 += w
        s01 += w * p.bytes
        s11 += w * p.bytes * p.bytes
        r0 += w * p.time_s
        r1 += w * p.bytes * p.time_s
    det = s00 * s11 - s01 * s01
    a = (r0 * s11 - r1 * s01) / det
    b = (s00 * r1 - s01 * r0) / det
    if a < 0 or b <= 0:
        # Noise (a loaded machine) can tilt the line; fall back to the two ends of the sweep:
        # latency from the fastest small message, bandwidth from the largest message.
        pts = sorted(points, key=lambda p: p.bytes)
        a = min(p.time_s for p in pts[: max(1, len(pts) // 2)])
        b = (pts[-1].time_s - a) / pts[-1].bytes
    if b <= 0:
        raise ValueError(f"{kind}: time does not grow with size in this sweep; widen the size range")
    alpha = a / ring_steps(kind, world_size)
    bandwidth = bus_factor(kind, world_size) / b
    fit = Fit(kind, world_size, alpha, bandwidth, 0.0)
    rms = statistics.fmean(((fit.predict(p.bytes) - p.time_s) / p.time_s) ** 2 for p in points) ** 0.5
    return Fit(kind, world_size, alpha, bandwidth, rms)


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad sweep range {min_bytes}..{max_bytes} (factor {factor})")
    sizes, v = [], min_bytes
    while v <= max_bytes:
        sizes.append(v)
        v *= factor
    return sizes


def measure_collectives(sizes: list[int], kinds=KINDS, iters: int = 10, warmup: int = 3,
                        dtype_name: str = "float32") -> list[Point]:
    """Time each collective at each size on the default process group (call on every rank); the
    AllGather and the ReduceScatter as the engine runs them (:func:`zerodp.engine.comm.gather_into`:
    in-place broadcasts on CPU; :func:`zerodp.engine.comm.reduce_scatter_into`: an all-to-all of
    the slices on CPU).

    Returns rank-0-consistent medians: each iteration's time is the max over ranks (the
    collective ends when its slowest rank does), as nccl-tests reports.
    """
    import torch
    import torch.distributed as dist

    from zerodp.engine.comm import gather_into, reduce_scatter_into

    dtype = getattr(torch, dtype_name)
    n = dist.get_world_size()
    elem = dtype.itemsize
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    points = []
    for kind in kinds:
        for nbytes in sizes:
            numel = max(n, (nbytes // elem) // n * n)
            full = torch.ones(numel, dtype=dtype, device=device)
            shard = torch.ones(numel // n, dtype=dtype, device=device)
            if kind == "all_reduce":
                op = lambda full=full: dist.all_reduce(full)  # noqa: E731
            elif kind == "reduce_scatter":
                op = lambda full=full, shard=shard: reduce_scatter_into(shard, full).wait()  # noqa: E731
            else:
                op = lambda full=full, shard=shard: gather_into(full, shard).wait()  # noqa: E731
            times = []
            for i in range(warmup + iters):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                op()
                sync()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    times.append(dt.item())
            t = statistics.median(times)
            v = numel * elem
            points.append(Point(kind, v, t, v / t, v / t * bus_factor(kind, n)))
            del full, shard
    return points


def points_table(points: list[Point], world_size: int) -> str:
    """The sweep printed as nccl-tests prints it: size, time, algbw, busbw."""
    lines = [f"# collectives on {world_size} ranks (times are medians, max over ranks)",
             f"{'collective':>15} {'size (B)':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
    for p in points:
        lines.append(f"{p.kind:>15} {p.bytes:>12d} {p.time_s * 1e6:>12.1f} {p.algbw / 1e9:>13.3f} "
                     f"{p.busbw / 1e9:>13.3f}")
    return "\n".join(lines)


def fits_table(fits: list[Fit]) -> str:
    lines = [f"{'collective':>15} {'alpha (us/hop)':>15} {'W (GB/s)':>10} {'fit rms err':>12}"]
    for f in fits:
        lines.append(f"{f.kind:>15} {f.alpha_s * 1e6:>15.2f} {f.bandwidth / 1e9:>10.3f} {f.rel_rms * 100:>11.1f}%")
    return "\n".join(lines)


def to_dicts(items) -> list[dict]:
    return [asdict(x) for x in items]
