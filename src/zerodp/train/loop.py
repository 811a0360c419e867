"""The training loop that runs on every rank: data → engine → optimizer step, with evals,
checkpoints, metrics and the final report.

One step is guide §5's loop: ``grad_acc`` micro-batches, the gradient synchronisation switched off
(``no_sync``) for all but the last, then clipping and one optimizer step. Which samples each rank
reads is decided in :mod:`zerodp.train.data`; how gradients and states are sharded is the engine's
business (stage 0–3, guide §9).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from zerodp.train import checkpoint as ckpt
from zerodp.train import stop as stopping
from zerodp.train.config import AUTO, BatchPlan, OnSaveError, TrainConfig, plan_batch
from zerodp.train.data import Corpus, Sharding, TrainStream, Windows, load_corpus, val_batches
from zerodp.train.model import GPT, GPTConfig
from zerodp.train.faults import Faults
from zerodp.train.hooks import Hooks
from zerodp.train.progress import METRICS_FILE, MetricsLog, ProgressBar
from zerodp.train.watchdog import Watchdog, explain, is_collective_error

CHECKPOINTS = "checkpoints"
# Settings that decide which samples a step reads and how large a step it takes: changing them on
# resume is allowed (say, a larger batch) but the continuation is then not the saved run's.
CONTINUITY = ("data", "seed", "global_batch_tokens", "seq_len", "steps", "lr", "warmup_steps",
              "min_lr_ratio", "weight_decay", "clip", "mixed_precision")
TRACE_FILE = "trace.json"


@dataclass(frozen=True)
class RankContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio·lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def flops_per_token(mc: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus attention's scores and
    weighted sum, 12·n_layer·d_model·seq_len (the PaLM-paper count, causal mask not discounted).
    Embedding lookups are not matmuls, so the token and position tables are left out."""
    lookups = mc.d_model * (mc.seq_len + (0 if mc.tie_weights else mc.vocab_size))
    return 6.0 * (n_params - lookups) + 12.0 * mc.n_layer * mc.d_model * mc.seq_len


def prepare(cfg: TrainConfig, world: int) -> tuple[Corpus, GPTConfig, BatchPlan, Windows, Windows]:
    """Everything that can be checked before any rank starts: data, model config, batch plan."""
    corpus = load_corpus(cfg.data)
    mc = cfg.model_config(corpus.vocab_size)
    saved = _saved_vocabulary(cfg)
    if saved is not None and saved > mc.vocab_size:  # the data fits the saved model's vocabulary
        mc = dataclasses.replace(mc, vocab_size=saved)
    plan = plan_batch(cfg.global_batch_tokens, cfg.seq_len, cfg.micro_batch, world)
    check_profile(cfg, world)
    train_w = Windows(corpus.train, cfg.seq_len, "training", corpus.name)
    val_w = Windows(corpus.val, cfg.seq_len, "validation", corpus.name)
    return corpus, mc, plan, train_w, val_w


