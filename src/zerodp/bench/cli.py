"""``zerodp calibrate``, ``predict``, ``bench`` and ``plan-auto-regret``: measure this machine, predict a
step from it, and check the predictions against it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from zerodp import runconfig
from zerodp.bench import sweep
from zerodp.bench.contenders import Compression


def _stages(p) -> None:
    """--stages (and --stage: one stage is a list of one, --stage 3)."""
    stages = p.add_argument("--stages", default="0,1,2,3", help="comma-separated stages (default 0,1,2,3)")
    runconfig.add_alias(p, "--stage", stages)


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
    tokens = p.add_argument("--tokens-per-rank", dest="tokens", default="32,256,2048",
                            help="comma-separated tokens per rank at which to time the model's compute "
                                 "(default 32,256,2048; predictions interpolate between them)")
    runconfig.add_alias(p, "--tokens", tokens)
    p.add_argument("--out", default="profile.json", help="profile to write (default profile.json)")
    p.add_argument("--json", action="store_true", help="print the whole profile as JSON")
    p.set_defaults(func=run_calibrate)

    q = sub.add_parser(
        "predict",
        help="predict step time and exposed communication per stage from a profile",
        description="The planner's simulator fed with a calibration profile: predicted forward, "
                    "backward, exposed communication, optimizer and step time for each stage.",
    )
    q.add_argument("--profile", default="profile.json",
                   help="written by zerodp calibrate (default profile.json)")
    q.add_argument("--model", default="small", help="GPT preset (default small)")
    q.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per rank per step (default 8)")
    q.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    _stages(q)
    q.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MiB (default 25)")
    q.add_argument("--compress", default="none",
                   help="comma-separated compressions of the collectives, the planner's names: none, "
                        "bf16-reduce, int8-params, int8-grads, int8 (default none; guide §15)")
    q.add_argument("--shard-size", type=int, default=None, metavar="G",
                   help="hybrid sharding: shard groups of G ranks at stages 1-3 (guide §14)")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=run_predict)

    b = sub.add_parser(
        "bench",
        help="our engine vs its PyTorch peer per stage, two regimes; table, JSON, PNG",
        description="Stage 0 vs DDP, 1 vs ZeroRedundancyOptimizer + DDP, 2 vs FSDP2 without "
                    "resharding after forward, 3 vs FSDP2, plus the no-communication floor: same "
                    "model, data and seed, alternated steps, medians, in a compute-bound and a "
                    "communication-bound regime. With --profile, predicted next to measured.",
    )
    _stages(b)
    b.add_argument("--regimes", default="compute,comm",
                   help="comma-separated: compute (8×256 tokens/rank), comm (1×32), or a number of "
                        "tokens per rank (default compute,comm); diloco: DiLoCo against DDP and hybrid "
                        "ZeRO on a simulated slow link (its options below)")
    b.add_argument("--steps", type=int, default=None,
                   help="timed steps per contender in the costliest regime; cheaper regimes "
                        "time proportionally more, up to 5x (default 6)")
    b.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 3)")
    b.add_argument("--turn", type=int, default=3,
                   help="consecutive steps per contender turn, the first untimed: it refills the caches "
                        "the previous contender filled (default 3; 1 = every step timed, alternated each step)")
    b.add_argument("--memory-steps", type=int, default=3,
                   help="steps each contender runs alone while its peak memory is read (default 3: from the "
                        "second step on, forward holds gradients and optimizer states too)")
    b.add_argument("--memory-repeats", type=int, default=1,
                   help="fresh groups per contender in which its peak memory is read; the figure is their median "
                        "(default 1; glibc's heap moves one reading by up to ±20 MiB)")
    b.add_argument("--model", default=None, help="GPT preset (default small)")
    b.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    b.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket size in MiB for our stages 0-1 and DDP (default 25)")
    b.add_argument("--stage2-bucket-mb", default="unit",
                   help="bucket size of our stage 2: unit (one transformer block, the unit its peer FSDP2 "
                        "reduces at; the default) or a number of MiB")
    b.add_argument("--compress", default="none",
                   help="comma-separated compressions to bench beside ours at each stage, the planner's "
                        "names: none, bf16-reduce (stages 0-3), int8-params, int8-grads, int8 (stages 1-3); "
                        "e.g. none,bf16-reduce,int8 (default none: no extra rows; guide §15)")
    b.add_argument("--shard-size", type=int, default=None, metavar="G",
                   help="also bench ours with hybrid sharding, shard groups of G ranks (G < --nproc, "
                        "dividing it), at stages 1-3, with each --compress (guide §14)")
    b.add_argument("--compile", action="store_true",
                   help="also bench ours and each stage's reference peer (DDP, ZeRO-opt + DDP, FSDP2) with the "
                        "model compiled in place first, as zerodp train --compile does (aot_eager on CPU, inductor "
                        "on CUDA); compilation runs in the untimed first step (docs/benchmarks.md)")
    b.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="what every contender steps: adamw (the default), or muon: torch.optim.Muon on the transformer "
                        "blocks' 2-D weights + AdamW on the rest, ours at each stage against DDP + Muon/AdamW with "
                        "replicated state (adds a table of optimizer state and bytes sent per rank)")
    b.add_argument("--out", default="bench-out",
                   help="folder for bench.json/png, roofline.json/png (default bench-out)")
    b.add_argument("--profile", default=None, help="calibration profile: predictions and the auto-bucket row")
    b.add_argument("--calibrate", action="store_true",
                   help="run zerodp calibrate first (writes --profile, default OUT/profile.json)")
    b.add_argument("--roofline", action="store_true", help="also sweep tokens per rank for stage 0")
    b.add_argument("--roofline-tokens", default=None,
                   help="comma-separated tokens per rank for --roofline (default 32,...,2048)")
    b.add_argument("--markdown", default=None, help="write this markdown page (e.g. docs/benchmarks.md)")
    b.add_argument("--quick", action="store_true", help="nano model, tiny regimes, 1+2 steps: for tests")
    b.add_argument("--memory", choices=("fresh", "shared"), default=None,
                   help="peak memory of each contender alone in a fresh spawned group (fresh, the default) or "
                        "inside the timing group, contenders one after another (shared, the default with --quick)")
    b.add_argument("--malloc", choices=("default", "mmap"), default="default",
                   help="the fresh memory groups' allocator: glibc as it comes (default), or its mmap threshold "
                        "fixed at 128 KiB (mmap: freed buffers leave the resident set, RSS follows the live tensors)")
    b.add_argument("--json", action="store_true", help="print JSON instead of tables")
    g = b.add_argument_group("the diloco regime (--regimes diloco, guide §16): DDP, hybrid ZeRO and DiLoCo "
                             "over it, cross-group bytes per step and step times on a simulated link")
    g.add_argument("--diloco-every", type=int, default=100, metavar="H",
                   help="inner steps between syncs (default 100)")
    g.add_argument("--diloco-fragments", type=int, default=1, metavar="F",
                   help="Streaming DiLoCo's fragments (default 1)")
    g.add_argument("--diloco-compress", default="none", choices=["none", "int8"],
                   help="the pseudo-gradients on the wire (default none: fp32)")
    g.add_argument("--diloco-delay", type=int, default=0, metavar="TAU",
                   help="inner steps an exchange runs behind (default 0)")
    g.add_argument("--inter-group-bw", default=None, metavar="W[,W...]",
                   help="simulated bandwidths between the groups, bytes/s per rank (e.g. 50MB,200MB): one "
                        "timed phase each; the collectives across the groups complete latency x ring steps + "
                        "bytes sent / W after their real end, in series with this machine's link (a throttle "
                        "in the bench only)")
    g.add_argument("--inter-group-latency", default="0", metavar="S",
                   help="the simulated link's latency per ring step, e.g. 20us (default 0)")
    runconfig.add_config_options(b, "zerodp bench")
    b.set_defaults(func=run_bench_cmd, _config_out="out")  # OUT/config.toml: the resolved settings

    from zerodp.bench.plan_auto import DEFAULT_SETTINGS, DEFAULT_TOP, GOAL
    from zerodp.train.autoplan import ROUNDS

    r = sub.add_parser(
        "plan-auto-regret",
        help="measure zerodp train --plan auto's regret and prediction error on several settings",
        description="For each setting: the plan-auto choice as zerodp train --plan auto makes it "
                    "(calibration, recommend's top 3, their trial), then every configuration of the "
                    "planner's top K measured with the same trial; a table of the regret (measured "
                    "step of the pick / best measured) and the pick's prediction error "
                    f"(docs/planner.md; goal: regret <= {GOAL:.2f}).",
    )
    r.add_argument("--settings", default=DEFAULT_SETTINGS, metavar="MODEL:SEQ_LEN:TOKENS,...",
                   help="comma-separated model presets, sequence lengths and global batches in tokens "
                        f"(default {DEFAULT_SETTINGS})")
    r.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    r.add_argument("--top", type=int, default=DEFAULT_TOP,
                   help=f"K: the planner's top K measured, all that fit when fewer (default {DEFAULT_TOP}, "
                        "at least 3: plan-auto's own candidates)")
    r.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"rounds of the measurement of the top K (default {ROUNDS}, as the plan-auto trial; "
                        "more give a steadier reference on a loaded machine)")
    r.add_argument("--profile", default=None,
                   help="calibration profile for every setting (default: calibrate for each setting's "
                        "model, as --plan auto does)")
    r.add_argument("--out", default="plan-auto-regret",
                   help="folder for the profiles and plan-auto-regret.json (default plan-auto-regret)")
    r.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    r.set_defaults(func=run_plan_auto_regret)


def trainer_model(name: str, trainer_presets) -> str:
    """``name`` if the trainer can build it; otherwise one sentence: a planner-only model (from
    the one model list, ``zerodp.plan.model_names()``) is named as such."""
    if name in trainer_presets:
        return name
    from zerodp.plan.models import model_names

    runnable = ", ".join(trainer_presets)
    if name in model_names(trainable=False):
        raise ValueError(f"{name} is a planner-only model (zerodp plan memory/simulate --model "
                         f"{name}): this command runs the model on this machine, so use one "
                         f"zerodp train builds: {runnable}")
    raise ValueError(f"unknown model {name!r}; use one of {runnable}")


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")
    return value


def run_calibrate(args) -> int:
    from zerodp.bench.calibrate import calibrate, write_profile
    from zerodp.bench.compute import compute_table

    _positive("nproc", args.nproc)
    if args.nproc < 2:
        raise ValueError("--nproc must be >= 2: collectives on one rank move nothing")
    t0 = time.perf_counter()
    cal = calibrate(args.nproc, args.min_bytes, args.max_bytes, _positive("iters", args.iters),
                    args.model, _int_list("tokens-per-rank", args.tokens))
    write_profile(cal, args.out)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=2))
        return 0
    print(sweep.points_table(cal.points, cal.world_size))
    print()
    print(sweep.fits_table(cal.fits))
    print()
    print(compute_table(cal.compute.to_dict()))
    print(cal.overlap.describe())
    hw = cal.hardware()
    print(f"C/W = {hw['flops'] / hw['intra_bw']:.0f} tokens per rank (guide §7: compute-bound above it)")
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s); use it with "
          f"'zerodp plan ... --hardware {args.out}' and 'zerodp predict --profile {args.out}'")
    return 0


class _stdout_to_stderr:
    """Everything written to standard output meanwhile, by this process and by the ranks it starts
    (they inherit file descriptor 1), goes to standard error."""

    def __enter__(self):
        import os
        import sys

        sys.stdout.flush()
        self.saved = os.dup(1)
        os.dup2(2, 1)

    def __exit__(self, *exc):
        import os
        import sys

        sys.stdout.flush()
        os.dup2(self.saved, 1)
        os.close(self.saved)


def run_plan_auto_regret(args) -> int:
    import contextlib
    import sys
    from pathlib import Path

    from zerodp.bench import plan_auto

    settings = plan_auto.parse_settings(args.settings)
    if _positive("nproc", args.nproc) < 2:
        raise ValueError("--nproc must be >= 2: --plan auto measures collectives between ranks")
    t0 = time.perf_counter()
    # progress goes to stderr with --json, so that stdout is the JSON alone
    log = sys.stderr if args.json else sys.stdout
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        results = plan_auto.run(settings, args.nproc, args.top, Path(args.out), args.profile,
                                say=lambda m: print(m, file=log, flush=True), rounds=args.rounds)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return 0
    print()
    print(plan_auto.table(results))
    print(f"{plan_auto.machine()}; {args.nproc} ranks; wrote {Path(args.out) / plan_auto.RESULT_FILE} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


def run_predict(args) -> int:
    from zerodp.plan.calibrated import load_calibration
    from zerodp.bench.predict import predict_step, predictions_table
    from zerodp.train.model import PRESETS

    trainer_model(args.model, PRESETS)
    stages = _int_list("stages", args.stages)
    cal = load_calibration(args.profile)["calibration"]
    compress = _compressions(args.compress)
    preds = []
    for s in stages:
        for c in compress:
            if s == 0 and c.startswith("int8"):
                continue  # stage 0 has no AllGather nor ReduceScatter to quantize
            preds.append(predict_step(cal, PRESETS[args.model], s, _positive("micro-batch", args.micro_batch),
                                      args.seq_len, args.bucket_mb, compress=c,
                                      shard_size=None if s == 0 else args.shard_size))  # stage 0 shards nothing
    if not preds:
        raise ValueError("nothing to predict: int8 compresses the collectives of stages 1-3")
    if args.json:
        print(json.dumps([p.to_dict() for p in preds], indent=2))
    else:
        print(f"predicted step on {cal['world_size']} ranks, model {args.model}, profile {args.profile}")
        print(predictions_table(preds))
    return 0


def _compressions(text: str) -> tuple[Compression, ...]:
    """``--compress``: comma-separated names of ``zerodp.plan.hybrid.COMPRESSIONS``, as members."""
    names = [m.value for m in Compression]
    out = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [c for c in out if c not in names]
    if bad or not out:
        raise ValueError(f"--compress: {', '.join(bad) or 'empty'}; use comma-separated {', '.join(names)}")
    return tuple(Compression(c) for c in out)


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"--{name} is empty")
    return values


def _regimes(text: str, quick: bool, model_seq_len: int):
    from zerodp.bench.spec import QUICK_REGIMES, REGIMES
    from zerodp.bench.roofline import regime_for

    named = QUICK_REGIMES if quick else REGIMES
    out = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        if item in named:
            out.append(named[item])
        elif item.isdigit() and int(item) > 0:
            out.append(regime_for(int(item), model_seq_len))
        else:
            raise ValueError(f"--regimes: {item!r} is neither {' nor '.join(named)} nor a number of tokens per rank")
    if len({r.name for r in out}) != len(out):
        raise ValueError(f"--regimes lists a regime twice: {text!r}")
    if not out:
        raise ValueError("--regimes is empty")
    return tuple(out)


def _stage2_bucket(text: str) -> "float | str":
    """``--stage2-bucket-mb``: "unit" or a positive number of MiB."""
    from zerodp.bench.spec import UNIT

    if text == UNIT:
        return text
    try:
        mb = float(text)
    except ValueError:
        mb = float("nan")
    if not mb > 0:
        raise ValueError(f"--stage2-bucket-mb {text!r}: give 'unit' (one transformer block) or a positive "
                         "number of MiB")
    return mb


def bench_command_line(args) -> str:
    """The command that reproduces this run, rebuilt from the parsed options (for the page)."""
    import shlex

    from zerodp.bench.spec import UNIT

    flags = [("--stages", args.stages, "0,1,2,3"), ("--regimes", args.regimes, "compute,comm"),
             ("--steps", args.steps, None), ("--warmup", args.warmup, None), ("--model", args.model, None),
             ("--nproc", args.nproc, 2), ("--bucket-mb", args.bucket_mb, 25.0),
             ("--stage2-bucket-mb", args.stage2_bucket_mb, UNIT),
             ("--compress", args.compress, "none"), ("--shard-size", args.shard_size, None),
             ("--profile", args.profile, None), ("--roofline-tokens", args.roofline_tokens, None),
             ("--memory", args.memory, None), ("--malloc", args.malloc, "default"), ("--turn", args.turn, 3),
             ("--memory-steps", args.memory_steps, 3), ("--memory-repeats", args.memory_repeats, 1),
             ("--optimizer", getattr(args, "optimizer", "adamw"), "adamw")]
    words = ["zerodp", "bench"]
    words += [w for w, on in (("--quick", args.quick), ("--calibrate", args.calibrate),
                              ("--roofline", args.roofline), ("--compile", getattr(args, "compile", False))) if on]
    for flag, value, default in flags:
        if value is not None and value != default:
            words += [flag, str(value)]
    words += ["--out", args.out]
    if args.markdown:
        words += ["--markdown", args.markdown]
    return " ".join(shlex.quote(w) for w in words)


def _seconds(text: str) -> float:
    """``--inter-group-latency``: seconds, or a number with s, ms, us or µs."""
    t = str(text).strip().lower()
    for suffix, scale in (("µs", 1e-6), ("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if t.endswith(suffix):
            return float(t[:-len(suffix)]) * scale
    return float(t)


def run_diloco_regime(args, model: str) -> int:
    """``--regimes diloco`` (:mod:`zerodp.bench.diloco`): per stage of ``--stages``, the table and
    OUT/diloco-s<stage>.json."""
    import os

    from zerodp.bench import diloco
    from zerodp.engine.config import DiLoCo
    from zerodp.plan._common import parse_quantity

    bws = tuple(parse_quantity(w, "--inter-group-bw") for w in args.inter_group_bw.split(",")) \
        if args.inter_group_bw else ()
    g = args.shard_size or args.nproc // 2
    os.makedirs(args.out, exist_ok=True)
    for stage in _int_list("stages", args.stages):
        spec = diloco.DiLoCoBenchSpec(
            model=model, world_size=args.nproc, shard_size=g, stage=stage,
            outer=DiLoCo(every=args.diloco_every, fragments=args.diloco_fragments, delay=args.diloco_delay,
                         compress=None if args.diloco_compress == "none" else args.diloco_compress),
            steps=args.steps or 0, warmup=args.warmup if args.warmup is not None else 2, bandwidths=bws,
            latency=_seconds(args.inter_group_latency))
        ranks = diloco.run(spec)
        path = os.path.join(args.out, f"diloco-s{stage}.json")
        out = {"spec": dataclasses.asdict(spec), "ranks": ranks, "planned": diloco.predicted_bytes(spec, ranks[0])}
        if len(bws) >= 2:
            out["crossover"] = diloco.crossover(spec, ranks)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        if args.json:
            print(json.dumps(out, indent=1))
            continue
        print(diloco.table(spec, ranks))
        cross = out.get("crossover")
        if cross:
            print("\n".join(diloco.crossover_lines(cross)))
        print(f"wrote {path}\n")
    return 0


def run_bench_cmd(args) -> int:
    import os

    from zerodp.bench import compare, roofline, tables
    from zerodp.bench.spec import BenchSpec
    from zerodp.train.model import PRESETS

    names = [v.strip() for v in args.regimes.split(",") if v.strip()]
    if "diloco" in names:  # the DiLoCo regime (guide §16): its own contenders and table
        model = args.model or ("nano" if args.quick else "tiny")
        trainer_model(model, PRESETS)
        run_diloco_regime(args, model)
        names.remove("diloco")
        if not names:
            return 0
        args.regimes = ",".join(names)
    model = args.model or ("nano" if args.quick else "small")
    trainer_model(model, PRESETS)
    stages = tuple(_int_list("stages", args.stages))
    regimes = _regimes(args.regimes, args.quick, PRESETS[model].seq_len)
    optimizer = getattr(args, "optimizer", "adamw")
    if optimizer == "muon" and args.roofline:
        raise ValueError("--roofline sweeps stage 0 with AdamW: run it without --optimizer muon")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    steps = args.steps if args.steps is not None else (2 if args.quick else 6)
    os.makedirs(args.out, exist_ok=True)
    profile = args.profile
    if args.calibrate:
        from zerodp.bench.calibrate import DEFAULT_TOKENS, calibrate, write_profile

        profile = profile or os.path.join(args.out, "profile.json")
        quick = dict(max_bytes=1 << 20, iters=3) if args.quick else {}
        tokens = {r.tokens for r in regimes} | (set() if args.quick else set(DEFAULT_TOKENS))
        cal = calibrate(args.nproc, model=model, tokens=tuple(sorted(tokens)), **quick)
        write_profile(cal, profile)
        if not args.json:
            print(sweep.points_table(cal.points, cal.world_size))
            print(sweep.fits_table(cal.fits))
            print(f"wrote {profile}\n")
    spec = BenchSpec(model=model, world_size=args.nproc, regimes=regimes, stages=stages,
                             warmup=warmup, steps=steps, turn=args.turn, memory_steps=args.memory_steps,
                             memory_repeats=args.memory_repeats,
                             bucket_mb=args.bucket_mb, stage2_bucket_mb=_stage2_bucket(args.stage2_bucket_mb),
                             profile=profile, compress=_compressions(args.compress), shard_size=args.shard_size,
                             memory=args.memory or ("shared" if args.quick else "fresh"), malloc=args.malloc,
                             compile=args.compile, optimizer=optimizer)
    t0 = time.perf_counter()
    result = compare.run_bench(spec)
    bench_json = tables.write_json(result, os.path.join(args.out, "bench.json"))
    bench_png = tables.plot(result, os.path.join(args.out, "bench.png"))
    rl = rl_png = None
    if args.roofline:
        tokens = (_int_list("roofline-tokens", args.roofline_tokens) if args.roofline_tokens else
                  (roofline.QUICK_TOKENS if args.quick else roofline.DEFAULT_TOKENS))
        rspec = roofline.RooflineSpec(model=model, world_size=args.nproc, tokens=tuple(tokens),
                                      warmup=min(warmup, 2), steps=min(steps, 4), turn=args.turn,
                                      bucket_mb=args.bucket_mb, profile=profile)
        rl = roofline.run_roofline(rspec)
        with open(os.path.join(args.out, "roofline.json"), "w") as f:
            json.dump(rl.to_dict(), f, indent=2)
        rl_png = roofline.plot(rl, os.path.join(args.out, "roofline.png"))
    wall = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"bench": result.to_dict(), "roofline": rl.to_dict() if rl else None}, indent=2))
    else:
        print(tables.contenders_table(result))
        print()
        print(tables.summary_table(result))
        compressed = tables.compressed_table(result)
        if compressed:
            print()
            print(compressed)
        compiled = tables.compiled_table(result)
        if compiled:
            print()
            print(compiled)
        muon = tables.muon_table(result)
        if muon:
            print()
            print(muon)
        if rl is not None:
            print()
            print(roofline.table(rl))
        print(f"\nwrote {bench_json}, {bench_png}" + (f", {rl_png}" if rl_png else "") + f" ({wall:.0f} s)")
    if args.markdown:
        from zerodp.bench.docs import write_markdown

        load = result.machine.get("load_average_1_5_15")
        cores = result.machine.get("cores") or 1
        note = None
        if load and load[0] > cores:
            note = (f"The machine was loaded while this ran (1-minute load {load[0]:.1f} on {cores} cores): "
                    "absolute times are inflated and noisy; ratios from alternated runs are less affected.")
        write_markdown(args.markdown, bench_command_line(args), result, bench_png, rl, rl_png, note)
        if not args.json:
            print(f"wrote {args.markdown}")
    return 0
