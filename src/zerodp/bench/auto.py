"""``bucket_mb="auto"`` for the training app and the benchmarks: the arithmetic lives in
:mod:`zerodp.plan.calibrated` (torch-free, shared with the engine); this module adds the models
the apps know (a :class:`zerodp.train.model.GPT` or its config) and the ``python -m`` sweep.

The bucket size at the simulator's sweet spot for this model and machine.

Guide §4: small buckets pay the latency α once per bucket (thousands of collectives), huge
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
import sys

from zerodp.plan import calibrated
from zerodp.plan.calibrated import MIB, LayerShape, efficiency, eta_band, step_costs, worst_regrets


def layer_shapes(model, tokens_per_rank: int, seq_len: int | None = None) -> list[LayerShape]:
    """The simulator's layers of ``model``: a GPTConfig, a :class:`zerodp.train.model.GPT`, or
    any other ``nn.Module`` (:func:`zerodp.engine.config.module_layer_shapes`).

    A GPT config is cut by :func:`zerodp.plan.calibrated.gpt_layer_shapes` at ``seq_len`` tokens
    per sequence (default: the model's, at most ``tokens_per_rank``).
    """
    torch = sys.modules.get("torch")  # a config needs no torch; a module means torch is loaded
    if torch is not None and isinstance(model, torch.nn.Module):
        cfg = getattr(model, "cfg", None)
        if seq_len is None or cfg is None:
            from zerodp.engine.config import module_layer_shapes

            return module_layer_shapes(model, tokens_per_rank)
        model = cfg
    return calibrated.gpt_layer_shapes(model, seq_len or min(model.seq_len, tokens_per_rank))


def bucket_sweep(profile, model, tokens_per_rank: int, seq_len: int | None = None, grad_bytes_per_param: int = 4,
                 collective: str = "all_reduce", world_size: int | None = None):
    """The simulator's bucket sweep for ``model`` (anything :func:`layer_shapes` accepts)."""
    return calibrated.bucket_sweep(profile, layer_shapes(model, tokens_per_rank, seq_len), tokens_per_rank,
                                   grad_bytes_per_param, collective, world_size)


def choose_bucket_mb(profile, model, tokens_per_rank: int, seq_len: int | None = None,
                     grad_bytes_per_param: int = 4, collective: str = "all_reduce",
                     world_size: int | None = None) -> float:
    """What ``bucket_mb="auto"`` gives ``model`` (:func:`zerodp.plan.calibrated.choose_bucket_mb`)."""
    return calibrated.choose_bucket_mb(profile, layer_shapes(model, tokens_per_rank, seq_len), tokens_per_rank,
                                       grad_bytes_per_param, collective, world_size)


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
    cal = calibrated.calibration_for(args.profile)
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
