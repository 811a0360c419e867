"""What one training run is: a dataclass of every setting, and the batch arithmetic of guide §6.1.

``gbs_tokens = gbs × seq_len`` and ``gbs = mbs × grad_acc × dp`` (guide §6): the user fixes the
global batch in tokens and the sequence length (steps 1–2 of §6.1), picks the largest micro-batch
that fits (step 3), and the number of ranks; gradient accumulation makes up the rest (step 4).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from zerodp.plan.batch import plan_batch as planner_batch

if TYPE_CHECKING:  # the CLI imports this module; keep it free of torch until a run starts
    from zerodp.train.model import GPTConfig

# Names of zerodp.train.model.PRESETS (checked against it in tests), so that parsing arguments
# does not import torch.
PRESET_NAMES = ("nano", "tiny", "small", "medium", "gpt2-small")

STAGES = (0, 1, 2, 3)
from zerodp.plan.units import AUTO  # noqa: E402 - --bucket-mb auto


class Mode(str, enum.Enum):
    """A setting given as a word, parsed once where it enters (a flag, a TOML key, a dict read
    back): the code behind compares members, never strings. A member still equals, hashes, prints
    and serialises (JSON, TOML, pickle) as its spelling, so logs, manifests and configs read as before."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value, flag: str, aliases: dict | None = None, optional: bool = True):
        """``value`` as a member (None stays None where ``optional``); one sentence naming ``flag``
        and the choices when it is none of them. ``aliases``: the spellings accepted → a member or None."""
        if isinstance(value, cls) or (value is None and optional):
            return value
        if aliases is not None and value in aliases:
            return aliases[value]
        try:
            return cls(value)
        except ValueError:
            words = list(aliases) if aliases is not None else [m.value for m in cls]
            raise ValueError(f"{flag} must be one of {', '.join(words)}, got {value!r}") from None


class Precision(Mode):
    """``--mixed-precision`` and ``--reduce-dtype``: bf16, or None for fp32 throughout (guide §1, §15)."""

    BF16 = "bf16"


class Quantize(Mode):
    """``--quantize``: which collectives travel in int8 (guide §15)."""

    PARAMS = "params"
    GRADS = "grads"
    BOTH = "both"

    @property
    def params(self) -> bool:
        return self in (Quantize.PARAMS, Quantize.BOTH)

    @property
    def grads(self) -> bool:
        return self in (Quantize.GRADS, Quantize.BOTH)


class OnSaveError(Mode):
    """``--on-save-error``: a checkpoint the filesystem refuses stops the run, or the run goes on."""

    STOP = "stop"
    CONTINUE = "continue"


