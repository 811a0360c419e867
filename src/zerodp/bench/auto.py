"""``bucket_mb="auto"``: the bucket size at the simulator's sweet spot for this model and machine.

Seed §4: small buckets pay the latency α once per bucket (thousands of collectives), huge
buckets leave the last bucket's whole AllReduce exposed after backward; in between lies a wide
sweet spot where only a small tail shows. With a calibration profile (``zerodp calibrate``: α, W
per collective, measured forward/backward time) the planner's event simulation of one backward
(:func:`zerodp.plan.timeline.sweep_buckets`) over the model's layers
(:func:`zerodp.bench.predict.split_compute`) finds that spot.

What a size costs: the exposed communication the simulator finds, plus — where communication
shares the processor with compute (a CPU, measured as the overlap efficiency η by
``zerodp calibrate``, :mod:`zerodp.bench.overlap`) — (1 − η) of the communication it hid
(:func:`step_costs`). η = 1 favours many buckets (all but the tail hides), η = 0 few (only the
total counts), and in between lies a wide flat region. η itself is measured on one pattern (one
AllReduce against a forward + backward) and moves by a tenth or so from run to run, so the choice
is robust rather than exact: the size whose worst relative excess over the best size, for any η
within :data:`ETA_UNCERTAINTY` of the measured one, is least (minimax regret,
:func:`worst_regrets`). Among sizes within :data:`REGRET_TOLERANCE` of that, the largest: the
simulator prices a collective by α and W only, but every bucket also costs host work the model
does not see (a hook, a launch, a wait).

Which model: a :class:`zerodp.train.model.GPT` (or its config) is cut into embedding, blocks and
head (:func:`zerodp.bench.predict.gpt_layer_shapes`); any other ``nn.Module`` into one layer per
module that owns trainable parameters (:func:`module_layer_shapes`). The engine calls
:func:`choose_bucket_mb` once, at construction, for ``parallelize(..., bucket_mb="auto")``
(:func:`zerodp.engine.config.resolve_auto_bucket`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

from zerodp.bench.overlap import contention_s, efficiency
from zerodp.plan.timeline import sweep_buckets

if TYPE_CHECKING:
    from zerodp.bench.predict import LayerShape

ETA_UNCERTAINTY = 0.25  # η is measured on one pattern and varies run to run (bench.overlap)
REGRET_TOLERANCE = 0.01  # sizes whose worst regret is within 1 % of the least count as equal
SWEET_SPOT_SLACK_S = 1e-4  # absolute slack: differences below 0.1 ms are noise on any machine
MIB = 2**20


def _calibration_table(profile) -> dict:
    """Accept a profile path, a whole profile dict, or its ``calibration`` table."""
    if isinstance(profile, (str, os.PathLike)):
        from zerodp.bench.calibrate import load_calibration

        return load_calibration(os.fspath(profile))["calibration"]
    if isinstance(profile, dict) and "calibration" in profile:
        return profile["calibration"]
    if isinstance(profile, dict) and {"fits", "compute", "world_size"} <= set(profile):
        return profile
    raise ValueError("expected a calibration profile (a path written by 'zerodp calibrate', the "
                     "profile dict, or its 'calibration' table with 'fits', 'compute', 'world_size')")


def _is_module(model) -> bool:
    """True for a ``torch.nn.Module`` (without importing torch for a config: no torch, no module)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def module_layer_shapes(module) -> list[LayerShape]:
    """The simulator's layers of any ``nn.Module``, from its parameters alone (seed §4).

    Modules are walked in registration order (``named_modules``), which stands for forward order;
    each module that directly owns trainable parameters is one layer. ``params`` counts the
    trainable parameters it owns, a shared (tied) parameter only at its first owner, where the
    engine's flat buffers hold it too; ``matmul_params`` counts all of them — a tied head still
    multiplies — except for ``nn.Embedding``, whose lookup costs no FLOPs. No attention term: a
    generic module's compute is shared out by its weights alone.
    """
    import torch.nn as nn

    from zerodp.bench.predict import LayerShape

    seen: set[int] = set()
    shapes = []
    for name, sub in module.named_modules():
        own = [p for p in sub.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        new = [p for p in own if id(p) not in seen]
        seen.update(id(p) for p in new)
        matmul = 0 if isinstance(sub, nn.Embedding) else sum(p.numel() for p in own)
        shapes.append(LayerShape(name or type(sub).__name__, sum(p.numel() for p in new), matmul))
    if not shapes:
        raise ValueError("the model has no trainable parameters: no gradient buckets to size")
    return shapes


def layer_shapes(model, tokens_per_rank: int, seq_len: int | None = None) -> list[LayerShape]:
    """The simulator's layers of ``model``: a GPTConfig, a :class:`zerodp.train.model.GPT`, or
    any other ``nn.Module`` (:func:`module_layer_shapes`).

    A GPT (config or module) is cut by :func:`zerodp.bench.predict.gpt_layer_shapes` at
    ``seq_len`` tokens per sequence (default: the model's, at most ``tokens_per_rank``).
    """
    from zerodp.bench.predict import gpt_layer_shapes

    if _is_module(model):
        from zerodp.train.model import GPTConfig

        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, GPTConfig):
            return module_layer_shapes(model)
        model = cfg
    return gpt_layer_shapes(model, seq_len or min(model.seq_len, tokens_per_rank))


