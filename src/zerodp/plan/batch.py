"""Global batch planner (guide §6, §6.1).

gbs = mbs × grad_acc × dp. From a target global batch in tokens and a sequence length, gbs in
samples is rounded to the nearest power of two (guide §6.1: "取最近的 2 的幂"); then
grad_acc = gbs/(mbs·dp). grad_acc < 1 means GPU-rich: use fewer GPUs, a larger gbs, or a smaller
mbs (guide §6.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerodp.plan._common import InputError, ToDict, check_count, check_positive

#: a step of more micro-steps than this is not a plan anyone runs
MAX_GRAD_ACC = 1_000_000


@dataclass(frozen=True)
class BatchPlan(ToDict):
    """``to_dict()`` keys: ``target_tokens``, ``seq``, ``micro_batch``, ``dp``, ``samples`` (gbs in
    samples), ``grad_acc`` (integer steps, at least 1), ``exact_grad_acc`` (gbs/(mbs·dp) before
    rounding), ``global_batch_tokens`` (samples·seq), ``effective_samples``
    (mbs·grad_acc·dp, what one step really processes), ``tokens_per_gpu_per_micro`` (mbs·seq),
    ``gpu_rich``, ``warnings`` (list of sentences)."""

    target_tokens: float
    seq: int
    micro_batch: int
    dp: int
    samples: int
    grad_acc: int
    exact_grad_acc: float
    global_batch_tokens: int
    effective_samples: int
    tokens_per_gpu_per_micro: int
    gpu_rich: bool
    warnings: list = field(default_factory=list)


def nearest_power_of_two(x: float) -> int:
    """The power of two nearest to ``x`` on a log scale (ties go up)."""
    check_positive("x", x)
    return 2 ** max(0, round(math.log2(x)))


def plan_batch(target_tokens: float, seq: int, micro_batch: int, dp: int,
               round_to_power_of_two: bool = True) -> BatchPlan:
    """Samples and grad_acc for a target global batch in tokens (guide §6.1)."""
    check_positive("target_tokens", target_tokens)
    seq = check_count("seq", seq)
    mbs = check_count("micro_batch", micro_batch)
    dp = check_count("dp (GPUs)", dp)
    raw = target_tokens / seq
    if raw < 1:
        raise InputError(f"target_tokens ({target_tokens:g}) is less than one sequence of {seq}",
                         "target_tokens", f"目标批次（{target_tokens:g} 个 token）不足一条长度为 "
                         f"{seq} 的序列")
    samples = nearest_power_of_two(raw) if round_to_power_of_two else int(round(raw))
    exact = samples / (mbs * dp)
    warnings = []
    gpu_rich = exact < 1
    if gpu_rich:
        grad_acc = 1
        warnings.append(
            f"GPU-rich: gbs {samples} samples < mbs*dp = {mbs * dp}; use at most "
            f"{max(samples // mbs, 1)} GPUs, a larger gbs, or a smaller micro-batch")
    else:
        grad_acc = max(1, round(exact))
        if samples % (mbs * dp):
            warnings.append(
                f"not divisible: gbs {samples} / (mbs {mbs} x dp {dp}) = {exact:.3g}; "
                f"grad_acc {grad_acc} gives {mbs * grad_acc * dp} samples per step")
    if grad_acc > MAX_GRAD_ACC:
        raise InputError(f"target_tokens {target_tokens:,.0f} needs grad_acc {grad_acc:,} (over "
                         f"{MAX_GRAD_ACC:,}): no run takes that many micro-steps per step; lower "
                         "the target or raise the micro-batch or dp", "target_tokens",
                         f"目标批次需要梯度累积 {grad_acc:,} 步（超过 {MAX_GRAD_ACC:,}）：请减小目标"
                         "批次，或加大微批次或卡数")
    effective = mbs * grad_acc * dp
    return BatchPlan(target_tokens, seq, mbs, dp, samples, grad_acc, exact, samples * seq,
                     effective, mbs * seq, gpu_rich, warnings)
