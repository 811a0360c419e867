"""``zerodp calibrate`` and ``zerodp predict``: measure this machine, then predict a step from it."""

from __future__ import annotations

import argparse
import json
import time

from zerodp.bench import sweep


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure alpha, bandwidth and compute here; write a hardware profile",
        description="An nccl-tests-style sweep of AllReduce/ReduceScatter/AllGather on local ranks, "
                    "an alpha-beta fit per collective, and the model's measured compute, written as "
                    "a hardware file every 'zerodp plan' command accepts (--hardware FILE).",
    )
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--min-bytes", type=int, default=4096, help="smallest message (default 4096)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default 64 MiB)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size (default 10)")
    p.add_argument("--model", default="small", help="GPT preset whose compute to measure (default small)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank for the compute run")
    p.add_argument("--out", default="profile.json", help="profile to write (default profile.json)")
    p.add_argument("--json", action="store_true", help="print the whole profile as JSON")
    p.set_defaults(func=run_calibrate)

    q = sub.add_parser(
        "predict",
        help="predict step time and exposed communication per stage from a profile",
        description="The planner's simulator fed with a calibration profile: predicted forward, "
                    "backward, exposed communication, optimizer and step time for each stage.",
    )
    q.add_argument("--profile", default="profile.json", help="written by zerodp calibrate")
    q.add_argument("--model", default="small", help="GPT preset (default small)")
    q.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    q.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    q.add_argument("--stages", default="0,1,2,3", help="comma-separated stages (default 0,1,2,3)")
    q.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MiB (default 25)")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=run_predict)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")
    return value


def run_calibrate(args) -> int:
    from zerodp.bench.calibrate import calibrate, write_profile

    _positive("nproc", args.nproc)
    if args.nproc < 2:
        raise ValueError("--nproc must be >= 2: collectives on one rank move nothing")
    t0 = time.perf_counter()
    cal = calibrate(args.nproc, args.min_bytes, args.max_bytes, _positive("iters", args.iters),
                    args.model, _positive("micro-batch", args.micro_batch))
    write_profile(cal, args.out)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=2))
        return 0
    print(sweep.points_table(cal.points, cal.world_size))
    print()
    print(sweep.fits_table(cal.fits))
    c = cal.compute
    print()
    print(f"compute ({c.model}, {c.params / 1e6:.2f}M params, {c.tokens} tokens/rank): forward "
          f"{c.forward_s * 1e3:.1f} ms, backward {c.backward_s * 1e3:.1f} ms, AdamW step "
          f"{c.optimizer_s * 1e3:.1f} ms -> C = {c.flops / 1e9:.2f} GFLOP/s per rank")
    hw = cal.hardware()
    print(f"C/W = {hw['flops'] / hw['intra_bw']:.0f} tokens per rank (seed §7: compute-bound above it)")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s); use it with "
          f"'zerodp plan ... --hardware {args.out}' and 'zerodp predict --profile {args.out}'")
    return 0


def run_predict(args) -> int:
    from zerodp.bench.calibrate import load_calibration
    from zerodp.bench.predict import predict_step, predictions_table
    from zerodp.train.model import PRESETS

    if args.model not in PRESETS:
        raise ValueError(f"unknown model {args.model!r}; use one of {', '.join(PRESETS)}")
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--stages must be comma-separated integers, got {args.stages!r}") from None
    cal = load_calibration(args.profile)["calibration"]
    preds = [predict_step(cal, PRESETS[args.model], s, _positive("micro-batch", args.micro_batch),
                          args.seq_len, args.bucket_mb) for s in stages]
    if args.json:
        print(json.dumps([p.to_dict() for p in preds], indent=2))
    else:
        print(f"predicted step on {cal['world_size']} ranks, model {args.model}, profile {args.profile}")
        print(predictions_table(preds))
    return 0
