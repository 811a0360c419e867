"""``zerodp train --plan auto``: the planner picks the layout, a short trial on this machine checks it.

1. **Profile.** The run's ``--profile`` (a ``zerodp calibrate`` profile measured on ``--nproc``
   ranks), else ``OUT/calibration.json`` when an earlier ``--plan auto`` in this directory wrote
   one, else ``zerodp calibrate`` runs now (a short sweep: the model's own preset, compute timed at
   the token counts the candidates run, 5 iterations per message size; once more with 8x larger
   messages when a collective's time did not grow with size).
2. **Recommend.** :func:`zerodp.plan.recommend` for this machine (1 node × ``--nproc`` ranks, the
   profile's α, W and measured compute) and the run's global batch and sequence length, over what
   the trainer runs: stages 0-3 × the micro-batches that divide the batch exactly, with the run's
   bucket size, precision, no recomputation and no compression (both change what trains).
3. **Trial.** The top :data:`TOP` candidates — and, when a stage is missing from them, the
   fastest-predicted configuration of the missing stages if it is predicted within :data:`NEAR`
   of the first pick (the step model's error on a small machine is larger than that: the
   engine's fixed per-step work is not in it, and it differs by stage) — train for
   :data:`TRIAL_STEPS` steps each, or as many as fill :data:`TRIAL_SECONDS` by the prediction
   (a step of 20 ms varies by tens of % from one step to the next on a shared machine: a few
   such steps rank nothing; at most :data:`MAX_TRIAL_STEPS`), in one process group,
   :data:`ROUNDS` times round-robin (so that a load that drifts over the trial shifts every
   candidate alike); a candidate's measured step is the median of its steps after the first of
   each round (the first builds caches and warms the allocator).
4. **Train** with the measured best. The table of predicted vs measured steps and the regret —
   measured step of the planner's first pick / best measured step — are printed and kept in
   ``OUT/plan-auto.json``.

The trial reuses the trainer's public pieces (:func:`zerodp.train.loop.train` with a modified
:class:`~zerodp.train.config.TrainConfig`, the launcher's process-group set-up); nothing here
imports the benchmarks (calibration runs as the ``zerodp calibrate`` command).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from zerodp.train.config import AUTO, TrainConfig

TOP = 3  # candidates tried
NEAR = 0.20  # ... plus the fastest of a stage not among them, predicted within this of the first
TRIAL_STEPS = 3  # steps per candidate per round, at least; the first of each round is not timed
TRIAL_SECONDS = 0.5  # ... or as many as the predicted step fills this with
MAX_TRIAL_STEPS = 40
ROUNDS = 2
PROFILE_FILE = "calibration.json"
RESULT_FILE = "plan-auto.json"
TRIAL_DIR = "plan-auto-trial"
#: what zerodp calibrate says when a collective's time does not grow over the sizes swept
WIDEN = "widen the size range"
DEFAULT_BUCKET_MB = 0.5  # what the prediction prices under --bucket-mb auto (TrainConfig's default)


@dataclass(frozen=True)
class Trial:
    """One candidate: the planner's prediction and the trial's measurement (seconds per step)."""

    rank: int  # 1: the planner's first pick
    stage: int
    micro_batch: int
    grad_acc: int
    bucket_mb: float | str
    predicted_s: float
    measured_s: float = float("nan")
    steps: tuple = ()  # every timed step

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s


def measured_best(trials: list[Trial]) -> Trial:
    """The trial with the shortest measured step (the first of equals): what ``--plan auto`` trains."""
    return min(trials, key=lambda t: t.measured_s)


def regret(trials: list[Trial]) -> float:
    """Measured step of the planner's first pick / the best measured step (1.0: it was the best)."""
    first = next(t for t in trials if t.rank == 1)
    return first.measured_s / measured_best(trials).measured_s


def layout(t: Trial) -> str:
    """``stage 1, micro-batch 32 (grad_acc 1)``: a candidate's layout in words."""
    return f"stage {t.stage}, micro-batch {t.micro_batch} (grad_acc {t.grad_acc})"


def refuse(cfg: TrainConfig, under_torchrun: bool) -> str | None:
    """Why ``--plan auto`` cannot run with ``cfg`` (None: it can)."""
    if under_torchrun:
        return ("--plan auto runs the trial on local ranks it starts itself; under torchrun choose "
                "the layout first (zerodp train --plan auto on one node, or zerodp plan recommend)")
    if cfg.resume:
        return "--plan auto chooses the layout of a new run; a resumed run keeps its own (drop --plan or --resume)"
    if cfg.nproc < 2:
        return "--plan auto needs --nproc >= 2: calibration and the trial measure collectives between ranks"
    return None


