"""``bucket_mb="auto"``: the bucket size at the simulator's sweet spot for this model and machine.

Seed §4: small buckets pay the latency α once per bucket (thousands of collectives), huge
buckets leave the last bucket's whole AllReduce exposed after backward; in between lies a wide
sweet spot where only a small tail shows. With a calibration profile (``zerodp calibrate``: α, W
per collective, measured forward/backward time) the planner's event simulation of one backward
(:func:`zerodp.plan.timeline.sweep_buckets`) over the model's layers
(:func:`zerodp.bench.predict.split_compute`) finds that spot.

Which size inside the spot: the simulator prices a collective by α and W only, but every bucket
also costs host work the model does not see (a hook, a launch, a wait). So among the sizes whose
simulated exposed communication is within :data:`SWEET_SPOT_TOLERANCE` of the best, take the
largest — the fewest collectives for (almost) the same exposed tail.
"""

from __future__ import annotations

import json
import os

from zerodp.plan.timeline import sweep_buckets

SWEET_SPOT_TOLERANCE = 0.05  # relative to the best exposed communication
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


def bucket_sweep(profile, model_cfg, tokens_per_rank: int, seq_len: int | None = None,
                 grad_bytes_per_param: int = 4, collective: str = "all_reduce"):
    """The simulator's bucket sweep (:class:`zerodp.plan.timeline.BucketSweep`) for this model."""
    from zerodp.bench.calibrate import compute_times
    from zerodp.bench.predict import _PerKindCost, gpt_layer_shapes, split_compute

    cal = _calibration_table(profile)
    if not isinstance(tokens_per_rank, int) or tokens_per_rank < 1:
        raise ValueError(f"tokens_per_rank must be a positive integer, got {tokens_per_rank!r}")
    seq = seq_len or min(model_cfg.seq_len, tokens_per_rank)
    comp = cal["compute"]
    layers = split_compute(gpt_layer_shapes(model_cfg, seq), tokens_per_rank,
                           *compute_times(comp, tokens_per_rank), grad_bytes_per_param)
    return sweep_buckets(layers, _PerKindCost(cal), collective=collective, split_layers=False)


def choose_bucket_mb(profile, model_cfg, tokens_per_rank: int, seq_len: int | None = None,
                     grad_bytes_per_param: int = 4, collective: str = "all_reduce") -> float:
    """Bucket size in MiB at the simulated sweet spot (module docstring) for ``model_cfg``.

    ``profile``: a calibration profile (path, dict, or its ``calibration`` table);
    ``model_cfg``: a :class:`zerodp.train.model.GPTConfig`; ``tokens_per_rank``: micro-batch ×
    sequence length on each rank.
    """
    sweep = bucket_sweep(profile, model_cfg, tokens_per_rank, seq_len, grad_bytes_per_param, collective)
    limit = sweep.best_exposed_comm_s * (1 + SWEET_SPOT_TOLERANCE) + SWEET_SPOT_SLACK_S
    spot = [p for p in sweep.points if p.exposed_comm_s <= limit]
    return max(p.bucket_bytes for p in spot) / MIB


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
    sweep = bucket_sweep(args.profile, cfg, args.tokens)
    chosen = choose_bucket_mb(args.profile, cfg, args.tokens)
    if args.json:
        print(json.dumps({"sweep": sweep.to_dict(), "bucket_mb": chosen}, indent=2))
        return
    print(f"{'bucket (MiB)':>13} {'buckets':>8} {'comm (ms)':>10} {'exposed (ms)':>13}")
    for p in sweep.points:
        mark = "  <- auto" if abs(p.bucket_bytes / MIB - chosen) < 1e-12 else ""
        print(f"{p.bucket_bytes / MIB:>13.3f} {p.num_buckets:>8} {p.comm_s * 1e3:>10.2f} "
              f"{p.exposed_comm_s * 1e3:>13.2f}{mark}")


if __name__ == "__main__":
    main()
