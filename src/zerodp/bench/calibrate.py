"""Calibrate this cluster: measure α, W and compute throughput, write a hardware profile.

The planner predicts with three numbers per machine (seed §2.4, §7): the per-hop latency α, the
per-rank bandwidth W, and the compute throughput C. Here they are *measured*:

1. an nccl-tests-style sweep of AllReduce / ReduceScatter / AllGather over message sizes on the
   real process group, fitted to the alpha-beta model (:mod:`zerodp.bench.sweep`);
2. the forward, backward and optimizer time of the training model on every rank at once (the same
   contention as training, no communication), giving the achieved FLOP/s
   C = 6·Ψ·tokens / (forward + backward) (2Ψ per token forward, 4Ψ backward; seed §7.4) and the
   optimizer's cost per parameter.

The result is written as a hardware file that every ``zerodp plan`` command accepts
(``--hardware FILE``): the ``hardware`` table has the planner's schema
(:mod:`zerodp.plan.hardware`), the ``calibration`` table keeps the sweep, the fits and the
compute measurements so that ``zerodp predict`` can use them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

from zerodp.bench import sweep
from zerodp.plan.roofline import BACKWARD_FLOPS_PER_TOKEN_PARAM, FORWARD_FLOPS_PER_TOKEN_PARAM

FLOPS_PER_TOKEN_PARAM = FORWARD_FLOPS_PER_TOKEN_PARAM + BACKWARD_FLOPS_PER_TOKEN_PARAM  # 2 + 4 (seed §7.4)


@dataclass(frozen=True)
class ComputeProfile:
    """Measured per-rank compute of the model (medians over iterations) at two token counts.

    A step has a fixed part (Python, kernel launches, the optimizer's loop) and a part linear in
    tokens (seed §7.1); measuring at ``tokens`` and at ``small_tokens`` separates the two, so that
    predictions hold at 32 tokens per rank as well as at 2048.
    """

    model: str
    params: int
    tokens: int  # per rank per micro-batch, the main measurement
    forward_s: float
    backward_s: float
    optimizer_s: float  # AdamW step over all parameters, fp32
    small_tokens: int = 0
    small_forward_s: float = 0.0
    small_backward_s: float = 0.0

    @property
    def flops(self) -> float:
        """Achieved FLOP/s at the main size, C = 6·Ψ·tokens / (forward + backward)."""
        return FLOPS_PER_TOKEN_PARAM * self.params * self.tokens / (self.forward_s + self.backward_s)

    @property
    def optimizer_s_per_param(self) -> float:
        return self.optimizer_s / self.params

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flops"] = self.flops
        d["optimizer_s_per_param"] = self.optimizer_s_per_param
        return d


def _affine(t_small: float, n_small: int, t_main: float, n_main: int, tokens: int) -> float:
    """t(tokens) through the two measurements (fixed ≥ 0 + per-token), linear when one is missing."""
    if n_small <= 0 or n_small >= n_main:
        return t_main * tokens / n_main
    per_token = max(0.0, (t_main - t_small) / (n_main - n_small))
    fixed = max(0.0, t_main - per_token * n_main)
    return fixed + per_token * tokens


def compute_times(compute: dict, tokens: int) -> tuple[float, float]:
    """(forward_s, backward_s) at ``tokens`` per rank from a profile's ``compute`` table."""
    small = compute.get("small_tokens", 0)
    return (_affine(compute.get("small_forward_s", 0.0), small, compute["forward_s"], compute["tokens"], tokens),
            _affine(compute.get("small_backward_s", 0.0), small, compute["backward_s"], compute["tokens"], tokens))


def _time_model(model, opt, x, iters: int, warmup: int) -> tuple[float, float, float]:
    fwd, bwd, step = [], [], []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        loss = model(x, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            step.append(t3 - t2)
    return statistics.median(fwd), statistics.median(bwd), statistics.median(step)


def measure_compute(model_name: str, micro_batch: int, seq_len: int | None = None,
                    iters: int = 5, warmup: int = 2, seed: int = 0) -> ComputeProfile:
    """Time forward, backward and an AdamW step of the GPT preset on this rank (no communication),
    at ``micro_batch`` sequences and at one short sequence (the fixed cost)."""
    import torch

    from zerodp.train.model import GPT, PRESETS

    if model_name not in PRESETS:
        raise ValueError(f"unknown model preset {model_name!r}; use one of {', '.join(PRESETS)}")
    cfg = PRESETS[model_name]
    seq = seq_len or cfg.seq_len
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (micro_batch, seq))
    fwd, bwd, step = _time_model(model, opt, x, iters, warmup)
    small_seq = max(1, min(seq // 8, 32))
    sf, sb, _ = _time_model(model, opt, x[:1, :small_seq], iters, warmup)
    return ComputeProfile(model_name, model.num_params(), micro_batch * seq, fwd, bwd, step,
                          small_seq, sf, sb)


@dataclass(frozen=True)
class Calibration:
    world_size: int
    backend: str
    points: list  # sweep.Point
    fits: list  # sweep.Fit
    compute: ComputeProfile
    host: str

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
            },
        }


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1e9


def _rank_calibrate(rank: int, world: int, sizes: list[int], iters: int, model: str,
                    micro_batch: int, seq_len: int | None):
    import torch.distributed as dist

    points = sweep.measure_collectives(sizes, iters=iters)
    dist.barrier()
    compute = measure_compute(model, micro_batch, seq_len)
    return points, compute


def calibrate(world_size: int = 2, min_bytes: int = 4096, max_bytes: int = 64 << 20, iters: int = 10,
              model: str = "small", micro_batch: int = 4, seq_len: int | None = None,
              timeout: float = 900.0) -> Calibration:
    """Run the sweep and the compute measurement on ``world_size`` local ranks (gloo)."""
    from zerodp.spawn import run_local

    sizes = sweep.sweep_sizes(min_bytes, max_bytes)
    results = run_local(_rank_calibrate, world_size, sizes, iters, model, micro_batch, seq_len,
                        timeout=timeout)
    points = results[0][0]
    computes = [r[1] for r in results]
    # Each rank timed its own compute under the same contention: take the slowest (the step waits for it).
    compute = max(computes, key=lambda c: c.forward_s + c.backward_s)
    fits = [sweep.fit_alpha_beta([p for p in points if p.kind == k], world_size) for k in sweep.KINDS]
    return Calibration(world_size, "gloo", points, fits, compute, platform.node() or "host")


def write_profile(cal: Calibration, path: str) -> str:
    """Write the profile JSON atomically (never a half-written file under ``path``)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cal.to_dict(), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_calibration(path: str) -> dict:
    """The ``calibration`` table of a profile written by :func:`write_profile`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"profile {path!r} not found: run 'zerodp calibrate --out {path}' first")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); re-run zerodp calibrate") from None
    if "calibration" not in data or "hardware" not in data:
        raise ValueError(f"{path}: not a zerodp calibration profile (no 'calibration'/'hardware' tables)")
    return data
