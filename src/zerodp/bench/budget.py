"""Will ``zerodp bench`` fit this machine's memory? A budget per contender in bytes per parameter
(guide §9: what each stage shards), the groups of contenders alive at once
(:func:`zerodp.bench.schedule.stage_groups`), and a one-line refusal when even ours and its peer
alone would not fit."""

from __future__ import annotations

from zerodp.bench.contenders import CONTENDERS
from zerodp.bench.schedule import stage_groups
from zerodp.bench.spec import BenchSpec
from zerodp.plan._common import MIB

#: per rank and contender, bytes per parameter of fp32 training with AdamW, unsharded: params 4 +
#: grads 4 + Adam m, v 8, plus the transients of a step (gathered or staged copies, the optimizer's
#: temporaries) — measured peaks stay below this (docs/benchmarks.md).
BYTES_PER_PARAM_BUDGET = 24
#: what a stage's sharding takes off that budget, times (1 − 1/N): Adam's 8 B at stage 1, its
#: gradients' 4 more at stage 2, its parameters' 4 more at stage 3 (guide §9)
SHARDED_BYTES_PER_PARAM = {0: 0, 1: 8, 2: 12, 3: 16}
RANK_BASELINE_BYTES = 600 * MIB  # a rank's Python, torch and gloo before any model


def contender_budget(name: str, world_size: int) -> float:
    """Bytes per parameter a contender may hold per rank: the unsharded budget less its stage's
    sharded share (the floor and stage 0 shard nothing)."""
    stage = CONTENDERS[name][0]
    return BYTES_PER_PARAM_BUDGET - SHARDED_BYTES_PER_PARAM[stage or 0] * (1 - 1 / world_size)


def memory_needed(spec: BenchSpec, names: list[str], params: int,
                  groups: list[list[str]] | None = None) -> float:
    """Bytes the bench needs at its peak: every rank holds the costliest group at once."""
    largest = max(_group_budget(spec, g, names) for g in (groups or stage_groups(names)))
    return spec.world_size * (RANK_BASELINE_BYTES + largest * params)


def _group_budget(spec: BenchSpec, group: list[str], names: list[str]) -> float:
    return sum(contender_budget(n, spec.world_size) for n in group if n in names)


def available_bytes() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(spec: BenchSpec, names: list[str]) -> list[list[str]]:
    """The groups of contenders alive at once that fit this machine's memory (:func:`stage_groups`,
    split where a stage's whole group would not fit); refuse, in one line, a bench that would not
    fit even with ours and its peer alone."""
    from zerodp.train.model import GPT, PRESETS

    import torch

    with torch.device("meta"):
        params = GPT(PRESETS[spec.model]).num_params()
    have = available_bytes()
    if have is None:
        return stage_groups(names)
    groups = stage_groups(names, lambda g: memory_needed(spec, names, params, [g]) <= have)
    need = memory_needed(spec, names, params, groups)
    if need > have:
        raise ValueError(
            f"zerodp bench needs about {need / 2**30:.1f} GiB for model {spec.model} ({params / 1e6:.0f}M "
            f"parameters) on {spec.world_size} ranks (ours and its peer alive at once, each up to "
            f"{BYTES_PER_PARAM_BUDGET} B/param less what its stage shards), and "
            f"{have / 2**30:.1f} GiB are available: use a smaller --model or fewer --nproc")
    return groups