# ---- 1. the profile ------------------------------------------------------------------------------
def calibration_tokens(cfg: TrainConfig, model_seq: int) -> list[int]:
    """Token counts per rank at which calibration times the model: one sequence, the per-rank
    batch of a step, and one in between (each a valid count for the preset's own seq_len)."""
    per_rank = cfg.global_batch_tokens // cfg.nproc
    top = max(cfg.seq_len, per_rank - per_rank % cfg.seq_len)
    mid = cfg.seq_len * max(1, (top // cfg.seq_len) // 8)
    ok = [t for t in sorted({cfg.seq_len, mid, top}) if t <= model_seq or t % model_seq == 0]
    return ok or [model_seq]


def ensure_profile(cfg: TrainConfig, out: Path, say=print) -> str:
    """The profile to plan with (module docstring, step 1); runs ``zerodp calibrate`` if none."""
    if cfg.profile:
        return cfg.profile
    path = out / PROFILE_FILE
    if path.is_file():
        say(f"plan auto: calibration profile {path} (from an earlier --plan auto here)")
        return str(path)
    from zerodp.train.model import PRESETS

    mc = PRESETS[cfg.preset]
    grad_bytes = 4 * _param_count(cfg)
    max_bytes = 1 << max(16, (2 * grad_bytes - 1).bit_length())
    tokens = calibration_tokens(cfg, mc.seq_len)
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        cmd = [sys.executable, "-m", "zerodp.cli", "calibrate", "--nproc", str(cfg.nproc), "--model",
               cfg.preset, "--iters", "5", "--max-bytes", str(max_bytes),
               "--tokens-per-rank", ",".join(map(str, tokens)), "--out", str(path)]
        say(f"plan auto: no --profile; calibrating this machine on {cfg.nproc} ranks: "
            f"zerodp {' '.join(cmd[3:])}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            break
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        if attempt == 0 and WIDEN in tail[0]:
            # small messages on a loaded machine: latency and noise hide the growth with size
            say(f"plan auto: {tail[0]}; once more with messages up to {8 * max_bytes} bytes")
            max_bytes *= 8
            continue
        raise RuntimeError(f"plan auto: zerodp calibrate failed (exit {done.returncode}): {tail[0]}")
    summary = [line for line in done.stdout.splitlines() if line.startswith(("C = ", "overlap:"))]
    for line in summary:
        say(f"  {line}")
    return str(path)


def _param_count(cfg: TrainConfig) -> int:
    """Parameters of the run's GPT from its config alone (the planner's count of the same GPT)."""
    from zerodp.plan.calibrated import gpt_layer_shapes

    mc = cfg.model_config(256)
    return int(sum(s.params for s in gpt_layer_shapes(mc, cfg.seq_len)))


# ---- 2. recommend --------------------------------------------------------------------------------
def plan_model(cfg: TrainConfig):
    """The run's GPT as the planner sees it: its preset's shape at the run's sequence length."""
    from zerodp.plan.models import custom_model

    mc = cfg.model_config(256)
    return custom_model(layers=mc.n_layer, hidden=mc.d_model, heads=mc.n_head,
                        vocab=mc.vocab_size, name=cfg.preset, tied_embeddings=mc.tie_weights)


def micro_batches(cfg: TrainConfig) -> list[int]:
    """Micro-batches the trainer accepts for this batch: gbs divisible by micro-batch × ranks."""
    gbs = cfg.global_batch_tokens // cfg.seq_len
    return [m for m in range(1, gbs // cfg.nproc + 1) if gbs % (m * cfg.nproc) == 0 and m & (m - 1) == 0]


def candidates(cfg: TrainConfig, profile: str, top: int = TOP, other_stage: bool = False):
    """``(recommendation, [Trial])``: the planner's top ``top`` for this run (module docstring);
    with ``other_stage`` also the fastest configuration of a stage the top ``top`` lack, when it is
    predicted within :data:`NEAR` of the first (step 3 of the module docstring)."""
    from zerodp.plan.recommend import recommend
    from zerodp.train.config import plan_batch

    plan_batch(cfg.global_batch_tokens, cfg.seq_len, 1, cfg.nproc)  # the run's own checks
    bucket = DEFAULT_BUCKET_MB if cfg.bucket_mb == AUTO else float(cfg.bucket_mb)
    rec = recommend(plan_model(cfg), hardware=profile, nodes=1, gpus_per_node=cfg.nproc,
                    global_batch_tokens=cfg.global_batch_tokens, seq=cfg.seq_len,
                    precision="bf16" if cfg.mixed_precision else "fp32", recompute=("none",),
                    compress=("none",), bucket_mb=(bucket,), micro_batches=micro_batches(cfg),
                    top=max(top, 64) if other_stage else top, calibration=profile)
    gbs = cfg.global_batch_tokens // cfg.seq_len
    ranked = list(enumerate(rec.candidates, 1))
    picked = ranked[:top]
    if other_stage and picked:
        seen, limit = {c.stage for _, c in picked}, picked[0][1].step_s * (1 + NEAR)
        extra = next(((i, c) for i, c in ranked[top:] if c.stage not in seen and c.step_s <= limit), None)
        if extra is not None:
            picked.append(extra)
    trials = [Trial(rank=i, stage=c.stage, micro_batch=c.micro_batch,
                    grad_acc=gbs // (c.micro_batch * cfg.nproc),
                    bucket_mb=cfg.bucket_mb, predicted_s=c.step_s)
              for i, c in picked]
    if not trials:
        raise RuntimeError("plan auto: the planner found no configuration that fits: "
                           + "; ".join(rec.notes + [r["reason"] for r in rec.rejected]))
    return rec, trials


# ---- 3. the trial ------------------------------------------------------------------------------
def trial_steps(t: Trial) -> int:
    """Steps of one round of candidate ``t``: :data:`TRIAL_STEPS`, or as many as its predicted
    step fills :data:`TRIAL_SECONDS` with, up to :data:`MAX_TRIAL_STEPS` (module docstring)."""
    fill = math.ceil(TRIAL_SECONDS / t.predicted_s) if t.predicted_s > 0 else TRIAL_STEPS
    return max(TRIAL_STEPS, min(MAX_TRIAL_STEPS, fill))


def trial_config(cfg: TrainConfig, t: Trial, out: Path, rnd: int) -> TrainConfig:
    """``cfg`` with candidate ``t``'s layout, for a few steps in a directory of its own."""
    return replace(cfg, stage=t.stage, micro_batch=t.micro_batch, bucket_mb=t.bucket_mb,
                   steps=trial_steps(t), stop_after=None, warmup_steps=0, eval_every=0, eval_batches=1,
                   ckpt_every=0, keep_checkpoints=1, progress=False, trace=False, tensorboard=False,
                   max_restarts=0, resume=None, plan=None, out=str(out / f"round{rnd}-candidate{t.rank}"))


def trial_worker(cfg_dicts: list[dict], labels: list[str] | None = None) -> list[list[float]]:
    """One rank of the trial: every config in turn in one process group; rank 0 returns each
    run's step times (seconds) and, given ``labels`` (one per config), prints a line per run as
    it ends."""
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    from zerodp.train.launch import attempt_store, resolve_backend
    from zerodp.train.loop import RankContext, train

    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    cfgs = [TrainConfig.from_dict(d) for d in cfg_dicts]
    backend = resolve_backend(cfgs[0])
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    timeout = datetime.timedelta(seconds=cfgs[0].timeout_s)
    dist.init_process_group(backend, store=attempt_store(rank, world, 0, timeout), rank=rank,
                            world_size=world, timeout=timeout)
    times = []
    try:
        with open(os.devnull, "w") as quiet:  # each run's start-up line would repeat the table's
            for c in cfgs:
                saved, sys.stdout = sys.stdout, quiet
                try:
                    summary = train(c, RankContext(rank, world, local_rank, device))
                finally:
                    sys.stdout = saved
                times.append(list(summary.get("step_times", [])))
                if labels and rank == 0:
                    timed = times[-1][1:]
                    median = f"{statistics.median(timed) * 1e3:.1f} ms" if timed else "no timed step"
                    print(f"{labels[len(times) - 1]}: {median} (median of {len(timed)} timed steps)",
                          flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return times if rank == 0 else []


def run_trial(cfg: TrainConfig, trials: list[Trial], out: Path, progress: str | None = None,
              rounds: int = ROUNDS) -> list[Trial]:
    """Train each candidate for a few steps (module docstring, step 3); the trials with their
    measured steps, round by round. The trial directories are removed afterwards. With
    ``progress`` (a prefix), rank 0 prints a line per candidate run as it ends."""
    import logging
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from zerodp.spawn import free_port

    where = out / TRIAL_DIR
    order = [(rnd, t) for rnd in range(rounds) for t in (trials if rnd % 2 == 0 else trials[::-1])]
    cfgs = [asdict(trial_config(cfg, t, where, rnd)) for rnd, t in order]
    labels = None if progress is None else [
        f"{progress}run {i}/{len(order)}, round {rnd + 1}: #{t.rank} {layout(t)}"
        for i, (rnd, t) in enumerate(order, 1)]
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc,
                          run_id=f"zerodp-plan-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    try:
        results = elastic_launch(config, trial_worker)(cfgs, labels)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    times = results[0]
    per: dict[int, list[float]] = {t.rank: [] for t in trials}
    for (rnd, t), steps in zip(order, times):
        per[t.rank] += steps[1:]  # the first step of each run warms up
    return [replace(t, measured_s=statistics.median(per[t.rank]), steps=tuple(per[t.rank])) for t in trials]


# ---- 4. the table ------------------------------------------------------------------------------
def table(trials: list[Trial]) -> str:
    """Predicted vs measured per candidate, and the regret."""
    from zerodp.plan._common import table as plain_table

    best = measured_best(trials)
    rows = [[t.rank, f"{t.stage}", t.micro_batch, t.grad_acc, f"{t.bucket_mb:g}" if t.bucket_mb != AUTO else "auto",
             f"{t.predicted_s * 1e3:.1f}", f"{t.measured_s * 1e3:.1f}", f"{t.ratio:.2f}",
             "measured best" if t is best else f"+{(t.measured_s / best.measured_s - 1) * 100:.1f}%"]
            for t in trials]
    steps = sorted({trial_steps(t) for t in trials})
    each = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    head = (f"plan auto: the planner's top {len(trials)}, each trained {each} steps × {ROUNDS} "
            f"rounds (measured: median step after the first of each round)")
    out = plain_table(["#", "stage", "micro-batch", "grad_acc", "bucket MiB", "predicted ms",
                       "measured ms", "measured/predicted", "vs best"], rows, title=head,
                      align="rrrrrrrrl")
    return out + (f"\nregret = measured step of the planner's first pick / best measured = "
                  f"{regret(trials):.3f}")


def choose(cfg: TrainConfig, out: Path, say=print, progress: str | None = None) -> tuple[TrainConfig, dict]:
    """Steps 1-3 of the module docstring: ``(cfg with the measured best layout, the record kept
    in OUT/plan-auto.json)``. ``progress``: :func:`run_trial`'s, a line per trial run."""
    profile = ensure_profile(cfg, out, say)
    rec, trials = candidates(cfg, profile, other_stage=True)
    tried = f"the top {TOP}" + (f" and #{trials[-1].rank} (the fastest of stage {trials[-1].stage}, within "
                                f"{NEAR:.0%} of #1)" if len(trials) > TOP else "")
    say(f"plan auto: recommend searched {rec.searched} configurations in {rec.elapsed_s:.2f} s; "
        f"trying {tried} on {cfg.nproc} ranks")
    trials = run_trial(cfg, trials, out, progress)
    say(table(trials))
    best = measured_best(trials)
    ratios = [t.ratio for t in trials]
    if max(ratios) > 1.25 or min(ratios) < 0.8:
        say(f"plan auto: the predictions are off by {min(ratios):.2f}-{max(ratios):.2f}x on this "
            "machine (the calibrated compute times the model alone; the trial adds the engine's "
            "hooks, the data and the loss AllReduce, and the other load on the machine moves both)")
    chosen = replace(cfg, stage=best.stage, micro_batch=best.micro_batch, bucket_mb=best.bucket_mb, plan=None,
                     profile=cfg.profile if cfg.profile else (profile if cfg.bucket_mb == AUTO else None))
    record = dict(profile=profile, searched=rec.searched, recommend_s=rec.elapsed_s,
                  trial_steps=[trial_steps(t) for t in trials], rounds=ROUNDS, regret=regret(trials),
                  chosen=dict(stage=best.stage, micro_batch=best.micro_batch, bucket_mb=best.bucket_mb,
                              layout=f"{layout(best)}, bucket {best.bucket_mb} MiB"),
                  candidates=[dict(asdict(t), steps=list(t.steps)) for t in trials])
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return chosen, record
