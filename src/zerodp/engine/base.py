"""What every stage of the engine shares: the public contract, the step template, the flat groups.

Guide §9: stages 0-3 run the same training step — forward, backward with gradient communication,
an optimizer step on fp32 master values — and differ only in *what* each rank keeps and *which*
collectives move it (guide §12.2, "stages as policies"). Every stage holds its parameters in
:class:`~zerodp.engine.group.FlatGroup` s (``self.groups``: buckets at stages 0-2, units at stage
3) under one :class:`~zerodp.engine.group.Policy`, so this module does, once for every stage:

- the public API (``engine(x, y)``, ``no_sync``, ``clip_grad_norm_``, ``step``, ``zero_grad``,
  ``stats``, ``export_chrome_trace``, checkpoint pieces, ``full_state_dict``, ``state_dict``,
  ``layout``);
- the step template: finish gradient sync → (clip) → master optimizer step → publish params;
- over the groups: building them from the module (rank 0's values, or a model built on the meta
  device, guide §12.6), the master tensors and the optimizer, the one queue of gradient
  collectives in flight and its bound, the master gradients, publishing parameters, zeroing,
  memory by kind, and gathering full tensors for state dicts;
- process groups (hybrid sharding: a shard group and a replica group, guide §14), the start-up
  consistency check across ranks, the end-of-backward callback, averaging by tokens (§2.2).

Constructor (every stage)::

    StageEngine(module, optimizer_factory, config: EngineConfig,
                units: list[nn.Module] | None = None, group: ProcessGroup | None = None)

``optimizer_factory(param_groups) -> torch.optim.Optimizer`` builds a stock, elementwise
optimizer over the engine's fp32 master tensors (see :mod:`zerodp.engine.master`). ``units`` is
used by stage 3 only (FSDP units, guide §10.3); stages 0-2 ignore it.

A stage subclass sets ``stage``, then in ``__init__`` (after ``super().__init__``) sets the
dtypes (``_set_dtypes``), builds ``self.groups`` with ``_new_group``, runs the consistency check
and ``_init_groups()``, installs its hooks (which call ``FlatGroup.take_grad`` and
``_launch_reduce``) and calls ``_start_clock()``: :mod:`zerodp.engine.reducer` (stages 0-2) and
:mod:`zerodp.engine.fsdp` (stage 3) are the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import warnings
import weakref
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from zerodp.engine import state_dict as standard_state
from zerodp.engine.comm import Collectives, InFlight
from zerodp.engine.config import EngineConfig, MixedPrecision, parse_dtype
from zerodp.engine.deferred import init_device
from zerodp.engine.devices import check_devices
from zerodp.engine.grads import ShardedGrad
from zerodp.engine.group import FROZEN, FlatGroup, GradState, Policy, StoragePool
from zerodp.engine.guard import NonFiniteGuard
from zerodp.engine.layout import FlatLayout
from zerodp.engine.master import MasterOptimizer, OptimizerFactory, Piece, Target, param_targets
from zerodp.engine.optim import EngineOptimizer, UserGroups, from_built
from zerodp.engine.stats import MEMORY_KINDS, MODEL_STATE_KINDS, collect_stats, measured_bytes  # noqa: F401
from zerodp.engine.trace import COMPUTE, Recorder, write_chrome_trace

BUFFER = "buffer"  # checkpoint piece kind of a module buffer (saved whole, by rank 0)
#: On CPU the stock optimizer's per-tensor path makes ~8 passes over each tensor it updates; over
#: chunks of this many elements (512 KiB of fp32) those passes stay in cache, where over one flat
#: buffer of millions of elements each pass goes to memory (AdamW on 11M elements: ~2-3x faster).
CPU_OPTIMIZER_CHUNK = 1 << 17
_NORM_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
#: gradient reductions allowed in flight before the oldest is waited for (bounds transient buffers)
MAX_REDUCE_IN_FLIGHT = 2
#: the most fp32 gradient bytes cast at once for the optimizer step (see ``_optimizer_step``)
STEP_BATCH_BYTES = 16 * 1024 * 1024


def module_device(module: nn.Module) -> torch.device:
    """The one device all of ``module``'s parameters live on (DDP's rule: one device per rank)."""
    devices = {p.device for p in module.parameters()}
    if not devices:
        raise ValueError("the model has no parameters: there is nothing to train data-parallel")
    if any(d.type == "meta" for d in devices) and len(devices) > 1:
        raise ValueError(
            "some of the model's parameters are on the meta device and some are not: build the whole "
            "model under torch.device('meta') (parallelize then materializes and initializes it, "
            "guide §9.3), or the whole model on a real device")
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are spread over {sorted(map(str, devices))}; data parallelism "
            "keeps one full replica per rank on one device: move the model with model.to(device)"
        )
    return devices.pop()


def persistent_buffers(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(fqn, owning module, local name)`` of every buffer that ``module.state_dict()`` holds
    (non-persistent buffers such as masks and caches are derived, not state)."""
    out, seen = [], set()
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{name}" if prefix else name, sub, name))
    return out


