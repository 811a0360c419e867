"""Calibrate this cluster: measure α, W and compute throughput, write a hardware profile.

The planner predicts with three numbers per machine (guide §2.4, §7): the per-hop latency α, the
per-rank bandwidth W, and the compute throughput C. Here they are *measured*:

1. an nccl-tests-style sweep of AllReduce / ReduceScatter / AllGather over message sizes on the
   real process group, fitted to the alpha-beta model (:mod:`zerodp.bench.sweep`);
2. the forward, backward and optimizer time of the training model at several token counts per
   rank, all ranks in lock-step (:mod:`zerodp.bench.compute`), giving the achieved FLOP/s
   C = 6·Ψ·tokens / (forward + backward) at the largest count (guide §7.4) and, at every count,
   the times the predictor interpolates between;
3. how much of a collective really hides behind compute here (:mod:`zerodp.bench.overlap`);
4. the throughput of the engine's int8 codec (:func:`measure_quant`), which the compressed
   collectives run on every rank besides moving fewer bytes (guide §15).

The result is written as a hardware file that every ``zerodp plan`` command accepts
(``--hardware FILE``): the ``hardware`` table has the planner's schema
(:mod:`zerodp.plan.hardware`), the ``calibration`` table keeps the sweep, the fits and the
compute measurements so that ``zerodp predict`` can use them.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass

from zerodp.bench import overlap as overlap_mod
from zerodp.bench import sweep
from zerodp.bench.compute import ComputeProfile, lockstep_points, measure_compute, split_tokens

@dataclass(frozen=True)
class Calibration:
    world_size: int
    backend: str
    points: list  # sweep.Point
    fits: list  # sweep.Fit
    compute: ComputeProfile
    host: str
    overlap: overlap_mod.Overlap | None = None  # None: not measured, the simulator's η = 1
    quant: dict | None = None  # int8 codec throughput (measure_quant); None: not measured, priced 0

    def fit(self, kind: str) -> sweep.Fit:
        return next(f for f in self.fits if f.kind == kind)

    def hardware(self, name: str | None = None, hbm_bytes: float | None = None) -> dict:
        """The planner's hardware schema: C from the model run, α and W from the AllReduce fit."""
        ar = self.fit("all_reduce")
        return {
            "name": name or f"calibrated-{self.host}",
            "flops": self.compute.flops,
            "hbm_bytes": hbm_bytes or _memory_bytes(),
            "intra_bw": ar.bandwidth,
            "devices_per_node": self.world_size,
            "inter_bw": 0.0,
            "alpha": ar.alpha_s,
            "note": (f"measured by zerodp calibrate on {self.world_size} {self.backend} ranks, "
                     f"model {self.compute.model}, {self.compute.tokens} tokens/rank"),
        }

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware(),
            "calibration": {
                "world_size": self.world_size,
                "backend": self.backend,
                "host": self.host,
                "sweep": sweep.to_dicts(self.points),
                "fits": sweep.to_dicts(self.fits),
                "compute": self.compute.to_dict(),
                "overlap": self.overlap.to_dict() if self.overlap else None,
                "quant": self.quant,
            },
        }


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1e9


DEFAULT_TOKENS = (32, 256, 2048)  # tokens per rank: the bench's two regimes and one between


QUANT_NUMEL = 1 << 21  # elements per timed int8 quantize / dequantize (8 MiB of fp32)


def measure_quant(numel: int = QUANT_NUMEL, block: int = 256, iters: int = 5) -> dict:
    """Seconds per element of the engine's int8 codec (guide §15) on this rank, all ranks at once
    (the collectives' compressed paths run it on every rank together): ``quantize_int8`` of fp32
    values and ``dequantize_int8`` back to fp32, medians of ``iters`` after one untimed call. The
    predictor charges them to the compressed contenders' steps (:func:`zerodp.bench.predict.quant_time`)."""
    import statistics

    import torch
    import torch.distributed as dist

    from zerodp.engine.quant import dequantize_int8, quantize_int8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    times: dict[str, list[float]] = {"quantize": [], "dequantize": []}
    q, s = quantize_int8(x, block)
    dequantize_int8(q, s, block)
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        q, s = quantize_int8(x, block)
        t1 = time.perf_counter()
        dequantize_int8(q, s, block)
        t2 = time.perf_counter()
        times["quantize"].append(t1 - t0)
        times["dequantize"].append(t2 - t1)
    return {"block": block, "numel": numel,
            "quantize_s_per_elem": statistics.median(times["quantize"]) / numel,
            "dequantize_s_per_elem": statistics.median(times["dequantize"]) / numel}


def _rank_calibrate(rank: int, world: int, sizes: list[int], iters: int, model: str, tokens: list[int]):
    points = sweep.measure_collectives(sizes, iters=iters)
    params, compute = measure_compute(model, tokens)
    return (points, params, compute, overlap_mod.measure_overlap(model, min(tokens), max(sizes)),
            measure_quant())


def calibrate(world_size: int = 2, min_bytes: int = 4096, max_bytes: int = 64 << 20, iters: int = 10,
              model: str = "small", tokens: tuple[int, ...] = DEFAULT_TOKENS,
              timeout: float = 900.0) -> Calibration:
    """Run the sweep and the compute measurement on ``world_size`` local ranks (gloo).

    ``tokens``: tokens per rank at which to time the model's compute (sequences of the model's
    length, or one shorter sequence)."""
    from zerodp.spawn import run_local
    from zerodp.train.model import PRESETS

    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; use one of {', '.join(PRESETS)}")
    tokens = sorted(set(tokens))
    if not tokens or tokens[0] < 1:
        raise ValueError(f"tokens per rank must be positive integers, got {tokens}")
    seq_len = PRESETS[model].seq_len
    for t in tokens:  # refuse before spawning
        split_tokens(t, seq_len)
    sizes = sweep.sweep_sizes(min_bytes, max_bytes)
    results = run_local(_rank_calibrate, world_size, sizes, iters, model, tokens, timeout=timeout)
    points = results[0][0]
    compute = ComputeProfile.from_points(model, results[0][1], lockstep_points([r[2] for r in results], seq_len))
    fits = [sweep.fit_alpha_beta([p for p in points if p.kind == k], world_size) for k in sweep.KINDS]
    quant = {k: max(r[4][k] for r in results) for k in results[0][4]}  # the slowest rank
    return Calibration(world_size, "gloo", points, fits, compute, platform.node() or "host",
                       overlap_mod.aggregate([r[3] for r in results]), quant)


def write_profile(cal: Calibration, path: str) -> str:
    """Write the profile JSON atomically (never a half-written file under ``path``)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cal.to_dict(), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
