"""Engine configuration: one dataclass, validated once, shared by every stage.

The stage switch follows guide §9: 0 = plain data parallelism (DDP), 1 = ZeRO-1 (optimizer
states sharded), 2 = ZeRO-2 (+ gradients), 3 = ZeRO-3 / FSDP (+ parameters).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerodp.plan.units import AUTO, STAGES  # noqa: E402 - one place for both
SYNC_MODES = ("naive", "overlap", "bucketed")  # guide §2.5, §3, §4
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb (guide §4)
DEFAULT_FIRST_BUCKET_MB = 1.0  # small first bucket: the last layers' gradients start moving early
#: The collective a gradient bucket goes through, per stage (stage 3 has FSDP units, no buckets).
BUCKET_COLLECTIVE = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter"}

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
#: what the optimizer may step (``master_dtype``): fp64 too, never fp16 (no loss scaling)
_MASTER_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
                  "fp64": torch.float64, "float64": torch.float64}


def parse_dtype(value: str | torch.dtype | None, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    known = _MASTER_DTYPES if what == "master_dtype" else _DTYPES
    try:
        return known[str(value).lower()]
    except KeyError:
        raise ValueError(f"{what}={value!r} is not a dtype I know; use one of {sorted(known)}") from None


@dataclass(frozen=True)
class MixedPrecision:
    """Guide §1: compute in ``param_dtype`` (bf16), keep fp32 master weights and optimizer states.

    ``reduce_dtype``: dtype of gradient communication (default: ``param_dtype``).
    ``fp32_grad_accum``: accumulate gradients across micro-batches in fp32 (+4 bytes/param, guide §9).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    fp32_grad_accum: bool = False

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @classmethod
    def parse(cls, value: "str | torch.dtype | MixedPrecision | object | None") -> "MixedPrecision | None":
        """``"bf16"``, a dtype, this class, or torch's own policy object kept from a ported wrap line
        (FSDP2's ``MixedPrecisionPolicy``, FSDP's and DDP's ``MixedPrecision``): see :meth:`of_torch`."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if hasattr(value, "param_dtype"):
            return cls.of_torch(value)
        dtype = parse_dtype(value, "mixed_precision")
        return None if dtype == torch.float32 else cls(param_dtype=dtype)

    @classmethod
    def of_torch(cls, policy) -> "MixedPrecision | None":
        """torch's policy read as this one: ``param_dtype`` computes, ``reduce_dtype`` reduces, the
        master stays fp32 (as FSDP2 keeps its sharded parameters). What has no counterpart here —
        a cast output, low-precision buffers or gradients, uncast inputs — is refused in one line."""
        name = type(policy).__name__
        casts = [getattr(policy, f) for f in ("cast_forward_inputs", "cast_root_forward_inputs") if hasattr(policy, f)]
        differs = [(f, getattr(policy, f)) for f, default in (("output_dtype", None), ("buffer_dtype", None),
                                                             ("keep_low_precision_grads", False))
                   if getattr(policy, f, default) != default
                   and not (f == "buffer_dtype" and getattr(policy, f) == torch.float32)]
        if casts and not any(casts):
            differs.append(("cast_forward_inputs", False))
        if differs:
            field_name, value = differs[0]
            raise ValueError(f"mixed_precision={name}(..., {field_name}={value!r}): no counterpart here (compute "
                             "runs in param_dtype, float inputs are cast to it, buffers and the gradients handed to "
                             f"the optimizer stay fp32); drop {field_name}")
        param, reduce = policy.param_dtype, policy.reduce_dtype
        if param in (None, torch.float32):
            if reduce not in (None, torch.float32):
                raise ValueError(f"mixed_precision={name}(reduce_dtype={reduce}) without a param_dtype: compute in "
                                 f"fp32 and reduce in {reduce} with parallelize(..., reduce_dtype={reduce}) instead")
            return None
        return cls(param_dtype=param, reduce_dtype=reduce)

    def __post_init__(self):
        if torch.float16 in (self.param_dtype, self.reduce_dtype):
            raise ValueError(
                "mixed_precision with float16 needs dynamic loss scaling (fp16 gradients underflow), "
                "which zerodp does not implement: use 'bf16' (same memory, fp32's exponent range)")


@dataclass(frozen=True)
class DiLoCo:
    """The outer loop over replica groups (guide §16; :mod:`zerodp.engine.outer`), given to
    ``parallelize(..., shard_size=g, outer=DiLoCo(every=H))``: each shard group of ``g`` ranks trains
    alone (ZeRO at the engine's stage inside it) and every ``every`` inner steps the groups average
    their pseudo-gradients Δ = θ_outer − θ_local and an outer SGD (``lr``, ``momentum``,
    ``nesterov``: ``torch.optim.SGD``'s) steps θ_outer, which then replaces θ_local.

    ``compress``: None (fp32 on the wire) or ``"int8"`` (blockwise, one fp32 scale per 256 elements,
    guide §15). ``fragments``: F, Streaming DiLoCo — each rank's outer shard is cut into F equal
    contiguous ranges, fragment f syncs after the inner steps k with (k − ⌊f·H/F⌋) mod H = 0
    (steps counted from 1). ``delay``: τ, the fragment's exchange launched at its sync step and
    applied τ inner steps later (its outer update then replaces the fragment, the local progress of
    those τ steps included: Streaming DiLoCo's merge with α = 1). 1 ≤ F ≤ H, 0 ≤ τ < H (the planner's
    :class:`~zerodp.plan.diloco.DiLoCoSettings` checks them)."""

    every: int
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    compress: str | None = None
    fragments: int = 1
    delay: int = 0

    def __post_init__(self):
        s = self.settings()  # the planner's checks, one sentence each
        object.__setattr__(self, "compress", None if s.compress == "none" else s.compress)
        for name in ("every", "fragments", "delay"):
            object.__setattr__(self, name, getattr(s, name))
        object.__setattr__(self, "lr", float(self.lr))
        object.__setattr__(self, "momentum", float(self.momentum))
        object.__setattr__(self, "nesterov", bool(self.nesterov))

    def settings(self):
        """The same outer loop as the planner takes it (:class:`zerodp.plan.diloco.DiLoCoSettings`)."""
        from zerodp.plan.diloco import DiLoCoSettings

        return DiLoCoSettings(every=self.every, fragments=self.fragments,
                              compress="none" if self.compress is None else self.compress, delay=self.delay,
                              lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)


@dataclass(frozen=True)
class Dtypes:
    """The engine's mixed-precision policy, resolved once at construction (guide §1, §9): the one
    source every part reads (``engine.dtypes``). ``param``: what the model computes in (parameters,
    activations, gathered units); ``reduce``: gradients on the wire; ``accum``: gradients kept across
    micro-batches; ``master``: what the optimizer steps; ``cast_inputs``: floating inputs and buffers
    are cast to ``param`` (mixed precision asked for)."""

    param: torch.dtype
    reduce: torch.dtype
    accum: torch.dtype
    master: torch.dtype
    cast_inputs: bool

    @classmethod
    def of(cls, config: "EngineConfig", params: list[torch.Tensor]) -> "Dtypes":
        """The policy ``parallelize`` was asked for (``mixed_precision``, ``reduce_dtype``,
        ``master_dtype``) resolved against the trainable parameters: one dtype among them unless
        mixed precision casts them (refused in one line otherwise)."""
        mp = config.mixed_precision
        if config.reduce_dtype is not None:  # gradients on the wire in another dtype (guide §15)
            mp = dataclasses.replace(mp or MixedPrecision(param_dtype=torch.float32),
                                     reduce_dtype=parse_dtype(config.reduce_dtype, "reduce_dtype"))
        found = sorted({str(p.dtype) for p in params})
        if mp is None and len(found) > 1:
            raise ValueError(f"parameters have several dtypes {found}: convert the model to one dtype, "
                             "or pass mixed_precision='bf16' to compute in bf16 with fp32 masters")
        return cls.resolve(mp, mp.param_dtype if mp else params[0].dtype,
                           parse_dtype(config.master_dtype, "master_dtype"))

    @classmethod
    def resolve(cls, mp: MixedPrecision | None, param: torch.dtype, master: torch.dtype | None) -> "Dtypes":
        """From the policy asked for (``mp``, with ``reduce_dtype`` folded in), the compute dtype and
        ``master_dtype=``: gradients accumulate in fp32 when parameters are fp32, with
        ``fp32_grad_accum``, or when they travel in fp32 anyway, never in less than they travel in;
        the optimizer steps fp32 under mixed precision, else the model's own dtype (torch's semantics:
        fp64 stays fp64, a bf16 model steps in bf16), unless ``master`` says otherwise."""
        if not param.is_floating_point:
            raise ValueError(f"parameters of dtype {param} cannot be trained")
        fp32 = torch.float32
        reduce = mp.comm_dtype if mp else param
        accum = fp32 if fp32 in (param, reduce) or (mp and mp.fp32_grad_accum) else reduce
        if accum.itemsize < reduce.itemsize:
            accum = reduce
        master = master or (fp32 if mp is not None and mp.param_dtype != fp32 else param)
        return cls(param=param, reduce=reduce, accum=accum, master=master, cast_inputs=mp is not None)


REPLICA, ALIGNED, EXCHANGE = "replica", "aligned", "exchange"  # Policy.whole_tensors


@dataclass(frozen=True)
class Policy:
    """What one stage keeps and which collectives move it (guide §12.2, "four policies").

    ===========================  =========  =========  ==================  =============
    stage                        master     gradients  parameters          collective
    ===========================  =========  =========  ==================  =============
    0 DDP                        full       full       full                AllReduce
    1 ZeRO-1                     shard      full       full, AG after step ReduceScatter
    2 ZeRO-2                     shard      shard      full, AG after step ReduceScatter
    3 ZeRO-3 / FSDP              shard      shard      shard, AG per use   ReduceScatter
    ===========================  =========  =========  ==================  =============

    ``full_grads``: full local gradients are kept at rest as a persistent buffer that
    ``param.grad`` views (stages 0-1, and stage 2 with ``reduce_every_microbatch=False``);
    otherwise ``grad_full`` lives only from a group's first gradient to its collective's end.
    ``keep_local``: gradients of a ``no_sync`` backward stay local until the step's synchronizing
    backward (every stage, except memory-first stages 2-3, which reduce every micro-batch).
    ``whole_tensors``: where a per-tensor optimizer (Muon, Adafactor) finds each tensor whole
    (guide §12.3): ``"replica"`` — every rank holds every tensor (stage 0); ``"aligned"`` — the
    buckets are cut at tensor boundaries so that each tensor lies whole in its owner's slice (stages
    1-2); ``"exchange"`` — units stay flat and the owner exchange brings each tensor whole to its
    owner for the step (stage 3, :mod:`zerodp.engine.exchange`).
    """

    stage: int
    shard_master: bool
    full_grads: bool
    shard_params: bool
    keep_local: bool
    whole_tensors: str

    @classmethod
    def of(cls, stage: int, reduce_every_microbatch: bool = True) -> "Policy":
        memory_first = stage >= 2 and reduce_every_microbatch
        return cls(stage=stage, shard_master=stage >= 1, full_grads=stage <= 1 or (stage == 2 and not memory_first),
                   shard_params=stage == 3, keep_local=not memory_first,
                   whole_tensors=REPLICA if stage == 0 else EXCHANGE if stage == 3 else ALIGNED)


@dataclass(frozen=True)
class EngineConfig:
    """Everything :func:`zerodp.parallelize` accepts besides the model and the optimizer.

    ``bucket_mb``: size of the gradient buckets in MiB (stages 0-2, guide §4), or ``"auto"``: the
    size at the simulator's sweet spot for this model on this machine, chosen once when the engine
    is built by :func:`zerodp.plan.calibrated.choose_bucket_mb` from a calibration ``profile`` (a path
    written by ``zerodp calibrate``, the loaded profile dict, or its ``calibration`` table) and
    ``tokens_per_rank`` (micro-batch × sequence length on each rank), with the AllReduce of stage
    0 or the ReduceScatter of stages 1-2, gradient elements of the communication dtype
    (:attr:`MixedPrecision.comm_dtype`: 4 bytes in fp32, 2 in bf16), and the world size of the
    process group (which must be the profile's). The engine's ``config.bucket_mb`` then holds the
    chosen number of MiB and ``engine.bucket_auto`` is True; ``first_bucket_mb`` is capped at it.
    Stage 3 has no gradient buckets (FSDP units, guide §10): ``"auto"`` is accepted and ignored
    there (no profile needed; ``config.bucket_mb`` stays ``"auto"``, ``engine.bucket_auto`` False).
    ``profile`` and ``tokens_per_rank`` are read only for ``bucket_mb="auto"``. At stage 2 with
    ``reduce_every_microbatch`` a bucket's gradients are allocated in backward and released after
    its ReduceScatter, so ``bucket_mb`` is also memory held in backward (:mod:`zerodp.engine.zero2`,
    guide §13.4); at stages 0-1 gradients stay at rest and it sets only the number of collectives.
    """

    stage: int = 0
    mixed_precision: MixedPrecision | None = None
    bucket_mb: float | str = DEFAULT_BUCKET_MB  # MiB, or "auto" (see above)
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB
    sync: str = "bucketed"
    # Gradient accumulation under stages 2-3: True reduces every micro-batch (memory first, as
    # DeepSpeed does); False keeps full local gradients and reduces once (communication first).
    reduce_every_microbatch: bool = True
    find_unused_parameters: bool = False
    average_by_tokens: bool = False  # guide §2.2: weight each rank by its token count
    prefetch: bool = True  # stage 3: AllGather unit i±1 while unit i computes (guide §9.3)
    # DDP's default: every forward starts from rank 0's buffers (BatchNorm statistics, ...).
    broadcast_buffers: bool = True
    # Stages 1-2: False (default) waits for the parameter AllGathers inside step(), so the model
    # holds the new parameters when step() returns; True leaves them in flight until the next
    # engine forward (or engine.module), overlapping them with whatever runs in between.
    overlap_param_gather: bool = False
    param_groups: Callable[[str, torch.nn.Parameter], dict[str, Any]] | None = None
    # Trust an optimizer class outside the stock elementwise list (a subclass, or one of your own)
    # to update each element from that element alone, so that it runs on flat shards.
    elementwise_optimizer: bool = False
    # Where the optimizer runs (guide §12.3): "flat" steps 1/N slices of flattened parameters, exact
    # for elementwise optimizers (AdamW, SGD, ...: the fast path); "owner" (tensor ownership) lays
    # each bucket or unit out so that every tensor lies whole in one rank's slice, and that rank
    # steps it with its real shape — exact for any per-tensor optimizer (Muon, Adafactor, or one
    # of your own that reads each tensor whole), at the price of padding between the slices
    # (engine.layout(), engine.stats().layout). "auto": flat for elementwise optimizers, owner for
    # the stock per-tensor ones (zerodp.engine.optimizer_plan.PER_TENSOR_OPTIMIZERS).
    optimizer_layout: str = "auto"
    # A collective of the engine that other ranks never issue (a stage-3 forward on rank 0 only)
    # ends this rank with CollectiveTimeout after this many seconds, not the backend's 30 minutes.
    timeout_s: float | None = 300.0
    # Skip steps whose gradients hold inf/NaN on any rank; raise after this many in a row
    # (None: no check, the step is applied as torch's optimizers would). See engine.guard.
    max_nonfinite_skips: int | None = None
    # bucket_mb="auto" only: the calibration profile and the tokens per rank per micro-batch.
    profile: "str | os.PathLike | dict | None" = None
    tokens_per_rank: int | None = None
    # Hybrid sharding (guide §14): stages 1-3 shard inside groups of this many ranks and replicate
    # across them. None: one node (torchrun's LOCAL_WORLD_SIZE) when that divides the world, else
    # every rank; an int g: consecutive ranks [k·g, (k+1)·g) form a shard group.
    shard_size: int | None = None
    # Compressed collectives (guide §15): gradients travel and are reduced in this dtype while
    # parameters and the master keep theirs (e.g. "bf16" with fp32 parameters).
    reduce_dtype: "str | torch.dtype | None" = None
    quantize_params: bool = False  # stages 1-3: int8 blockwise parameter AllGather (ZeRO++ qwZ)
    quantize_grads: bool = False  # stages 1-3: int8 gradient all-to-all, reduced in fp32 (qgZ)
    quant_block: int = 256  # elements per int8 scale
    # A model built on the meta device (guide §9.3, zerodp.engine.deferred): each module that owns
    # parameters runs its reset_parameters(), then init_fn(module) when given, under a seed
    # drawn from init_seed and the module's name (the same values at any world size and stage).
    init_fn: "Callable[[torch.nn.Module], None] | None" = None
    init_seed: int = 0
    # The dtype of the values the optimizer updates (guide §1, §12.3). None: fp32 under mixed
    # precision; otherwise the model's own dtype, as torch's optimizers step it (an fp64 model in
    # fp64, a model cast to bf16 in bf16). "fp32" keeps an fp32 master of a bf16 model (+4 B/param).
    master_dtype: "str | torch.dtype | None" = None
    # Replica groups that talk rarely (guide §16): a DiLoCo outer loop over the shard groups of
    # shard_size ranks (zerodp.engine.outer); None: every step reduces across the replicas.
    outer: DiLoCo | None = None
    # Replica groups that are jobs of their own and heal from a live peer (zerodp.ft.ReplicaGroups,
    # issue 52): the gradient reduction across the groups runs through torchft's managed process
    # group (the mean over the live groups), and a step commits only when the quorum agrees.
    replicas: "object | None" = None

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use 0 (DDP), 1, 2 or 3 (FSDP)")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync={self.sync!r} is unknown; use one of {', '.join(SYNC_MODES)}")
        if self.bucket_mb == AUTO:
            if self.stage != 3:
                self._check_auto_inputs()
        elif isinstance(self.bucket_mb, str) or not isinstance(self.bucket_mb, (int, float)):
            raise ValueError(f"bucket_mb={self.bucket_mb!r}: give a positive number of MiB, or 'auto' "
                             "for the simulator's sweet spot from a calibration profile (guide §4)")
        if self.shard_size is not None and (isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int)
                                            or self.shard_size < 1):
            raise ValueError(f"shard_size={self.shard_size!r}: give a positive number of ranks per shard group "
                             "(it must divide the world size), or None for one node")
        parse_dtype(self.reduce_dtype, "reduce_dtype")
        master = parse_dtype(self.master_dtype, "master_dtype")
        if master is not None and master not in _MASTER_DTYPES.values():
            raise ValueError(f"master_dtype={self.master_dtype!r}: the optimizer steps fp32, fp64 or bf16 values")
        if self.optimizer_layout not in ("auto", "flat", "owner"):
            raise ValueError(f"optimizer_layout={self.optimizer_layout!r}: use 'auto' (flat for elementwise "
                             "optimizers, owner for per-tensor ones), 'flat' or 'owner' (guide §12.3)")
        if self.optimizer_layout == "owner" and self.elementwise_optimizer:
            raise ValueError("elementwise_optimizer=True asks for flat shards and optimizer_layout='owner' for whole "
                             "tensors: pass one of the two")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"timeout_s={self.timeout_s!r}: give a positive number of seconds (or None to wait "
                             "as long as the process group does)")
        if (self.quantize_params or self.quantize_grads) and self.stage == 0:
            raise ValueError("quantize_params / quantize_grads compress the AllGather and ReduceScatter of "
                             "stages 1-3; stage 0 has neither: use reduce_dtype='bf16' to halve its AllReduce")
        if self.outer is not None and not isinstance(self.outer, DiLoCo):
            raise ValueError(f"outer={self.outer!r}: give zerodp.DiLoCo(every=H, ...) (guide §16), or None")
        if self.replicas is not None and self.average_by_tokens:
            raise ValueError("average_by_tokens=True with replicas=ReplicaGroups(...): a token count crosses one "
                             "replica group only, and the mean across the live groups is uniform, so groups with "
                             "unequal token totals would not be weighted by their tokens; give every rank the same "
                             "tokens per step and average_by_tokens=False (guide §2.2)")
        if isinstance(self.quant_block, bool) or not isinstance(self.quant_block, int) or self.quant_block < 1:
            raise ValueError(f"quant_block={self.quant_block!r}: give a positive number of elements per scale")
        if not ((self.bucket_mb == AUTO or self.bucket_mb > 0) and self.first_bucket_mb > 0):
            raise ValueError(
                f"bucket sizes must be positive MB, got bucket_mb={self.bucket_mb}, "
                f"first_bucket_mb={self.first_bucket_mb}"
            )

    def _check_auto_inputs(self) -> None:
        """``bucket_mb="auto"`` needs a profile and the tokens per rank; say how to give them."""
        if self.profile is None:
            raise ValueError(
                "bucket_mb='auto' needs a calibration profile: pass profile='profile.json' written by "
                "`zerodp calibrate` (or the loaded profile dict), or give bucket_mb a number of MiB")
        t = self.tokens_per_rank
        if t is None:
            raise ValueError(
                "bucket_mb='auto' needs tokens_per_rank, the tokens each rank runs per micro-batch "
                "(micro-batch × sequence length): pass e.g. tokens_per_rank=8 * 1024")
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tokens_per_rank must be a positive integer (micro-batch × sequence "
                             f"length on each rank), got {t!r}")


def resolve_auto_bucket(config: EngineConfig, module: torch.nn.Module, world_size: int,
                        param_dtype: torch.dtype, grad_dtype: torch.dtype) -> EngineConfig:
    """``config`` with ``bucket_mb="auto"`` replaced by the chosen MiB (guide §4) and
    ``first_bucket_mb`` capped at it; any other config unchanged.

    Called once by the bucket engines (stages 0-2) before they plan their buckets. The simulator
    sizes buckets in communicated bytes (``grad_dtype``, the dtype gradients travel in), the
    engine in bytes of ``param_dtype`` (:func:`zerodp.plan.units.plan_buckets`); the two
    differ only when bf16 gradients are reduced in fp32, and the choice is converted then. The
    arithmetic is the planner's (:func:`zerodp.plan.calibrated.choose_bucket_mb`).
    """
    if config.bucket_mb != AUTO or config.stage not in BUCKET_COLLECTIVE:
        return config
    from zerodp.plan.calibrated import choose_bucket_mb

    grad_bytes = grad_dtype.itemsize
    shapes = module_layer_shapes(module, config.tokens_per_rank)
    mb = choose_bucket_mb(config.profile, shapes, config.tokens_per_rank, grad_bytes_per_param=grad_bytes,
                          collective=BUCKET_COLLECTIVE[config.stage], world_size=world_size,
                          keeps_full=config.stage == 1)
    mb = float(mb) * param_dtype.itemsize / grad_bytes
    # The simulator prices equal buckets; a first bucket larger than the rest would defeat its
    # purpose (small, so that communication starts early), so it is capped at the chosen size.
    return dataclasses.replace(config, bucket_mb=mb, first_bucket_mb=min(config.first_bucket_mb, mb))


def module_layer_shapes(module: torch.nn.Module, tokens_per_rank: int | None = None):
    """The simulator's layers of any ``nn.Module``, from its parameters alone (guide §4).

    A model that describes itself — a ``cfg`` with ``n_layer``, ``d_model``, ``vocab_size``,
    ``seq_len`` (the GPT of the training app) — is cut into embedding, blocks and head
    (:func:`zerodp.plan.calibrated.gpt_layer_shapes`, at ``min(seq_len, tokens_per_rank)`` tokens
    per sequence). Otherwise modules are walked in
    registration order (``named_modules``), which stands for forward order; each module that
    directly owns trainable parameters is one layer. ``params`` counts the trainable parameters it
    owns, a shared (tied) parameter only at its first owner, where the engine's flat buffers hold
    it too; ``matmul_params`` counts all of them — a tied head still multiplies — except for
    ``nn.Embedding``, whose lookup costs no FLOPs. No attention term: a generic module's compute is
    shared out by its weights alone.
    """
    from zerodp.plan.calibrated import LayerShape, gpt_layer_shapes

    cfg = getattr(module, "cfg", None)
    if cfg is not None and all(hasattr(cfg, k) for k in ("n_layer", "d_model", "vocab_size", "seq_len",
                                                          "ffn_mult", "bias", "tie_weights")):
        return gpt_layer_shapes(cfg, min(cfg.seq_len, tokens_per_rank or cfg.seq_len))
    seen: set[int] = set()
    shapes = []
    for name, sub in module.named_modules():
        own = [p for p in sub.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        new = [p for p in own if id(p) not in seen]
        seen.update(id(p) for p in new)
        matmul = 0 if isinstance(sub, torch.nn.Embedding) else sum(p.numel() for p in own)
        shapes.append(LayerShape(name or type(sub).__name__, sum(p.numel() for p in new), matmul))
    if not shapes:
        raise ValueError("the model has no trainable parameters: no gradient buckets to size")
    return shapes