def check_device(device: torch.device, group: dist.ProcessGroup | None) -> None:
    """NCCL runs on the current CUDA device: a model elsewhere would hang in the first
    ``all_gather_object``. Say what to call instead."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return
    if device.type != "cuda":
        if "gloo" in backend:  # e.g. "cpu:gloo,cuda:nccl": CPU tensors go through gloo
            return
        raise ValueError(f"the process group uses NCCL but the model is on {device}: move it to "
                         "torch.device('cuda', local_rank), or use the gloo backend for CPU training")
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ValueError(
            f"the model is on {device} but this rank's current CUDA device is cuda:{current}; NCCL "
            f"collectives run on the current device: call torch.cuda.set_device({device.index}) "
            "(usually the LOCAL_RANK) before init_process_group() and parallelize()")


def hybrid_groups(world: int, shard_size: int, group: dist.ProcessGroup | None):
    """This rank's shard group (consecutive ranks [k·g, (k+1)·g)) and replica group (the ranks
    holding the same slice in every shard group), guide §14. ``torch.distributed.new_group`` is
    collective over the whole job: every rank creates every group, in the same order — so hybrid
    sharding runs over the default group (every rank of the job builds the engine)."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            f"shard_size={shard_size} (hybrid sharding) needs the engine on every rank of the job: "
            f"this group holds {dist.get_world_size(group)} of {dist.get_world_size()} ranks; pass "
            "group=None, or shard_size equal to the group's size for flat sharding")
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    me = dist.get_rank(group)
    shard_pg = replica_pg = None
    for k in range(world // shard_size):
        pg = dist.new_group([to_global(r) for r in range(k * shard_size, (k + 1) * shard_size)])
        if me // shard_size == k:
            shard_pg = pg
    for i in range(shard_size):
        pg = dist.new_group([to_global(r) for r in range(i, world, shard_size)])
        if me % shard_size == i:
            replica_pg = pg
    return shard_pg, replica_pg


class StepState(enum.Enum):
    """Where the engine is in a training step (docs/porting.md; guide §12.5). One value per engine;
    every change goes through ``StageEngine._move``, which refuses what ``STEP_MOVES`` does not list.

    ``IDLE``: no gradient since construction or ``zero_grad``. ``BACKWARD``: a backward pass is
    running through the engine's hooks; found at the start of any other call, it means that pass
    raised before its end (the next call then says so, and ``zero_grad`` recovers). ``ACCUMULATED``:
    backward passes finished, gradients held. ``STEPPED``: ``step`` applied them; they stay until
    ``zero_grad``, so a second ``step`` applies them again, as torch's optimizers do."""

    IDLE = "idle"
    BACKWARD = "backward"
    ACCUMULATED = "accumulated"
    STEPPED = "stepped"


_S = StepState
STEP_MOVES: dict[StepState, frozenset[StepState]] = {
    _S.IDLE: frozenset({_S.IDLE, _S.BACKWARD, _S.STEPPED}),
    _S.BACKWARD: frozenset({_S.ACCUMULATED, _S.IDLE}),
    _S.ACCUMULATED: frozenset({_S.IDLE, _S.BACKWARD, _S.STEPPED}),
    _S.STEPPED: frozenset({_S.IDLE, _S.BACKWARD, _S.STEPPED}),
}


def resolve_param_groups(named_params: list[tuple[str, nn.Parameter]],
                         rule: Callable[[str, nn.Parameter], dict] | None) -> tuple[list[dict], list[int]]:
    """Map each parameter to an optimizer param group (e.g. no weight decay on norms and biases).

    ``rule(name, param)`` returns the group's options; parameters with equal options share a
    group, and each group gets its own flat buffers (a bucket never mixes groups). Returns the
    option dicts and, per parameter, its group index. The groups of an optimizer the user built
    (:class:`~zerodp.engine.optim.UserGroups`) are kept as they were, in their order.
    """
    if isinstance(rule, UserGroups):
        return [dict(o) for o in rule.options], [rule.group_of[id(p)] for _, p in named_params]
    options: list[dict] = []
    index: list[int] = []
    for name, p in named_params:
        opts = {} if rule is None else rule(name, p)
        if not isinstance(opts, dict):
            raise ValueError(
                f"param_groups({name!r}, param) returned {type(opts).__name__}; it must return a dict "
                "of optimizer options such as {'weight_decay': 0.0} (or {} for the defaults)"
            )
        if "params" in opts:
            raise ValueError(f"param_groups({name!r}, param) must not return 'params': the engine fills it")
        if opts not in options:
            options.append(dict(opts))
        index.append(options.index(opts))
    return options, index


def describe_difference(mine: Any, other: Any, path: str = "") -> str | None:
    """The first place where two nested descriptions differ, in words (None when equal)."""
    if type(mine) is not type(other):
        return f"{path or 'value'}: {mine!r} vs {other!r}"
    if isinstance(mine, dict):
        for key in list(mine) + [k for k in other if k not in mine]:
            if key not in mine or key not in other:
                return f"{path}{key}: present on {'rank 0' if key in mine else 'the other rank'} only"
            diff = describe_difference(mine[key], other[key], f"{path}{key}.")
            if diff:
                return diff
        return None
    if isinstance(mine, (list, tuple)):
        for i, (a, b) in enumerate(zip(mine, other)):
            diff = describe_difference(a, b, f"{path}[{i}]")
            if diff:
                return diff
        if len(mine) != len(other):
            return f"{path.rstrip('.') or 'list'}: {len(mine)} entries vs {len(other)}"
        return None
    return None if mine == other else f"{path.rstrip('.')}: {mine!r} vs {other!r}"


class StageEngine:
    """Base class of the stage engines; see the module docstring for the subclass contract."""

    stage: ClassVar[int] = -1
    grads_sharded: ClassVar[bool] = True
    #: True when ``config.bucket_mb`` was chosen by ``bucket_mb="auto"`` (stages 0-2, guide §4).
    bucket_auto: bool = False

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, config: EngineConfig,
                 units: list[nn.Module] | None = None, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: launch with torchrun (which sets RANK and "
                "WORLD_SIZE) and call torch.distributed.init_process_group(), or use "
                "zerodp.spawn.run_local for local ranks"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"parallelize expects a torch.nn.Module, got {type(module).__name__}")
        if isinstance(optimizer_factory, torch.optim.Optimizer):  # the script's configure_optimizers()
            if config.param_groups is not None:
                raise ValueError("parallelize got a built optimizer and param_groups: the optimizer's own param "
                                 "groups say which options each parameter gets; pass one of the two")
            built = optimizer_factory
            optimizer_factory, user_groups = from_built(built, module)
            config = dataclasses.replace(config, param_groups=user_groups)
            built.register_step_pre_hook(_rebuilt_optimizer_step)
        if not callable(optimizer_factory):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer over model.parameters() or a factory, e.g. "
                "optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4): the engine builds the optimizer "
                "over its own fp32 master shards"
            )
        if config.stage != self.stage:
            raise ValueError(f"{type(self).__name__} runs stage {self.stage}, config asks for {config.stage}")
        if module.__dict__.get("_zerodp_parallelized"):
            raise RuntimeError(
                "this model was already passed to zerodp.parallelize: its parameters are views into "
                "that engine's buffers and its hooks are still attached. Build a fresh model (or "
                "keep using the first engine) instead of parallelizing the same model twice")
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = module_device(module)
        # Built on the meta device: materialized by the stage, only what this rank keeps (§9.3).
        self.deferred = self.device.type == "meta"
        if self.deferred:
            self.device = init_device(group)
        check_device(self.device, group)
        check_devices(self.device, group)
        module.__dict__["_zerodp_parallelized"] = True
        self.units = units
        self.recorder = Recorder(self.rank, device=self.device)
        # The bounded wait is the host's (gloo); NCCL's own watchdog bounds CUDA collectives, whose
        # wait must stay a stream dependency, not a host block.
        timeout_s = config.timeout_s if self.device.type == "cpu" else None
        self.comm = Collectives(self.recorder, group, timeout_s=timeout_s)
        self.policy = Policy.of(self.stage, config.reduce_every_microbatch)
        self.shard_comm = self.comm  # where parameters and gradients are sharded
        self.replica_comm: Collectives | None = None  # hybrid sharding: across the replicas
        self.shard_size = self._shard_size()
        if self.shard_size < self.world_size:
            shard_pg, replica_pg = hybrid_groups(self.world_size, self.shard_size, group)
            self.shard_comm = Collectives(self.recorder, shard_pg, leg="intra", timeout_s=timeout_s)
            self.replica_comm = Collectives(self.recorder, replica_pg, leg="inter", timeout_s=timeout_s)
            self.comm.leg = "world"  # control values (flags, token counts) cross every rank
        self.groups: list[FlatGroup] = []  # the flat groups: buckets (stages 0-2) or units (stage 3)
        self._inflight = InFlight()  # gradient collectives issued, not yet waited for
        self._param_gathers = InFlight()  # stages 1-2: parameter AllGathers after the step
        self._grad_pool = StoragePool(MAX_REDUCE_IN_FLIGHT)  # released transient gradient buffers
        self._comm_peak = 0  # most bytes of transient gradient buffers alive at once, this step
        self.last_comm_peak = 0
        self.last_grad_bytes = 0
        self.mixed_precision = config.mixed_precision
        if config.reduce_dtype is not None:  # gradients on the wire in another dtype (guide §15)
            self.mixed_precision = dataclasses.replace(
                self.mixed_precision or MixedPrecision(param_dtype=torch.float32),
                reduce_dtype=parse_dtype(config.reduce_dtype, "reduce_dtype"))
        self._module = module
        self._factory = optimizer_factory
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no parameters with requires_grad=True: nothing to train")
        self.group_options, self.param_group_of = resolve_param_groups(self.named_params, config.param_groups)
        self._group_by_name = {n: g for (n, _), g in zip(self.named_params, self.param_group_of)}
        self.buffers = persistent_buffers(module)
        self._unused: set[str] = set()  # parameters no rank used in the last step (None grads)
        self.master: MasterOptimizer | None = None
        self._sync = True  # False inside no_sync(): gradients accumulate locally (guide §5)
        self._sync_at_forward = True
        self._tokens = 0.0  # this rank's tokens in this step (average_by_tokens, guide §2.2)
        self._token_factor_value: float | None = None
        self.step_state = StepState.IDLE
        self._buffers_stale = True  # DDP's require_forward_param_sync (see forward)
        self._grads_under_sharded: dict[int, torch.Tensor | None] = {}  # see _attach_sharded_grads
        self._backward_event = None
        self._facade: EngineOptimizer | None = None
        self._last_step_end: float | None = None
        self.last_step_time_s: float | None = None
        # Non-finite gradients: skip the step on every rank alike (see zerodp.engine.guard).
        skips = getattr(config, "max_nonfinite_skips", None)
        self.guard = None if skips is None else NonFiniteGuard(skips)

    # ---- public API ---------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model, with its parameters complete (waits for in-flight AllGathers)."""
        self._wait_params()
        return self._module

    @property
    def optimizer(self) -> EngineOptimizer:
        """A ``torch.optim.Optimizer`` whose ``step``, ``zero_grad``, ``state_dict`` and
        ``load_state_dict`` are the engine's, over the stock optimizer's ``param_groups`` (LR
        schedulers, ``GradScaler.step``, ``param_groups[i]["lr"] = ...``; see
        :mod:`zerodp.engine.optim`). The stock optimizer itself is ``engine.master.optimizer``."""
        if self._facade is None:
            self._facade = EngineOptimizer(self)
        return self._facade

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag: False makes the next forward's backward accumulate locally, as inside
        ``no_sync()`` (guide §5); True again synchronizes."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._check_not_failed("forward")
        if torch.is_grad_enabled():
            self._check_requires_grad()
        self._sync_at_forward = self._sync  # as DDP: no_sync applies to the forward it wraps
        # DDP's rule for buffers (BatchNorm statistics): rank 0's are broadcast at a forward that
        # follows a grad-enabled, synchronizing forward (and at the first), so the first evaluation
        # forward after training sees rank 0's, and further no_grad forwards communicate nothing:
        # ranks may run different numbers of them.
        if self._buffers_stale and self.config.broadcast_buffers and self.buffers and self.world_size > 1:
            self._broadcast_buffers()
        self._buffers_stale = torch.is_grad_enabled() and self._sync
        if self.mixed_precision is not None:  # floating inputs compute in the param dtype, every stage
            args, kwargs = _cast_floats((args, kwargs), self.param_dtype)
        self._detach_sharded_grads()  # the next backward accumulates as before
        self._before_forward()
        try:
            with self.recorder.span("forward", COMPUTE):
                out = self._module(*args, **kwargs)
        except BaseException:
            self._abort_forward()
            raise
        self._after_forward(out)
        first = _first_grad_tensor(out)
        if first is not None:  # the output's gradient is the first thing backward computes
            first.register_hook(self._on_output_grad)
        return out

    def train(self, mode: bool = True) -> "StageEngine":
        self._module.train(mode)
        return self

    def eval(self) -> "StageEngine":
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters. Once a step's gradients are reduced, their ``.grad`` is what
        torch's clipping needs at every stage: the averaged gradient, or at sharded stages a
        :class:`~zerodp.engine.grads.ShardedGrad` of this rank's slice, so that
        ``torch.nn.utils.clip_grad_norm_(engine.parameters(), c)`` clips as ``engine.clip_grad_norm_``."""
        self._attach_sharded_grads()
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        self._attach_sharded_grads()
        return self.module.named_parameters(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Guide §5: inside, backward accumulates gradients locally and communicates nothing.

        ``with engine.no_sync(micro < grad_acc - 1):`` around forward and backward is the usual
        loop; as with DDP, what counts is whether the *forward* ran inside. ``enabled=False`` makes
        it a no-op. (Stage 2 by default still reduces every micro-batch — memory first — unless
        ``reduce_every_microbatch=False``; see :mod:`zerodp.engine.zero2`.)
        """
        previous = self._sync
        self._sync = previous and not enabled
        try:
            yield
        finally:
            self._sync = previous

    def count_tokens(self, n: int | float) -> None:
        """With ``average_by_tokens=True``: add this micro-batch's token count on this rank.

        Guide §2.2: when each rank's loss is the mean over its own tokens and ranks see different
        token counts, plain averaging is biased; rank r's gradient is then weighted by
        n_r / Σ n instead of 1/N, which equals the full-batch token mean. The step's count must be
        complete before its first gradient reduction: the last micro-batch's backward for stages
        0-1, the *first* backward for stage 2 (it reduces every micro-batch), so count all
        micro-batches of the step up front there. The count resets at ``step()``.
        """
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        self._tokens += float(n)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

        The norm covers every gradient of the model. Sharded stages hold disjoint shards, so the
        squared norms of the local shards are summed with one AllReduce (guide §9; guide §12).
        Matches ``torch.nn.utils.clip_grad_norm_``: grads *= min(1, max_norm / (norm + 1e-6)).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: only the 2-norm is supported across shards")
        self._check_not_failed("clip_grad_norm_")
        self._finish_grad_sync()
        grads = [g for g in self._master_grads() if g is not None]
        if grads:
            norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
            sq = torch.stack(norms).square().sum().reshape(1)
        else:
            sq = torch.zeros(1, device=self.device)
        if self.grads_sharded and self.shard_comm.world_size > 1:  # replicas hold the same shards
            sq = self.shard_comm.all_reduce_sum(sq, "grad_norm")
        norm = sq.sqrt()[0]
        coef = torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    def step(self) -> None:
        """Finish gradient sync, update the fp32 master values, publish the new parameters.

        When ``step()`` returns, the model's parameters hold the new values on every rank (stages
        0-2; at stage 3 the shards do, and each unit is gathered when it next runs), so EMA,
        ``model.state_dict()`` or a forward outside the engine see them. With
        ``overlap_param_gather=True`` (stages 1-2) the parameter AllGathers launched by the step
        are waited for only at the next engine forward (or ``engine.module``), overlapping them
        with what happens in between; reading ``model``'s parameters directly before that sees
        the old values. Torch's rule decides what is stepped: a parameter whose gradient is None —
        no rank used it in any backward since ``zero_grad(set_to_none=True)`` — is not touched
        (as with DDP); after ``zero_grad(set_to_none=False)`` the zeros are applied (momentum,
        weight decay); a second ``step()`` without ``zero_grad`` applies the gradients again."""
        self._check_not_failed("step")
        with self.recorder.span("step", COMPUTE):
            self._finish_grad_sync()
            self._unused = self._step_unused()  # collective where parameters may go unused
            if self.guard is not None and self.guard.should_skip(self):  # collective
                self._zero_grad()  # inf/NaN somewhere: apply nothing, on every rank
                self._reset_used()
            else:
                self._optimizer_step()
            if not self.config.overlap_param_gather:
                self._wait_params()  # step() returns with the model's parameters up to date
        self._move(StepState.STEPPED)
        self.last_comm_peak, self._comm_peak = self._comm_peak, 0
        self._tokens = 0.0
        self._token_factor_value = None
        now = self.recorder.clock()
        if self._last_step_end is not None:
            self.last_step_time_s = now - self._last_step_end
        self._last_step_end = now
        self.recorder.next_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients for the next step. ``param.grad`` becomes None; with ``set_to_none``
        (torch's default) the gradient storages are freed as torch frees ``.grad`` tensors: full
        gradients (stages 0-1) until their group's first gradient of the next backward, gradient
        shards (stages 2-3) until the next step's first reduction (guide §12.5 step 6)."""
        if self.step_state is StepState.BACKWARD:  # the last backward raised: drop what it left
            self._abandon_backward()
        self._finish_grad_sync()
        # What the step's gradients held, for stats(): the shards freed here exist again from the
        # next step's first reduction on (model states are what a step holds, guide §8).
        self.last_grad_bytes = measured_bytes({"grads": [t for g in self.groups for t in g.memory()["grads"]]})["grads"]
        self._detach_sharded_grads()
        self._zero_grad(set_to_none)
        if set_to_none:
            self._reset_used()  # torch: every .grad is None; used-flags start again
        self._move(StepState.IDLE)

    def stats(self):
        """Measured bytes per rank by kind, the last step's collectives, exposed comm, step time."""
        return collect_stats(self)

    def export_chrome_trace(self, path: str | os.PathLike, step: int | None = None) -> str | None:
        """Collective: rank 0 writes every rank's events as Chrome-trace JSON (Perfetto-loadable)."""
        events = self.recorder.chrome_events(step)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, events, group=self.group)
        if self.rank != 0:
            return None
        return write_chrome_trace(path, [e for rank_events in gathered for e in rank_events])

    # ---- checkpoint contract ------------------------------------------------------------
    def state_pieces(self) -> list[Piece]:
        """The master values and optimizer states this rank saves: disjoint across ranks, and
        together they cover every element of every parameter (padding excluded)."""
        self._finish_grad_sync()
        pieces = self.master.pieces(ranges=self._owned_range)
        if self.rank == 0:  # buffers: rank 0's values, as broadcast to every rank
            for name, sub, local in self.buffers:
                buf = getattr(sub, local)
                pieces.append(Piece(name, BUFFER, 0, buf.numel(), tuple(buf.shape), buf.detach().reshape(-1)))
        return pieces

    def load_state_pieces(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Fill master values and optimizer states from ``read(name, kind, start, stop)``, then
        publish the parameters (collective for sharded stages). Call ``load_scalar_state`` first."""
        self._finish_grad_sync()
        self._wait_params()
        self.master.load_pieces(read)
        self._publish_params()
        self._wait_params()
        self._load_buffers(read)

    @torch.no_grad()
    def load_frozen_pieces(self, read: Callable[[str, int, int], torch.Tensor], names: set[str]) -> set[str]:
        """Frozen parameters that live in a flat group's fp32 master (stage 3 keeps them in its
        units' shards, outside the optimizer's pieces): fill this rank's part of each from
        ``read(name, start, stop)`` (flattened elements) for those in ``names``;
        ``load_state_pieces`` then publishes them. Returns the names so handled."""
        done: set[str] = set()
        for g in self.groups:
            if FROZEN not in g.groups:
                continue
            lo = g.master_start
            hi = lo + g.master.numel()
            for slot, grp in zip(g.layout.slots, g.groups):
                if grp != FROZEN or slot.name not in names:
                    continue
                done.add(slot.name)
                a, b = max(slot.offset, lo), min(slot.stop, hi)
                if a < b:
                    g.master[a - lo:b - lo].copy_(read(slot.name, a - slot.offset, b - slot.offset).reshape(-1))
        return done

    @torch.no_grad()
    def _load_buffers(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Every rank reads every buffer (checkpoints written before buffers were saved hold
        none: the model's buffers are then left as they are, with a warning)."""
        missing = []
        for name, sub, local in self.buffers:
            buf = getattr(sub, local)
            try:
                src = read(name, BUFFER, 0, buf.numel())
            except Exception:  # noqa: BLE001 - absent from this checkpoint
                missing.append(name)
                continue
            buf.copy_(src.reshape(buf.shape))
        if missing:
            warnings.warn(f"the checkpoint holds no values for the buffers {missing}; they keep "
                          "their current values", stacklevel=3)

    def scalar_state(self) -> dict:
        """Collective: the optimizer's scalars (per parameter and per group) from every rank."""
        mine = self.master.scalar_state()
        if self.world_size > 1 and self.stage > 0:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, mine, group=self.group)
            for other in gathered:
                for name, scalars in other.get("params", {}).items():
                    mine["params"].setdefault(name, scalars)
                for g, scalars in enumerate(other["groups"]):
                    if scalars and not mine["groups"][g]:
                        mine["groups"][g] = scalars
                mine["kinds"] = sorted(set(mine["kinds"]) | set(other["kinds"]))
        return {"stage": self.stage, **mine}

    def load_scalar_state(self, scalars: dict) -> None:
        self.master.load_scalar_state(scalars)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets every parameter as an fp32 tensor (from the master) and
        every persistent buffer (rank 0's values; floating-point ones as fp32)."""
        self._finish_grad_sync()
        out = self._gather_full([t.tensor for t in self.master.targets], frozen_from_params=True)
        for name, p in self._module.named_parameters():  # frozen parameters outside the buffers
            if name not in out and p.numel() > 0:
                out[name] = p.detach().float().clone()
        out.update(self._buffer_dict())
        return out

    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the averaged gradient the next ``step`` would apply, as
        fp32 tensors by parameter name (gathered from the shards; for inspection and tests)."""
        self._finish_grad_sync()
        grads = self._master_grads()
        return self._gather_full([torch.zeros_like(t.tensor) if g is None else g
                                  for t, g in zip(self.master.targets, grads)])

    # ---- standard state dicts, keyed by the model's own names (zerodp.engine.state_dict) ----
    def state_dict(self, **options) -> dict[str, torch.Tensor]:
        """Collective: the model's parameters and persistent buffers by name, like
        ``module.state_dict()`` (see :func:`zerodp.engine.state_dict.state_dict` for options)."""
        return standard_state.state_dict(self, **options)

    def load_state_dict(self, state: dict[str, torch.Tensor], **options):
        """Collective: load parameters and buffers by name (each rank copies what it holds)."""
        return standard_state.load_state_dict(self, state, **options)

    def optimizer_state_dict(self, **options) -> dict:
        """Collective: the optimizer's state keyed by parameter name, in the shape
        ``torch.optim.Optimizer.state_dict()`` uses."""
        return standard_state.optimizer_state_dict(self, **options)

    def load_optimizer_state_dict(self, state: dict, **options) -> None:
        """Collective: load an :meth:`optimizer_state_dict` saved at any stage and world size."""
        return standard_state.load_optimizer_state_dict(self, state, **options)

    @torch.no_grad()
    def _buffer_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, sub, local in self.buffers:
            buf = getattr(sub, local).detach().clone()
            if self.world_size > 1:
                self._broadcast_from_rank0([buf])
            out[name] = buf.float() if buf.is_floating_point() else buf
        return out

    def _gather_full(self, values: list[torch.Tensor], frozen_from_params: bool = False) -> dict[str, torch.Tensor]:
        """Per-target values (aligned with ``master.targets``) → full tensors by parameter name.

        Each flat group is rebuilt from what this rank holds — the whole buffer (stage 0) or its
        shard (stages 1-3), gathered — iterating every group in the same order on every rank,
        whether or not this rank's part holds a target."""
        out: dict[str, torch.Tensor] = {}
        by_group: dict[int, list[int]] = {}
        for i, t in enumerate(self.master.targets):
            by_group.setdefault(id(t.layout), []).append(i)
        sharded = self.policy.shard_master
        for g in self.groups:
            layout = g.layout
            lo, hi = g.shard_range if sharded else (0, layout.padded_numel)
            local = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
            for i in by_group.get(id(layout), []):
                t = self.master.targets[i]
                local[t.flat_start - lo:t.flat_start - lo + t.tensor.numel()].copy_(values[i])
            if frozen_from_params:  # frozen parameters of a unit live in its master shard only
                for slot, grp in zip(layout.slots, g.groups):
                    a, b = max(slot.offset, lo), min(slot.stop, hi)
                    if grp == FROZEN and a < b:
                        local[a - lo:b - lo].copy_(g.master[a - lo:b - lo])
            if sharded and g.comm.world_size > 1:
                flat = torch.empty(layout.padded_numel, dtype=torch.float32, device=self.device)
                g.comm.all_gather(flat, local, "gather_full", async_op=False)
            else:
                flat = local
            for slot in layout.slots:
                out[slot.name] = flat[slot.offset:slot.stop].view(slot.shape).clone()
        return out

    def layout(self) -> list[dict]:
        """The flat groups as data: which parameter sits at which offset, padding, owners."""
        out = []
        for i, g in enumerate(self.groups):
            d = g.layout.to_dict()
            trainable = [grp for grp in g.groups if grp != FROZEN]
            d.update(index=i, label=g.label, group=trainable[0] if trainable else FROZEN, groups=list(g.groups),
                     options=self.group_options[trainable[0]] if trainable else None,
                     dtype=str(g.param_dtype), sharded=self.policy.shard_master,
                     owners=[list(g.layout.shard_range(r)) for r in range(g.comm.world_size)])
            out.append(d)
        return out

    # ---- helpers for subclasses ---------------------------------------------------------
    def _build_master(self, targets: list[Target]) -> MasterOptimizer:
        return MasterOptimizer(self._factory, targets, self.group_options, self.config.elementwise_optimizer)

    def _targets(self, tensor: torch.Tensor, layout: FlatLayout, flat_start: int) -> list[Target]:
        """Optimizer targets over a held range of a flat buffer, in cache-sized chunks on CPU (see
        :func:`zerodp.engine.master.param_targets`): per parameter where a parameter may go unused
        in a step (stage 3, or ``find_unused_parameters=True``), so that the optimizer can skip it
        whole; otherwise across parameters, fewer tensors for the optimizer's per-tensor work."""
        chunk = CPU_OPTIMIZER_CHUNK if self.device.type == "cpu" else None
        per_param = self.stage == 3 or self.config.find_unused_parameters
        return param_targets(tensor, layout, flat_start, lambda name: self._group_by_name.get(name, -1), chunk,
                             per_param=per_param)

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """DDP's ``broadcast_buffers=True``: at each forward every rank takes rank 0's buffers
        (e.g. BatchNorm's running statistics), one flat broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, sub, local in self.buffers:
            buf = getattr(sub, local)
            by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs]) if len(bufs) > 1 else bufs[0].reshape(-1).clone()
            self._broadcast_from_rank0([flat])
            offset = 0
            for b in bufs:
                new = flat[offset:offset + b.numel()].view_as(b)
                if not torch.equal(b, new):  # leave unchanged buffers alone: a graph may hold them
                    b.copy_(new)
                offset += b.numel()

    # ---- parameters no rank used (DDP's find_unused_parameters semantics) --------------------
    def _local_used(self) -> list[bool] | None:
        """Per trainable parameter (``named_params`` order): did this rank compute a gradient
        for it in any backward of this step? None when every parameter must be used (an unused
        one is an error raised at backward), so no exchange is needed."""
        return None

    def _reset_used(self) -> None:
        """Start a new step's record of used parameters."""

    def _step_unused(self) -> set[str]:
        """Names of the parameters no rank used this step (one small AllReduce, MAX = OR)."""
        used = self._local_used()
        if used is None:
            return set()
        flags = torch.tensor([1.0 if u else 0.0 for u in used], device=self.device)
        if self.world_size > 1:
            self.comm.all_reduce_max(flags, "used_params")
        return {n for (n, _), f in zip(self.named_params, flags.tolist()) if f == 0.0}

    def _check_consistency(self, description: dict) -> None:
        """Start-up check: every rank must describe the same model and the same flat layout.

        Gathers each rank's description (names, shapes, dtypes, buckets, stage, world) and
        compares it with rank 0's on every rank, so that all ranks raise the same clear error
        instead of hanging in a mismatched collective or silently mixing gradients.
        """
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, description, group=self.group)
        for r, other in enumerate(gathered):
            diff = describe_difference(gathered[0], other)
            if diff:
                raise RuntimeError(
                    f"ranks disagree on the model or its layout (rank 0 vs rank {r}): {diff}. Every "
                    "rank must build the same model (same parameter names, shapes, dtypes, "
                    "requires_grad) with the same engine options before parallelize()"
                )

    def _start_clock(self) -> None:
        """Align trace time zero across ranks (call right after a collective such as the check)."""
        self.recorder.t0 = self.recorder.clock()
        self._last_step_end = None

    @torch.no_grad()
    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """DDP's start: every replica begins with rank 0's values."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in tensors:
            dist.broadcast(t, src=src, group=self.group)

    def _backward_started(self) -> None:
        """Call from gradient hooks: arms ``_on_backward_end`` once per backward pass."""
        if self.step_state is not StepState.BACKWARD:
            self._move(StepState.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _token_factor(self) -> float | None:
        """Guide §2.2: factor to pre-multiply local gradients with before a mean reduction, so that
        the mean over ranks becomes Σ_r n_r g_r / Σ_r n_r. None when averaging plainly."""
        if not self.config.average_by_tokens:
            return None
        if self._token_factor_value is None:
            if self._tokens <= 0:
                raise RuntimeError(
                    "average_by_tokens=True but this rank counted no tokens this step: call "
                    "engine.count_tokens(n) for every micro-batch before its backward"
                )
            total = self.comm.all_reduce_sum(torch.tensor([self._tokens], dtype=torch.float64,
                                                          device=self.device), "token_count")
            self._token_factor_value = self._tokens * self.world_size / float(total[0])
        return self._token_factor_value

    # ---- internal machinery ---------------------------------------------------------------
    def _on_output_grad(self, grad):
        if self._backward_event is None:
            self._backward_event = self.recorder.begin("backward", COMPUTE)
        return None

    def _backward_end(self) -> None:
        self._move(StepState.ACCUMULATED)
        if self._backward_event is not None:
            self.recorder.end(self._backward_event)
            self._backward_event = None
        self._on_backward_end()

    # ---- the step's state: checked transitions, a raised backward, changed requires_grad ----------
    def _move(self, to: StepState) -> None:
        if to not in STEP_MOVES[self.step_state]:
            raise RuntimeError(f"engine state {self.step_state.value} -> {to.value} is not a step of the "
                               "training loop (zerodp internal error: please report it)")
        self.step_state = to

    def _check_not_failed(self, call: str) -> None:
        """A backward that raised before its end (anomaly mode, an OOM caught by the script) left
        this step's gradients partial: say so, and what to call, instead of training on them."""
        if self.step_state is StepState.BACKWARD:
            raise RuntimeError(
                f"engine.{call}(): the last backward raised before it finished, so this step's gradients are "
                "partial on this rank; call optimizer.zero_grad() (or engine.zero_grad()) to drop them, then run "
                "the step again")

    def _abandon_backward(self) -> None:
        """zero_grad after a raised backward: wait for what it launched, reset every group's
        backward state, and leave the gradients to ``_zero_grad`` (every rank raised alike)."""
        self._inflight.wait_all()
        if self._backward_event is not None:
            self.recorder.end(self._backward_event)
            self._backward_event = None
        for g in self.groups:
            g.reset_backward()
        self._on_backward_abandoned()
        self._move(StepState.IDLE)

    def _attach_sharded_grads(self) -> None:
        """Reduced gradients that no module parameter holds (a shard of its own, stages 1-3) go on
        the parameters as :class:`ShardedGrad` s until the next forward or ``zero_grad``. Local:
        nothing is attached while a group still holds unreduced gradients (that would need a
        collective, and ``parameters()`` is no collective)."""
        if self.step_state not in (StepState.ACCUMULATED, StepState.STEPPED) or not self.policy.shard_master \
                or self._grads_under_sharded or any(g.has_local for g in self.groups):
            return
        self._inflight.wait_all()
        for g in self.groups:
            if g._shard_in_full or g.grad_state not in (GradState.REDUCED, GradState.ZEROS):
                continue
            lo, hi = g.shard_range
            for i in g.trainable:
                slot, p = g.layout.slots[i], g.params[i]
                a, b = max(slot.offset, lo), min(slot.stop, hi)
                local = g.grad_shard[a - lo:b - lo] if a < b else g.grad_shard[:0]
                self._grads_under_sharded[id(p)] = p.grad
                p.grad = ShardedGrad(p, local, g.comm)

    def _detach_sharded_grads(self) -> None:
        if not self._grads_under_sharded:
            return
        for g in self.groups:
            for p in g.trainable_params:
                if id(p) in self._grads_under_sharded:
                    p.grad = self._grads_under_sharded[id(p)]
        self._grads_under_sharded = {}

    def _check_requires_grad(self) -> None:
        """A parameter frozen or unfrozen after ``parallelize``: its flat group and the optimizer
        were planned without it (or with it), so refuse in one line rather than train it wrong."""
        for name, p in self._module.named_parameters():
            planned = name in self._group_by_name
            if p.requires_grad != planned:
                raise RuntimeError(
                    f"parameter {name!r} was {'trainable' if planned else 'frozen'} when parallelize built the engine "
                    f"and is {'trainable' if p.requires_grad else 'frozen'} now: the engine's buckets and optimizer "
                    "are planned at parallelize. Set requires_grad before parallelize (a parameter to train later "
                    "can stay trainable in a param group with lr=0 until then), or parallelize the model again")

    def _optimizer_step(self) -> None:
        """Attach fp32 gradients to the master targets, step the stock optimizer, detach, then
        ``_publish_params``.

        Gradients kept in bf16 are cast to fp32 for the optimizer: all at once that is 4 bytes per
        element of the whole shard alive during ``optimizer.step()`` (4Ψ/N at stage 3, more than
        the gradient shard itself). So the step runs over batches of targets of at most
        ``STEP_BATCH_BYTES`` of fp32 gradients, one ``optimizer.step()`` each: the update of an
        elementwise optimizer is per element, so this is bitwise the single step (targets without
        a gradient are skipped by each call). Only when the optimizer has step hooks (which would
        then run once per batch) is it done in one call."""
        grads = self._master_grads()
        batches = [range(len(grads))]
        cast = any(g is not None and g.dtype != torch.float32 for g in grads)
        if cast and not _has_step_hooks(self.master.optimizer):
            batches, start, size = [], 0, 0
            for i, g in enumerate(grads):
                size += 0 if g is None else 4 * g.numel()
                if size >= STEP_BATCH_BYTES:
                    batches.append(range(start, i + 1))
                    start, size = i + 1, 0
            batches.append(range(start, len(grads)))
        for batch in batches:
            chosen = set(batch)
            self.master.attach_grads([g if i in chosen else None for i, g in enumerate(grads)], self._unused)
            self.master.step()
            self.master.zero_grad()
        self._publish_params()

    def _owned_range(self, target: Target) -> tuple[int, int]:
        """Flat range of ``target.layout`` whose state this rank saves: slice r of stage 0's
        replicas, everything a sharded rank holds — on the first replica only under hybrid
        sharding (the others hold the same shards), so that saved pieces are disjoint."""
        if not self.policy.shard_master:
            return target.layout.shard_range(self.rank)
        if self.replica_comm is not None and self.replica_comm.rank > 0:
            return target.flat_start, target.flat_start
        return target.flat_start, target.flat_start + target.tensor.numel()

    # ---- flat groups: what every stage does the same way (guide §12) ------------------------
    def _set_dtypes(self, param_dtype: torch.dtype) -> None:
        """The compute dtype, the dtype gradients travel in (``reduce_dtype``), and the one they
        are accumulated in: fp32 when parameters are fp32, with ``fp32_grad_accum``, or when
        gradients travel in fp32 anyway (guide §1, §9)."""
        if not param_dtype.is_floating_point:
            raise ValueError(f"parameters of dtype {param_dtype} cannot be trained")
        mp = self.mixed_precision
        self.param_dtype = param_dtype
        self.reduce_dtype = mp.comm_dtype if mp else param_dtype
        fp32 = torch.float32
        self.accum_dtype = fp32 if fp32 in (param_dtype, self.reduce_dtype) or (mp and mp.fp32_grad_accum) \
            else self.reduce_dtype

    def _shard_size(self) -> int:
        """Ranks per shard group (guide §14): ``config.shard_size``, else one node (torchrun's
        ``LOCAL_WORLD_SIZE``) when it divides the world, else every rank. Stage 0 shards nothing."""
        g = self.config.shard_size
        if self.stage == 0:
            return self.world_size
        if g is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            g = int(local) if local.isdigit() and int(local) > 0 and self.world_size % int(local) == 0 \
                else self.world_size
        if self.world_size % g:
            raise ValueError(f"shard_size={g} does not divide the {self.world_size} ranks: use a divisor of the "
                             "world size (usually the GPUs per node)")
        return g

    def _new_group(self, index: int, label: str, entries: list[tuple[str, nn.Parameter, int]]) -> FlatGroup:
        quant = self.config.quant_block
        group = FlatGroup(index, label, entries, self.policy, self.shard_comm, param_dtype=self.param_dtype,
                         reduce_dtype=self.reduce_dtype, accum_dtype=self.accum_dtype, replicas=self.replica_comm,
                         quant_params=quant if self.config.quantize_params else 0,
                         quant_grads=quant if self.config.quantize_grads else 0)
        group.pool = self._grad_pool
        return group

    @torch.no_grad()
    def _init_groups(self, extra_broadcast: list[torch.Tensor] = ()) -> None:
        """Fill every group from the module's values — rank 0's, broadcast as DDP does at
        construction — build its gradient buffers, and the optimizer over the master tensors."""
        for g in self.groups:
            if self.deferred:
                self._materialize(g)
            values = torch.zeros(g.layout.padded_numel, dtype=torch.float32, device=self.device)
            for slot, p in zip(g.layout.slots, g.params):
                values[slot.offset:slot.stop].copy_(p.detach().reshape(-1))
            self._broadcast_from_rank0([values])
            g.init_values(values)
            g.init_grads()
            del values
        self._broadcast_from_rank0(list(extra_broadcast))
        targets: list[Target] = []
        self._target_slices: list[tuple[FlatGroup, int, int]] = []  # the gradient each target reads
        for g in self.groups:
            for t in self._targets(g.master, g.layout, g.master_start):
                lo = t.flat_start - g.master_start
                targets.append(t)
                self._target_slices.append((g, lo, lo + t.tensor.numel()))
        self.master = self._build_master(targets)
        position = {n: i for i, (n, _) in enumerate(self.named_params)}
        # Per group, per trainable parameter: its index in named_params (used-flags at step()).
        self._used_index = [[position[g.names[i]] for i in g.trainable] for g in self.groups]
        self._step_used = [False] * len(self.named_params)

    def _materialize(self, g: FlatGroup) -> None:
        """A model built on the meta device: give ``g``'s parameters values (stage 3, per unit)."""

    def _record_used(self) -> None:
        """End of a backward: note which parameters got a gradient (for the step's used-flags)."""
        used = self._step_used
        for g, index in zip(self.groups, self._used_index):
            for fired, i in zip(g.bwd.fired, index):
                if fired:
                    used[i] = True

    def _reset_used(self) -> None:
        self._step_used = [False] * len(self.named_params)

    def _bound_in_flight(self, g: FlatGroup) -> None:
        """Before a group allocates gradients for a reduction: wait for the oldest collectives
        while ``MAX_REDUCE_IN_FLIGHT`` are in flight, so that transient gradient buffers are
        bounded by the groups in flight, not by the model (guide §9.2)."""
        if not g.holds_grads:
            while len(self._inflight) >= MAX_REDUCE_IN_FLIGHT:
                self._inflight.wait_oldest()

    def _launch_reduce(self, g: FlatGroup) -> None:
        self._inflight.add(*g.reduce(self._token_factor()))
        held = (sum(t.untyped_storage().nbytes() for g in self.groups for t in g.comm_tensors())
                + sum(st.nbytes() for st in self._grad_pool.free))
        self._comm_peak = max(self._comm_peak, held)

    def _finish_grad_sync(self) -> None:
        """Wait for every gradient collective; groups still holding local gradients of a
        ``no_sync`` backward (the step's last micro-batch ran inside it) are reduced now, on every
        rank alike, at every stage — stage 0 included, where DDP would step each replica on its own
        gradients and let them drift apart. Then the released gradient storages are freed: the
        optimizer step creates its states next, and nothing reduces again before the next backward."""
        self._inflight.wait_all()
        pending = [g for g in self.groups if g.has_local]
        for g in pending:
            self._launch_reduce(g)
        self._inflight.wait_all()
        self._grad_pool.clear()

    def _master_grads(self) -> list[torch.Tensor | None]:
        grads = {id(g): g.grad() for g in self.groups}
        return [None if grads[id(g)] is None else grads[id(g)][lo:hi] for g, lo, hi in self._target_slices]

    def _publish_params(self) -> None:
        """After the step, the compute parameters ← the master, in the order the next forward
        needs them (the last bucket holds the first layers; guide §9.1 step 5)."""
        for g in reversed(self.groups):
            pending = g.publish()
            if pending is not None:
                self._param_gathers.add(pending)

    def _wait_params(self) -> None:
        self._param_gathers.wait_all()

    def _zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.zero_grad(set_to_none)

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for g in self.groups:
            for kind, tensors in g.memory().items():
                out.setdefault(kind, []).extend(tensors)
        out.setdefault("comm_buffers", []).extend(torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
                                                  for st in self._grad_pool.free)
        return out

    # ---- defaults for optional hooks ----------------------------------------------------------
    def _before_forward(self) -> None:
        self._wait_params()

    def _after_forward(self, out: Any) -> None:
        pass

    def _on_backward_end(self) -> None:
        pass

    def _on_backward_abandoned(self) -> None:
        """A backward raised: reset what the subclass keeps for the backward in flight."""

    def _abort_forward(self) -> None:
        """The model's forward raised: reset what the subclass keeps for the forward in flight."""

    def optimizer_index_names(self) -> list[str]:
        """Trainable parameter names in torch's optimizer index order (:mod:`zerodp.engine.optim`)."""
        rule = self.config.param_groups
        names = [n for n, _ in self.named_params]
        if isinstance(rule, UserGroups):
            by_id = {id(p): n for n, p in self.named_params}
            return [by_id[i] for i in rule.order if i in by_id]
        return [n for g in range(len(self.group_options)) for n, gi in zip(names, self.param_group_of) if gi == g]