def calibration_for(profile, world_size: int | None = None) -> dict:
    """The ``calibration`` table of ``profile`` (path, dict or table), checked for ``world_size``.

    α and W are fitted per world size (seed §2.4): a profile holds for its own group size only, so
    one measured on another number of ranks is a ``ValueError`` (when ``world_size`` is given).
    """
    cal = _calibration_table(profile)
    if world_size is not None and cal["world_size"] != world_size:
        raise ValueError(
            f"the calibration profile was measured on {cal['world_size']} ranks, but this process group "
            f"has {world_size}: its collective fits (α, W) do not hold here; calibrate on this many "
            f"ranks ('zerodp calibrate --nproc {world_size}') or give bucket_mb a number of MiB")
    return cal


def bucket_sweep(profile, model_cfg, tokens_per_rank: int, seq_len: int | None = None,
                 grad_bytes_per_param: int = 4, collective: str = "all_reduce",
                 world_size: int | None = None):
    """The simulator's bucket sweep (:class:`zerodp.plan.timeline.BucketSweep`) for this model.

    ``model_cfg``: anything :func:`layer_shapes` accepts. ``world_size``: when given, the size of
    the process group the buckets are for; a profile calibrated on another size is refused.
    """
    from zerodp.bench.compute import compute_times
    from zerodp.bench.predict import _PerKindCost, split_compute

    cal = calibration_for(profile, world_size)
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) or tokens_per_rank < 1:
        raise ValueError(f"tokens_per_rank must be a positive integer, got {tokens_per_rank!r}")
    shapes = layer_shapes(model_cfg, tokens_per_rank, seq_len)
    layers = split_compute(shapes, tokens_per_rank, *compute_times(cal["compute"], tokens_per_rank),
                           grad_bytes_per_param)
    return sweep_buckets(layers, _PerKindCost(cal), collective=collective, split_layers=False)