def _saved_vocabulary(cfg: TrainConfig) -> int | None:
    """The vocabulary size of the model ``cfg.resume`` points at (None when not resuming or when it
    cannot be read: check_resume then says why)."""
    if not cfg.resume:
        return None
    try:
        manifest = json.loads((ckpt.find(cfg.resume, log=lambda m: None) / ckpt.MANIFEST).read_text())
        vocab = manifest["model"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return vocab if isinstance(vocab, int) else None


def check_profile(cfg: TrainConfig, world: int) -> None:
    """``--bucket-mb auto``: the profile must load and be calibrated on ``world`` ranks (the engine
    chooses the size from it on every rank; checked here before any rank starts)."""
    if cfg.bucket_mb == AUTO and cfg.stage != 3:
        from zerodp.plan.calibrated import calibration_for

        calibration_for(cfg.profile, world)


def bucket_words(engine, cfg: TrainConfig) -> str:
    """The run's gradient bucket size in words, e.g. ``bucket 5.36 MiB (auto)`` (guide §4)."""
    if cfg.stage == 3:
        return "no gradient buckets (FSDP units)" + (", --bucket-mb auto ignored" if cfg.bucket_mb == AUTO else "")
    return f"bucket {engine.config.bucket_mb:.3g} MiB" + (" (auto)" if engine.bucket_auto else "")


def check_resume(cfg: TrainConfig, mc: GPTConfig, log=print) -> "ckpt.Checkpoint | None":
    """Find and validate the checkpoint ``cfg.resume`` points at (None when not resuming)."""
    if not cfg.resume:
        return None
    ck = ckpt.Checkpoint.open(ckpt.find(cfg.resume, log=log))
    check_vocabulary(cfg, mc, ck)
    ck.check_model(mc.to_dict())
    if ck.step >= cfg.steps:
        raise ValueError(f"{ck.path} is at step {ck.step} and --steps is {cfg.steps}: nothing left to "
                         f"do; raise --steps to train further")
    saved = ck.manifest.get("train", {})
    changed = [f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}" for k in CONTINUITY
               if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        log(f"note: resuming with {', '.join(changed)}: training continues, but not along the path "
            "the saved run would have taken")
    kinds = {"param", *ck.manifest.get("scalars", {}).get("kinds", [])}
    for name in ck.names():
        missing = kinds - set(ck.kinds(name))
        if missing:
            raise ckpt.CheckpointError(f"{ck.path / ckpt.MANIFEST} lacks {sorted(missing)} of {name}")
    return ck


def check_vocabulary(cfg: TrainConfig, mc: GPTConfig, ck: "ckpt.Checkpoint") -> None:
    """Tokens the saved model has no embedding for: one sentence naming the data and the id.

    A new run sizes its vocabulary from the data, so every token is in it; a resumed run must fit
    the saved model's vocabulary. (The generic check that follows would call this "another model".)
    """
    from zerodp.train.model import PRESETS

    saved = ck.model_config.get("vocab_size")
    if (isinstance(saved, int) and mc.vocab_size > saved
            and PRESETS[cfg.preset].vocab_size <= saved):  # so the data made it larger
        raise ckpt.CheckpointError(
            f"--data {cfg.data or 'bundled'} holds token id {mc.vocab_size - 1}, outside the vocabulary of "
            f"the model in {ck.path} (ids 0-{saved - 1}): resume with data of the tokenizer that "
            "model was trained with")


def _torch_optimizer(engine) -> torch.optim.Optimizer:
    # ``engine.optimizer`` if the engine offers it, else the stock optimizer inside its fp32 master.
    opt = getattr(engine, "optimizer", None) or getattr(getattr(engine, "master", None), "optimizer", None)
    if not isinstance(opt, torch.optim.Optimizer):
        raise RuntimeError("the engine exposes no torch optimizer to set the learning rate on")
    return opt


def set_lr(engine, lr: float) -> None:
    for group in _torch_optimizer(engine).param_groups:
        group["lr"] = lr


def build_engine(cfg: TrainConfig, mc: GPTConfig, ctx: RankContext):
    from zerodp.engine import parallelize
    from zerodp.engine.compiled import compile_in_place

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = GPT(mc).to(ctx.device)
    n_params = model.num_params()  # before wrapping: stage 3 frees the full parameters
    if cfg.compile:  # in place: the engine's hooks run outside the graphs, names stay the model's own
        compile_in_place(model)  # inductor on CUDA, aot_eager on CPU
    wd, betas = cfg.weight_decay, (0.9, 0.95)
    engine = parallelize(model, optimizer=lambda groups: torch.optim.AdamW(
        groups, lr=cfg.lr, weight_decay=wd, betas=betas), stage=cfg.stage,
        mixed_precision=cfg.mixed_precision, bucket_mb=cfg.bucket_mb,
        **(dict(profile=cfg.profile, tokens_per_rank=cfg.tokens_per_rank) if cfg.bucket_mb == AUTO else {}),
        units=list(model.blocks) if cfg.stage == 3 else None,
        max_nonfinite_skips=cfg.max_skipped_steps, shard_size=cfg.shard_size, reduce_dtype=cfg.reduce_dtype,
        quantize_params=cfg.quantize is not None and cfg.quantize.params,
        quantize_grads=cfg.quantize is not None and cfg.quantize.grads, outer=cfg.outer())
    return engine, n_params


def _expected_pieces(engine, ck: "ckpt.Checkpoint") -> list:
    """The pieces this rank will read from ``ck``: its own state pieces, except that a run with
    the DiLoCo outer loop resuming a checkpoint saved without one (a data-parallel warm-up, guide
    §16) reads the plain inner state in every replica group and no outer state (it restarts from
    the loaded weights)."""
    import dataclasses

    from zerodp.engine.outer import DELTA, MOMENTUM, OUTER

    pieces = engine.checkpoint.state_pieces()
    if engine.outer is None or "outer" in ck.manifest.get("scalars", {}):
        return pieces
    return [dataclasses.replace(p, kind=p.kind.split("@replica")[0]) for p in pieces
            if p.kind not in (OUTER, MOMENTUM, DELTA)]


def load_into(engine, ck: "ckpt.Checkpoint", ctx: RankContext) -> None:
    """Apply a validated checkpoint on every rank, or on none (it never half-applies).

    Each rank first reads everything it will load — its pieces of every state kind and its RNG
    state — into memory, so that a file that cannot be read (deleted, damaged or replaced since
    it was validated) fails here, before anything is written. Then the ranks agree with one
    AllReduce; only when every rank is ready does any of them touch the engine. (The price: this
    rank's share of the checkpoint is held in memory once more while loading.)
    """
    from zerodp.engine.master import whole_name

    problem, cache, rng = "", {}, {}
    try:
        ck.check_pieces(_expected_pieces(engine, ck))
        scalars = ck.manifest.get("scalars", {})
        kinds, per_param = scalars.get("kinds", []), scalars.get("param_kinds", {})
        for p in engine.master.pieces(kinds=[]):  # the ranges this rank holds (parameters only)
            for kind in ["param", *per_param.get(p.name, kinds)]:  # the tensor-ownership path: its own kinds
                cache[(p.name, kind, p.start, p.stop)] = ck.read(p.name, kind, p.start, p.stop)
        for t in engine.master.proxies:  # stage 3's whole tensors stepped here: their states whole
            n = t.tensor.numel()
            for kind in per_param.get(t.name, kinds):
                cache[(t.name, kind, 0, n)] = ck.read(t.name, kind, 0, n)
        held = {t.name for t in engine.master.targets if t.name not in engine.master.exchanged} | \
            {t.name for t in engine.master.proxies}
        for name, states in scalars.get("whole", {}).items():  # whole-tensor states (Adafactor's factors)
            for kind, shape in states.items():
                if name in held:
                    key, n = whole_name(name, kind), math.prod(shape)
                    cache[(key, kind, 0, n)] = ck.read(key, kind, 0, n)
        rng = ck.rng(ctx.rank)
    except Exception as e:  # noqa: BLE001 - any failure to read means: load nothing, anywhere
        problem = (str(e) if isinstance(e, ckpt.CheckpointError)
                   else f"{ck.path}: cannot read it ({type(e).__name__}: {e})")
    flag = torch.tensor([0.0 if problem else 1.0], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1.0:
        raise ckpt.CheckpointError(problem or f"another rank cannot load {ck.path}; nothing was loaded")

    def read(name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        got = cache.get((name, kind, start, stop))
        return got if got is not None else ck.read(name, kind, start, stop)

    engine.checkpoint.load_scalar_state(ck.manifest.get("scalars", {}))
    engine.checkpoint.load_state_pieces(read)
    if ckpt.RNG_CPU in rng:
        torch.set_rng_state(rng[ckpt.RNG_CPU])
    if ckpt.RNG_CUDA in rng and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(rng[ckpt.RNG_CUDA], ctx.device)


@torch.no_grad()
def evaluate(engine, val_w: Windows, cfg: TrainConfig, ctx: RankContext) -> float:
    """Mean validation loss over a fixed set of windows, averaged over ranks."""
    total = torch.zeros(1, device=ctx.device, dtype=torch.float64)
    for x, y in val_batches(val_w, cfg.micro_batch, cfg.eval_batches, ctx.rank, ctx.world):
        total += engine(x.to(ctx.device), y.to(ctx.device)).double()
    dist.all_reduce(total)
    return total.item() / (cfg.eval_batches * ctx.world)


def train(cfg: TrainConfig, ctx: RankContext, hooks: Hooks | None = None) -> dict:
    """Run ``cfg`` on this rank (the process group is up). Returns a summary dict on rank 0.

    No hangs (issue 9): a watchdog ends this rank if it makes no progress for about
    ``cfg.timeout_s`` (see :mod:`zerodp.train.watchdog`), and a collective that fails because a
    peer died or stalled is re-raised as a :class:`~zerodp.train.watchdog.CollectiveFailure`
    that says so, instead of a traceback from inside the backend.

    Stops early, on every rank after the same step, when any rank was asked to stop (SIGTERM or a
    first SIGINT, :mod:`zerodp.train.stop`) — with a checkpoint of that step — or when a
    checkpoint could not be written under ``--on-save-error stop``; it then returns
    ``{"stopped": {...}}`` on every rank and writes no report.

    ``hooks``: the run's seams (:class:`zerodp.train.hooks.Hooks`), passed to the loop and to every
    checkpoint save; by default the test-only faults of ``ZERODP_TEST_FAULT``
    (:mod:`zerodp.train.faults`), which are no-ops when it is not set.
    """
    hooks = Faults.from_env(ctx.rank) if hooks is None else hooks
    with Watchdog.for_timeout(cfg.timeout_s, ctx.rank) as dog:
        dog.slow("start-up")  # longer limit until the first step
        run = None
        try:
            run = Run(cfg, ctx, dog, hooks)  # data, model, engine, the resumed state, metrics log, progress
            return _train(run, cfg, ctx, dog)
        except Exception as e:
            if run is not None:  # this process ends with the error: its engine serves nothing at the exit
                run.engine.control.end_with(e)
            if is_collective_error(e):
                raise explain(e, ctx.rank, ctx.world, dog.where, cfg.timeout_s) from None
            raise


def _train(run: "Run", cfg: TrainConfig, ctx: RankContext, dog: Watchdog) -> dict:
    """The loop of guide §5, step by step: train, agree on a stop, evaluate, log, checkpoint."""
    run.evaluate_before_first_step()
    t_run = time.perf_counter()
    stopped = None  # why this invocation ends before ``run.end``, if it does
    for step in range(run.start, run.end):
        result = run.train_step(step)
        stop_sig = run.decide_stop(result)  # the same answer on every rank
        run.clock(result)
        val_loss = run.maybe_evaluate(result.done, stop_sig)
        run.log_step(result, val_loss)
        stopped = run.maybe_checkpoint(result.done, stop_sig)  # a save the filesystem refused
        if stopped is None and stop_sig is not None:
            stopped = dict(reason="signal", signal=stop_sig.name, step=result.done,
                           checkpoint=str(run.last_ckpt))
        if stopped is not None:
            break
    run.bar.close()
    if stopped is not None:
        return run.stop(stopped)
    return run.report(wall=time.perf_counter() - t_run)


@dataclass
class StepResult:
    """What one optimizer step gave: :meth:`Run.train_step` fills it, :meth:`Run.decide_stop` adds
    the loss averaged over ranks, :meth:`Run.clock` the step's time."""

    step: int  # the step taken (0-based); ``done`` steps are then complete
    lr: float
    loss_sum: torch.Tensor  # this rank's loss, summed over its micro-batches
    norm: torch.Tensor  # the global gradient norm before clipping
    guard: object  # the engine's non-finite guard statistics after the step
    t0: float  # perf_counter at the start of the step's clock
    loss: float = float("nan")
    seconds: float = 0.0

    @property
    def done(self) -> int:
        return self.step + 1


class Run:
    """One invocation of a training run on this rank: what was set up before the first step, and
    the state the loop carries from step to step (last checkpoint, step times, save errors)."""

    def __init__(self, cfg: TrainConfig, ctx: RankContext, dog: Watchdog, hooks: Hooks):
        self.cfg, self.ctx, self.dog, self.hooks = cfg, ctx, dog, hooks
        self.lead = ctx.rank == 0
        self.out = Path(cfg.out)
        self.corpus, self.mc, self.plan, self.train_w, self.val_w = prepare(cfg, ctx.world)
        if hooks.warning():
            self.say(f"warning: {hooks.warning()}")
        ck = check_resume(cfg, self.mc, log=self.say)
        hooks.at_start(ck.step if ck is not None else 0)
        dog.slow("building the engine")
        self.engine, self.n_params = build_engine(cfg, self.mc, ctx)
        self.start = self._resume(ck)
        self.end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.start + cfg.stop_after)
        self.stream = TrainStream(self.train_w, Sharding(self.plan.micro_batch, self.plan.grad_acc, ctx.world),
                                  cfg.seed)
        self.fpt = flops_per_token(self.mc, self.n_params)
        self.step_tokens = self.plan.global_batch * cfg.seq_len
        self.bucket = bucket_words(self.engine, cfg)
        self.bucket_mb = self.engine.config.bucket_mb  # the resolved MiB under --bucket-mb auto (stages 0-2)
        self.log = MetricsLog(self.out / METRICS_FILE) if self.lead else None
        self._log_start(resumed=ck is not None)
        self.bar = ProgressBar(self.end, self.start, enabled=self.lead and cfg.progress,
                               every_steps=cfg.progress_every, every_s=cfg.progress_every_s)
        self.trace_step = self.start + min(2, self.end - self.start - 1)  # a warm step, not the first
        self.step_times: list[float] = []
        self.last_ckpt: Path | None = None
        self.train_loss = float("nan")
        self.skipped_steps = 0
        self.save_errors: list[str] = []
        self.stopper = stopping.current()  # SIGTERM / first SIGINT: stop after this step (zerodp.train.stop)

    def say(self, *args, **kwargs) -> None:
        """Print on rank 0 only."""
        if self.lead:
            print(*args, **kwargs)

    def record(self, event: str, **fields) -> None:
        """A record of the metrics log (rank 0 only)."""
        if self.lead:
            self.log.write(event, **fields)

    # ------------------------------------------------------------------------------ before step 1

    def _resume(self, ck: "ckpt.Checkpoint | None") -> int:
        """Load the validated checkpoint on every rank; the step the loop starts from."""
        if ck is None:
            return 0
        self.dog.slow(f"loading checkpoint {ck.path}")
        load_into(self.engine, ck, self.ctx)
        self.say(f"resumed from {ck.path} at step {ck.step} (saved by {ck.world_size} ranks at stage "
                 f"{ck.manifest.get('stage')}; now {self.ctx.world} ranks at stage {self.cfg.stage})")
        return ck.step

    def _log_start(self, resumed: bool) -> None:
        cfg, ctx, plan, corpus, n = self.cfg, self.ctx, self.plan, self.corpus, self.n_params
        self.record("resume" if resumed else "start", step=self.start, world=ctx.world, stage=cfg.stage,
                    params=n, grad_acc=plan.grad_acc, global_batch=plan.global_batch,
                    bucket_mb=self.bucket_mb, bucket_auto=self.engine.bucket_auto,
                    config=asdict(cfg), model=self.mc.to_dict(), corpus=corpus.name,
                    train_tokens=int(corpus.train.size), val_tokens=int(corpus.val.size))
        self.say(f"model {cfg.preset}: {n / 1e6:.2f}M parameters | data {corpus.name}: "
                 f"{corpus.train.size:,} train / {corpus.val.size:,} val tokens | {ctx.world} ranks, "
                 f"stage {cfg.stage}, global batch {plan.global_batch} × {cfg.seq_len} tokens = "
                 f"{plan.micro_batch} micro × {plan.grad_acc} grad_acc × {ctx.world} ranks | {self.bucket}")

    def evaluate_before_first_step(self) -> None:
        """The validation loss of the starting point: at step 0, or a resumed step on the interval."""
        cfg, start = self.cfg, self.start
        if cfg.eval_every and start % cfg.eval_every == 0 or start == 0:
            self.dog.slow(f"validation at step {start}")
            val_loss = evaluate(self.engine, self.val_w, cfg, self.ctx)  # collective: every rank
            self.record("eval", step=start, val_loss=val_loss)

    # ------------------------------------------------------------------------------- every step

    def train_step(self, step: int) -> StepResult:
        """One optimizer step (guide §5): ``grad_acc`` micro-batches with the gradient sync switched
        off (``no_sync``) for all but the last, then clipping and the optimizer step, which the
        engine skips on every rank when any rank's gradients hold inf/NaN."""
        cfg, ctx, engine, dog, grad_acc = self.cfg, self.ctx, self.engine, self.dog, self.plan.grad_acc
        dog.pet(f"step {step}")
        self.hooks.at_step_start(step)
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(engine, lr)
        loss_sum = torch.zeros((), device=ctx.device)
        for micro in range(grad_acc):
            dog.pet(f"step {step}, micro-batch {micro} (forward/backward)")
            x, y = self.stream.micro_batch(step, micro, ctx.rank)
            with engine.no_sync(micro < grad_acc - 1):
                loss = engine(x.to(ctx.device), y.to(ctx.device)) / grad_acc
                loss.backward()
            loss_sum += loss.detach().float()
        self.hooks.after_backward(engine, step)
        dog.pet(f"step {step}, gradient clipping and optimizer step")
        norm = engine.clip_grad_norm_(cfg.clip)
        engine.step()  # skipped on every rank when any rank's gradients hold inf/NaN
        engine.zero_grad()
        guard = engine.guard.stats()
        if guard.last_skipped:
            self._skipped(step, guard)
        return StepResult(step, lr, loss_sum, norm, guard, t0)

    def _skipped(self, step: int, guard) -> None:
        self.skipped_steps += 1
        if not self.lead:
            return
        self.record("skip", step=step + 1, ranks=guard.last_ranks, consecutive=guard.consecutive,
                    skipped_steps=guard.skipped_steps)
        (self.bar.write if self.cfg.progress else self.say)(
            f"step {step + 1}: inf/NaN gradients on rank(s) {', '.join(map(str, guard.last_ranks))}; the "
            f"step was skipped on every rank ({guard.consecutive} in a row, at most {self.cfg.max_skipped_steps})")

    def decide_stop(self, result: StepResult) -> signal.Signals | None:
        """The loss and every rank's stop votes in one AllReduce: all ranks learn after the same
        step whether any of them was asked to stop (the signal, or None to go on). A request that
        arrives during the last step changes nothing: the run is then complete."""
        reduced = torch.cat([result.loss_sum.view(1), torch.tensor(self.stopper.votes(), device=self.ctx.device)])
        dist.all_reduce(reduced)
        result.loss = self.train_loss = reduced[0].item() / self.ctx.world
        return stopping.decided(reduced[1].item(), reduced[2].item()) if result.done < self.end else None

    def clock(self, result: StepResult) -> None:
        """The step's time (from its start to the agreement on a stop); the trace of a warm step."""
        result.seconds = time.perf_counter() - result.t0
        self.step_times.append(result.seconds)
        if self.cfg.trace and result.step == self.trace_step:  # the engine counts steps from 0 in this process
            self.engine.export_chrome_trace(self.out / TRACE_FILE, step=result.step - self.start)

    def maybe_evaluate(self, done: int, stop_sig) -> float | None:
        """The validation loss after step ``done`` on the interval and at the end (not on a stop)."""
        cfg = self.cfg
        if stop_sig is None and ((cfg.eval_every and done % cfg.eval_every == 0) or done == self.end):
            self.dog.pet(f"validation at step {done}")
            return evaluate(self.engine, self.val_w, cfg, self.ctx)
        return None

    def log_step(self, result: StepResult, val_loss: float | None) -> None:
        done, s, tokens = result.done, result.seconds, self.step_tokens
        if self.lead:
            self.log.write("step", step=done, loss=result.loss, lr=result.lr, grad_norm=float(result.norm),
                           skipped=result.guard.last_skipped, skipped_steps=result.guard.skipped_steps,
                           step_s=s, tokens=done * tokens, tokens_per_s=tokens / s,
                           flops_per_s=self.fpt * tokens / s, epoch=self.stream.epoch_at(done))
            if val_loss is not None:
                self.log.write("eval", step=done, val_loss=val_loss)
        self.bar.update(result.loss, tokens / s, s, val_loss, result.guard.skipped_steps)

    def maybe_checkpoint(self, done: int, stop_sig) -> dict | None:
        """Save after step ``done`` on the interval, at the end and on a stop. Returns why the run
        stops when the filesystem refused a save that must succeed (``--on-save-error stop``, the
        last one, or the one of a stop), else None."""
        cfg = self.cfg
        if not ((cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == self.end or stop_sig is not None):
            return None
        saved = self.checkpoint(done)
        self.last_ckpt = saved or self.last_ckpt
        if saved is None and (cfg.on_save_error is OnSaveError.STOP or done == self.end or stop_sig is not None):
            return dict(reason="save-error", step=done, error=self.save_errors[-1],
                        signal=stop_sig.name if stop_sig is not None else None)
        if saved is None:
            self.say(f"training continues (--on-save-error continue); the next save is at step "
                     f"{done + cfg.ckpt_every if cfg.ckpt_every else self.end}")
        return None

    def checkpoint(self, step: int) -> Path | None:
        """Save the checkpoint of ``step`` on every rank; None when the filesystem refused it (every
        rank then prints the same sentence, and the checkpoints saved before are intact)."""
        cfg, plan, corpus = self.cfg, self.plan, self.corpus
        self.dog.pet(f"saving the checkpoint of step {step}")
        meta = dict(stage=cfg.stage, mixed_precision=cfg.mixed_precision, model=self.mc.to_dict(),
                    train=asdict(cfg), scalars=self.engine.checkpoint.scalar_state(),
                    data=dict(step=step, samples_consumed=step * plan.global_batch, seed=cfg.seed,
                              corpus=corpus.name, kind=corpus.kind, epoch=self.stream.epoch_at(step)))
        try:
            path = ckpt.save(self.engine.checkpoint.state_pieces(), self.out / CHECKPOINTS, step, meta,
                             keep=cfg.keep_checkpoints, hooks=self.hooks)
        except ckpt.CheckpointWriteError as e:
            self.save_errors.append(str(e))
            print(f"zerodp: rank {self.ctx.rank}: {e}", file=sys.stderr, flush=True)
            self.record("save_error", step=step, error=str(e))
            return None
        self.record("checkpoint", step=step, path=str(path))
        return path

    # ------------------------------------------------------------------------------- the end

    def stop(self, stopped: dict) -> dict:
        """Stopped early: a preemption or a checkpoint that could not be written. No report (the run
        is not over); the metrics log says where it stopped, and the launcher says the rest."""
        self.stopper.done()
        if self.lead:
            self.log.write("stop", **stopped)
            self.log.close()
            self.say(_stopped_words(stopped, self.last_ckpt))
        return dict(stopped=stopped, out=str(self.out),
                    checkpoint=str(self.last_ckpt) if self.last_ckpt else None)

    def report(self, wall: float) -> dict:
        """Every rank's engine statistics, gathered; on rank 0 the summary the report is written from."""
        cfg, ctx, engine, last = self.cfg, self.ctx, self.engine, self.last_ckpt
        self.dog.pet("the end-of-run report")
        try:
            stats = engine.stats()
        except Exception as e:  # the report then says it has no engine measurements, and why
            stats = None
            self.say(f"warning: engine.stats() failed ({type(e).__name__}: {e}); the report has no memory "
                     "or communication tables")
        everyone = [None] * ctx.world
        dist.all_gather_object(everyone, stats)
        if not self.lead:
            return {}
        self.log.write("end", step=self.end, wall_s=wall, train_loss=self.train_loss)
        self.log.close()
        return dict(out=str(self.out), steps=self.end, total_steps=cfg.steps, start=self.start, world=ctx.world,
                    stage=cfg.stage, params=self.n_params, flops_per_token=self.fpt,
                    step_tokens=self.step_tokens, step_times=self.step_times, wall_s=wall,
                    checkpoint=str(last) if last else None,
                    trace=str(self.out / TRACE_FILE) if cfg.trace else None, stats=everyone,
                    device=str(ctx.device), mixed_precision=cfg.mixed_precision,
                    bucket_mb=self.bucket_mb, bucket_auto=engine.bucket_auto, bucket=self.bucket,
                    grad_acc=self.plan.grad_acc, global_batch=self.plan.global_batch,
                    skipped_steps=self.skipped_steps, save_errors=self.save_errors)


def _stopped_words(stopped: dict, last_ckpt) -> str:
    if stopped["reason"] == "signal":
        return (f"stopped on {stopped['signal']} after step {stopped['step']}: every rank saved the "
                f"checkpoint {last_ckpt}")
    return f"stopped after step {stopped['step']}: its checkpoint could not be written (see above)"