def _rebuilt_optimizer_step(optimizer, args, kwargs):
    """Step pre-hook on an optimizer given to ``parallelize``: it was rebuilt over the engine's master."""
    raise RuntimeError(
        f"this {type(optimizer).__name__} was given to zerodp.parallelize, which rebuilt it over the engine's fp32 "
        "master: step the engine's instead (optimizer = engine.optimizer after parallelize)")


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in a nest, cast to ``dtype`` (mixed precision's inputs, guide §1)."""
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, x)


def grad_hook(engine: "StageEngine", method: str, group: int, j: int) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of trainable parameter ``j`` of ``engine.groups[group]``:
    calls ``engine.<method>(that group, j, param)``. It holds the engine by a weak reference and
    the group by its index: a parameter's hooks are held from C++, where Python's garbage collector
    cannot see a cycle back through them, so a hook holding the engine or a group would keep a
    deleted engine and its flat buffers alive for the life of the process."""
    ref = weakref.ref(engine)

    def hook(param: nn.Parameter) -> None:
        eng = ref()
        if eng is not None:
            getattr(eng, method)(eng.groups[group], j, param)
    return hook


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs hooks (its own or torch's global ones)."""
    from torch.optim import optimizer as torch_optimizer

    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor that requires grad in a nest of outputs (torch.utils._pytree's leaves)."""
    return next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