def choose_bucket_mb(profile, model_cfg, tokens_per_rank: int, seq_len: int | None = None,
                     grad_bytes_per_param: int = 4, collective: str = "all_reduce",
                     world_size: int | None = None) -> float:
    """Bucket size in MiB at the simulated sweet spot (module docstring, seed §4) for a model.

    ``profile``: a calibration profile (path, dict, or its ``calibration`` table);
    ``model_cfg``: a :class:`zerodp.train.model.GPTConfig`, a ``GPT`` module or any ``nn.Module``
    (see :func:`layer_shapes`); ``tokens_per_rank``: micro-batch × sequence length on each rank;
    ``grad_bytes_per_param``: bytes of one gradient element as communicated (4 fp32, 2 bf16);
    ``collective``: ``"all_reduce"`` (stage 0) or ``"reduce_scatter"`` (stages 1-2);
    ``world_size``: when given, must equal the profile's (else ``ValueError``).
    """
    cal = calibration_for(profile, world_size)  # read once, used twice
    sweep = bucket_sweep(cal, model_cfg, tokens_per_rank, seq_len, grad_bytes_per_param, collective)
    regret = worst_regrets(sweep, efficiency(cal))
    limit = min(regret) + REGRET_TOLERANCE
    return max(p.bucket_bytes for p, r in zip(sweep.points, regret) if r <= limit) / MIB


def eta_band(eta: float, points: int = 9) -> list[float]:
    """Overlap efficiencies within :data:`ETA_UNCERTAINTY` of the measured one, clipped to [0, 1]."""
    lo, hi = max(0.0, eta - ETA_UNCERTAINTY), min(1.0, eta + ETA_UNCERTAINTY)
    return [lo + (hi - lo) * i / (points - 1) for i in range(points)]


def worst_regrets(sweep, eta: float = 1.0) -> list[float]:
    """Per swept size, its worst relative excess over the best size, over :func:`eta_band`:
    max over η of (cost + slack) / (best cost + slack) − 1."""
    regret = [0.0] * len(sweep.points)
    for e in eta_band(eta):
        cost = step_costs(sweep, e)
        best = min(cost) + SWEET_SPOT_SLACK_S
        regret = [max(r, (c + SWEET_SPOT_SLACK_S) / best - 1) for r, c in zip(regret, cost)]
    return regret


def step_costs(sweep, eta: float = 1.0) -> list[float]:
    """What each swept bucket size adds to the step: the exposed communication, plus (1 − η) of
    the hidden part where communication shares the processor with compute (bench.overlap)."""
    return [p.exposed_comm_s + contention_s(p.comm_s - p.exposed_comm_s, eta) for p in sweep.points]


def main(argv: list[str] | None = None) -> None:
    """``python -m zerodp.bench.auto PROFILE [--model small] [--tokens 2048]``: print the sweep."""
    import argparse

    from zerodp.train.model import PRESETS

    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.auto", description=main.__doc__)
    ap.add_argument("profile")
    ap.add_argument("--model", default="small", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.model]
    cal = _calibration_table(args.profile)
    sweep = bucket_sweep(cal, cfg, args.tokens)
    chosen = choose_bucket_mb(cal, cfg, args.tokens)
    eta = efficiency(cal)
    cost = step_costs(sweep, eta)
    regret = worst_regrets(sweep, eta)
    if args.json:
        print(json.dumps({"sweep": sweep.to_dict(), "overlap_efficiency": eta, "step_cost_s": cost,
                          "worst_regret": regret, "bucket_mb": chosen}, indent=2))
        return
    band = eta_band(eta)
    print(f"overlap efficiency η = {eta:.2f}; cost = exposed + (1 − η) × hidden communication; "
          f"worst regret over η in [{band[0]:.2f}, {band[-1]:.2f}]")
    print(f"{'bucket (MiB)':>13} {'buckets':>8} {'comm (ms)':>10} {'exposed (ms)':>13} {'cost (ms)':>10} "
          f"{'worst regret':>13}")
    for p, c, r in zip(sweep.points, cost, regret):
        mark = "  <- auto" if abs(p.bucket_bytes / MIB - chosen) < 1e-12 else ""
        print(f"{p.bucket_bytes / MIB:>13.3f} {p.num_buckets:>8} {p.comm_s * 1e3:>10.2f} "
              f"{p.exposed_comm_s * 1e3:>13.2f} {c * 1e3:>10.2f} {r * 100:>12.1f}%{mark}")

if __name__ == "__main__":
    main()