class Backend(Mode):
    """``--backend``: auto (nccl when CUDA is available, else gloo), gloo or nccl."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


#: what --mixed-precision accepts (the engine's names; it refuses fp16, which needs loss scaling) -> the field
MIXED_PRECISION_CHOICES = {"fp32": None, "bf16": Precision.BF16, "float32": None, "bfloat16": Precision.BF16}
ON_SAVE_ERROR = tuple(m.value for m in OnSaveError)


@dataclass(frozen=True)
class BatchPlan:
    """The factors of the global batch (guide §6): ``gbs = micro_batch × grad_acc × dp``."""

    global_batch_tokens: int
    seq_len: int
    micro_batch: int
    dp: int
    global_batch: int  # samples
    grad_acc: int


def plan_batch(global_batch_tokens: int, seq_len: int, micro_batch: int, dp: int) -> BatchPlan:
    """grad_acc = gbs / (mbs × dp) with gbs = global_batch_tokens / seq_len (guide §6.1, step 4).

    Raises ``ValueError`` that names the numbers and a fix when the factors do not divide, and when
    ``grad_acc`` would be below 1 (more ranks than the batch needs: "GPU-rich", guide §6.1).
    """
    for name, v in (("--global-batch-tokens", global_batch_tokens), ("--seq-len", seq_len),
                    ("--micro-batch", micro_batch), ("number of ranks", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if global_batch_tokens % seq_len:
        raise ValueError(
            f"--global-batch-tokens {global_batch_tokens} is not a multiple of --seq-len {seq_len}: "
            f"the global batch is a whole number of sequences; try {_round(global_batch_tokens, seq_len)}")
    gbs = global_batch_tokens // seq_len
    per_pass = micro_batch * dp
    if gbs < per_pass:
        raise ValueError(
            f"the global batch of {gbs} sequences is smaller than --micro-batch {micro_batch} × "
            f"{dp} ranks = {per_pass}, so grad_acc would be below 1 (too many ranks for this batch, "
            f"guide §6.1): lower --micro-batch, use fewer ranks, or raise --global-batch-tokens to "
            f"{per_pass * seq_len}")
    if gbs % per_pass:
        raise ValueError(
            f"the global batch of {gbs} sequences ({global_batch_tokens} tokens / {seq_len}) is not "
            f"divisible by --micro-batch {micro_batch} × {dp} ranks = {per_pass}: choose "
            f"--global-batch-tokens {_round(gbs, per_pass) * seq_len} or a micro-batch that divides "
            f"{gbs // dp if gbs % dp == 0 else gbs}")
    # The planner's arithmetic (guide §6.1), without its power-of-two rounding: a training run takes
    # the batch it is given. The checks above turned each of its warnings into an error first.
    plan = planner_batch(global_batch_tokens, seq_len, micro_batch, dp, round_to_power_of_two=False)
    if plan.warnings or plan.samples != gbs:
        raise ValueError("; ".join(plan.warnings) or f"planner disagrees: {plan}")
    return BatchPlan(global_batch_tokens, seq_len, micro_batch, dp, plan.samples, plan.grad_acc)


def _round(x: int, m: int) -> int:
    return max(m, round(x / m) * m)


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run; the CLI flags map one to one onto these fields."""

    preset: str = "tiny"
    data: str | None = None  # None: the bundled corpus
    out: str | None = None  # run directory; None: runs/<timestamp>
    steps: int = 60  # the whole run (the learning-rate schedule spans these)
    stop_after: int | None = None  # end this invocation after so many steps (checkpoint, report)
    global_batch_tokens: int = 8192
    seq_len: int = 128
    micro_batch: int = 16
    stage: int = 2
    mixed_precision: Precision | None = None  # None: fp32 throughout
    bucket_mb: float | str = 0.5  # MiB, or "auto": the simulator's sweet spot from --profile (guide §4)
    shard_size: int | None = None  # hybrid sharding (guide §14): ranks per shard group; None: one node
    reduce_dtype: Precision | None = None  # bf16: gradients travel in bf16 (guide §15)
    quantize: Quantize | None = None  # params, grads or both: int8 collectives (guide §15)
    # DiLoCo over the shard groups (guide §16, zerodp.engine.outer): sync every H inner steps
    diloco_every: int | None = None
    diloco_fragments: int = 1  # Streaming DiLoCo: F fragments at staggered steps
    diloco_compress: str | None = None  # "int8": the pseudo-gradients in blockwise int8
    diloco_delay: int = 0  # τ: a fragment's exchange applied τ inner steps after its sync step
    diloco_lr: float = 0.7  # the outer SGD (DiLoCo's values)
    diloco_momentum: float = 0.9  # Nesterov momentum of the outer SGD; 0: plain averaging at lr 1
    profile: str | None = None  # calibration profile (zerodp calibrate) for --bucket-mb auto
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1234
    eval_every: int = 20
    eval_batches: int = 2
    ckpt_every: int = 30  # 0: only at the end
    keep_checkpoints: int = 2
    resume: str | None = None  # a checkpoint directory or a run directory (its latest checkpoint)
    trace: bool = False
    nproc: int = 2
    backend: Backend = Backend.AUTO  # auto: nccl when CUDA is available, else gloo
    max_restarts: int = 0
    timeout_s: float = 600.0  # collective timeout; the watchdog allows 1.5x this + 2 s (issue 9)
    max_skipped_steps: int = 3  # stop after this many consecutive steps with inf/NaN gradients
    grace_s: float = 30.0  # SIGTERM / first SIGINT: stop with a checkpoint within this (zerodp.train.stop)
    on_save_error: OnSaveError = OnSaveError.STOP  # a checkpoint the filesystem refuses: stop, or continue
    progress: bool = True
    progress_every: int = 0  # without a terminal: a progress line every N steps; 0: a twentieth of the run
    progress_every_s: float = 30.0  # ... and at least every so many seconds
    tensorboard: bool = False  # also TensorBoard events in OUT/tensorboard (the tensorboard extra)
    compile: bool = False  # model.compile() before parallelize: inductor on CUDA, aot_eager on CPU (docs/engine.md)
    plan: str | None = None  # "auto": the layout from a short trial of the planner's top 3 (train.autoplan)
    replica_groups: int | None = None  # R groups of nproc ranks that survive a failure (zerodp.ft.app)

    def __post_init__(self):
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"unknown --preset {self.preset!r}; choose one of {', '.join(PRESET_NAMES)}")
        if self.stage not in STAGES:
            raise ValueError(f"unknown --stage {self.stage!r}: stages are 0 (DP), 1 (ZeRO-1), "
                             "2 (ZeRO-2), 3 (ZeRO-3/FSDP)")
        self._parse_modes()
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1 (ranks per shard group), got {self.shard_size}")
        for name in ("steps", "seq_len", "micro_batch", "global_batch_tokens", "nproc",
                     "eval_batches", "keep_checkpoints", "max_skipped_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "ckpt_every", "warmup_steps", "max_restarts", "progress_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.progress_every_s > 0:
            raise ValueError(f"--progress-every-s must be a positive number of seconds, got {self.progress_every_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s must be a positive number of seconds, got {self.timeout_s}")
        if not 1 <= self.grace_s <= 86400:
            raise ValueError(f"--grace-s must be a number of seconds from 1 to 86400, got {self.grace_s}")
        self._check_bucket()
        self._check_diloco()
        self._check_replica_groups()

    def _check_replica_groups(self) -> None:
        """``--replica-groups R`` (zerodp.ft.app): R >= 2, and none of the settings it does not run."""
        if self.replica_groups is None:
            return
        if isinstance(self.replica_groups, bool) or not isinstance(self.replica_groups, int) or self.replica_groups < 2:
            raise ValueError(f"--replica-groups must be >= 2, got {self.replica_groups} (groups that heal from "
                             "each other)")
        given = [flag for flag, on in (
            ("--shard-size (each group of --nproc ranks is sharded whole)", self.shard_size is not None),
            ("--diloco-compress int8 (DiLoCo's syncs cross torchft's group in fp32)", self.diloco_compress is not None),
            ("--diloco-delay (DiLoCo's syncs cross torchft's group at once)", self.diloco_delay != 0),
            ("--plan auto", self.plan is not None), ("--resume (a restarted group heals from a live peer)",
                                                      self.resume is not None),
            ("--stop-after", self.stop_after is not None), ("--compile", self.compile), ("--trace", self.trace),
            ("--tensorboard", self.tensorboard), ("--backend nccl (the groups run on CPU, gloo)",
                                                  self.backend is Backend.NCCL)) if on]
        if given:
            raise ValueError(f"--replica-groups does not run with {given[0]}: leave it out")

    def _check_diloco(self) -> None:
        """``--diloco-*`` (guide §16): the planner's checks (F ≤ H, τ < H), and no half outer loop."""
        if self.diloco_compress == "none":
            object.__setattr__(self, "diloco_compress", None)
        if self.diloco_every is None:
            given = [f"--diloco-{k}" for k, v in (("fragments", self.diloco_fragments != 1),
                                                   ("compress", self.diloco_compress is not None),
                                                   ("delay", self.diloco_delay != 0),
                                                   ("lr", self.diloco_lr != 0.7),
                                                   ("momentum", self.diloco_momentum != 0.9)) if v]
            if given:
                raise ValueError(f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} DiLoCo's "
                                 "outer loop: add --diloco-every H "
                                 "(inner steps between syncs) and --shard-size G (the replica groups)")
            return
        from zerodp.plan.diloco import DiLoCoSettings

        try:
            DiLoCoSettings(every=self.diloco_every, fragments=self.diloco_fragments,
                           compress=self.diloco_compress or "none", delay=self.diloco_delay, lr=self.diloco_lr,
                           momentum=self.diloco_momentum)
        except ValueError as e:
            raise ValueError(f"--diloco-*: {e}") from None
        if self.shard_size is None and self.replica_groups is None:
            raise ValueError("--diloco-every needs --shard-size G: the replica groups of G ranks that sync every "
                             f"{self.diloco_every} steps (at least two groups: G at most half the ranks); or "
                             "--replica-groups R: R jobs of --nproc ranks that heal from a peer")

    def outer(self):
        """The engine's ``outer=`` for this run (``zerodp.DiLoCo``), or None without ``--diloco-every``."""
        if self.diloco_every is None:
            return None
        from zerodp.engine.config import DiLoCo

        return DiLoCo(every=self.diloco_every, fragments=self.diloco_fragments, compress=self.diloco_compress,
                      delay=self.diloco_delay, lr=self.diloco_lr, momentum=self.diloco_momentum)

    def _parse_modes(self) -> None:
        """The settings given as words, as :class:`Mode` members (the one place they are parsed)."""
        def put(name: str, value) -> None:
            object.__setattr__(self, name, value)

        put("mixed_precision", Precision.parse(self.mixed_precision, "--mixed-precision", MIXED_PRECISION_CHOICES))
        put("reduce_dtype", Precision.parse(self.reduce_dtype, "--reduce-dtype"))
        put("quantize", Quantize.parse(self.quantize, "--quantize"))
        put("backend", Backend.parse(self.backend, "--backend", optional=False))
        put("on_save_error", OnSaveError.parse(self.on_save_error, "--on-save-error", optional=False))

    def _check_bucket(self) -> None:
        """``--bucket-mb``: a positive number of MiB, or ``auto`` with ``--profile`` (guide §4)."""
        if self.bucket_mb == AUTO:
            if self.profile is None and self.stage != 3:
                raise ValueError("--bucket-mb auto needs a calibration profile: pass --profile FILE "
                                 "written by `zerodp calibrate --nproc N --out FILE` (N = --nproc), "
                                 "or give --bucket-mb a number of MiB")
            return
        if isinstance(self.bucket_mb, str) or not self.bucket_mb > 0:
            raise ValueError(f"--bucket-mb must be a positive number of MiB or 'auto', got {self.bucket_mb!r}")

    @property
    def tokens_per_rank(self) -> int:
        """Tokens each rank runs per micro-batch (what ``--bucket-mb auto`` sizes buckets for)."""
        return self.micro_batch * self.seq_len

    def model_config(self, vocab_size: int) -> "GPTConfig":
        """The preset, at this run's sequence length and large enough for the data's vocabulary."""
        from zerodp.train.model import PRESETS

        base = PRESETS[self.preset]
        return replace(base, seq_len=self.seq_len, vocab_size=max(base.vocab_size, vocab_size))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
