"""Synthetic calibration profiles for tests: α, W and compute are given, not measured."""

from zerodp.bench import sweep
from zerodp.bench.calibrate import Calibration, write_profile
from zerodp.bench.compute import ComputeProfile
from zerodp.plan.collectives import RingCost, bus_factor
from zerodp.train.model import PRESETS

PARAMS = {"nano": 43_904, "small": 11_000_000}


def collective_sweep(alpha: float, bandwidth: float, world: int):
    """Sweep points priced exactly by the ring model, and their alpha-beta fits."""
    cost = RingCost(alpha=alpha, bandwidth=bandwidth, n=world)
    points = []
    for kind in sweep.KINDS:
        for v in (4096, 65536, 1 << 20, 16 << 20):
            t = cost.time(kind, v)
            points.append(sweep.Point(kind, v, t, v / t, v / t * bus_factor(kind, world)))
    fits = [sweep.fit_alpha_beta([p for p in points if p.kind == k], world) for k in sweep.KINDS]
    return points, fits


def synthetic_profile(path, alpha=50e-6, bandwidth=1e9, flops=2e9, world=2, model="nano") -> str:
    """A profile as ``zerodp calibrate`` writes it, from a known α, W and C (no measurement)."""
    points, fits = collective_sweep(alpha, bandwidth, world)
    params, tokens = PARAMS[model], 2 * PRESETS[model].seq_len
    fb = 6 * params * tokens / flops
    comp = ComputeProfile(model, params, tokens, fb / 3, 2 * fb / 3, 1e-9 * params)
    return write_profile(Calibration(world, "gloo", points, fits, comp, "test"), str(path))
