"""The model's compute on this machine, measured at several token counts, and interpolated.

Guide §7.1: a step's compute has a part linear in the tokens per rank (6·Ψ FLOPs per token: 2Ψ
forward, 4Ψ backward, §7.4) and a fixed part (Python, kernel launches, the optimizer's pass over
the parameters) that dominates at a few tokens. :func:`measure_compute` times forward, backward
and the AdamW step of a GPT preset at each requested count, on every rank at once and in
lock-step (a barrier before each iteration; :func:`lockstep_points` keeps the slowest rank): the
same contention and the same waiting as a training step, without communication.
:func:`compute_times` and :func:`optimizer_time` interpolate between the measured counts, which is
what the predictor (:mod:`zerodp.bench.predict`) and ``bucket_mb="auto"`` use.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from zerodp.plan.calibrated import _measured
from zerodp.plan.roofline import BACKWARD_FLOPS_PER_TOKEN_PARAM, FORWARD_FLOPS_PER_TOKEN_PARAM

FLOPS_PER_TOKEN_PARAM = FORWARD_FLOPS_PER_TOKEN_PARAM + BACKWARD_FLOPS_PER_TOKEN_PARAM  # 2 + 4 (guide §7.4)


@dataclass(frozen=True)
class ComputePoint:
    """Per-rank compute of one step at ``tokens`` per rank (``micro_batch`` × ``seq_len``):
    medians over lock-step iterations of the slowest rank (module docstring)."""

    tokens: int
    micro_batch: int
    seq_len: int
    forward_s: float
    backward_s: float
    optimizer_s: float  # AdamW step + zero_grad over all parameters, fp32


@dataclass(frozen=True)
class ComputeProfile:
    """Measured compute of the model: the main size (the largest) and every measured size.

    A step has a fixed part (Python, kernel launches, the optimizer's pass over the parameters)
    and a part linear in tokens (guide §7.1). Measuring at several token counts lets
    :func:`compute_times` interpolate between them, so that predictions hold at 32 tokens per rank
    as well as at 2048.
    """

    model: str
    params: int
    tokens: int  # the main measurement: C and the optimizer's cost per parameter come from it
    forward_s: float
    backward_s: float
    optimizer_s: float
    points: tuple[ComputePoint, ...] = ()  # every measured size, the main one included

    @property
    def flops(self) -> float:
        """Achieved FLOP/s at the main size, C = 6·Ψ·tokens / (forward + backward)."""
        return FLOPS_PER_TOKEN_PARAM * self.params * self.tokens / (self.forward_s + self.backward_s)

    @property
    def optimizer_s_per_param(self) -> float:
        return self.optimizer_s / self.params

    @classmethod
    def from_points(cls, model: str, params: int, points: list[ComputePoint]) -> "ComputeProfile":
        if not points:
            raise ValueError("no compute measurement to build a profile from")
        pts = tuple(sorted(points, key=lambda p: p.tokens))
        main = pts[-1]
        return cls(model, params, main.tokens, main.forward_s, main.backward_s, main.optimizer_s, pts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["points"] = [asdict(p) for p in self.points]
        d["flops"] = self.flops
        d["optimizer_s_per_param"] = self.optimizer_s_per_param
        return d




def compute_table(compute: dict) -> str:
    """The compute measurements of a profile, one line per token count (ms, slowest rank)."""
    lines = [f"# compute of {compute['model']} ({compute['params'] / 1e6:.2f}M params) per rank, "
             f"ranks in lock-step, medians of the slowest rank",
             f"{'tokens/rank':>11} {'batch×seq':>9} {'forward ms':>11} {'backward ms':>12} "
             f"{'AdamW ms':>9} {'GFLOP/s':>8}"]
    for t, p in _measured(compute):
        shape = f"{p['micro_batch']}×{p['seq_len']}" if "micro_batch" in p else "-"
        fb = p["forward_s"] + p["backward_s"]
        lines.append(f"{t:>11} {shape:>9} {p['forward_s'] * 1e3:>11.1f} {p['backward_s'] * 1e3:>12.1f} "
                     f"{p['optimizer_s'] * 1e3:>9.1f} {FLOPS_PER_TOKEN_PARAM * compute['params'] * t / fb / 1e9:>8.2f}")
    lines.append(f"C = {compute['flops'] / 1e9:.2f} GFLOP/s per rank at {compute['tokens']} tokens/rank")
    return "\n".join(lines)


def iterations_for(tokens: int, largest: int, minimum: int = 5, maximum: int = 30) -> int:
    """Timed iterations at one size: cheap sizes get more (they are noisier); every rank computes
    the same number, so their barriers pair up."""
    return max(minimum, min(maximum, minimum * largest // max(1, tokens)))


def split_tokens(tokens: int, seq_len: int) -> tuple[int, int]:
    """(micro_batch, seq) with whole sequences of the model's length when possible."""
    seq = min(tokens, seq_len)
    if tokens % seq:
        raise ValueError(f"{tokens} tokens per rank is not a multiple of the model's seq_len {seq_len}; "
                         f"give tokens up to {seq_len} or multiples of it")
    return tokens // seq, seq


def measure_compute(model_name: str, tokens: list[int], warmup: int = 2,
                    seed: int = 0) -> tuple[int, dict[int, list]]:
    """Time forward, backward and AdamW step + zero_grad of the GPT preset on this rank (no
    communication) at each token count; with a process group, every iteration starts at a barrier
    so that all ranks compute at once, as in training. Returns the model's parameter count and
    {tokens: [(fwd, bwd, opt), ...]}."""
    import torch
    import torch.distributed as dist

    from zerodp.train.model import GPT, PRESETS

    if model_name not in PRESETS:
        raise ValueError(f"unknown model preset {model_name!r}; use one of {', '.join(PRESETS)}")
    cfg = PRESETS[model_name]
    shapes = {t: split_tokens(t, cfg.seq_len) for t in tokens}
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed)
    sync = dist.is_available() and dist.is_initialized()
    out = {}
    for t in sorted(tokens, reverse=True):
        mb, seq = shapes[t]
        x = torch.randint(0, cfg.vocab_size, (mb, seq), generator=gen)
        times = []
        for i in range(warmup + iterations_for(t, max(tokens))):
            if sync:
                dist.barrier()
            t0 = time.perf_counter()
            loss = model(x, x)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=False)
            t3 = time.perf_counter()
            if i >= warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
        out[t] = times
    return model.num_params(), out


def lockstep_points(per_rank: list[dict[int, list]], seq_len: int) -> list[ComputePoint]:
    """The step waits for the slowest rank: per iteration, forward and backward of the rank with the
    longest forward + backward, and the longest optimizer step; then medians over iterations."""
    points = []
    for t in sorted(per_rank[0]):
        rows = list(zip(*(r[t] for r in per_rank)))  # per iteration: one (f, b, o) per rank
        fb = [max(row, key=lambda v: v[0] + v[1]) for row in rows]
        mb, seq = split_tokens(t, seq_len)
        points.append(ComputePoint(t, mb, seq, statistics.median(v[0] for v in fb),
                                   statistics.median(v[1] for v in fb),
                                   statistics.median(max(v[2] for v in row) for row in rows)))
    return points
