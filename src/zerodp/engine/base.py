"""What every stage of the engine shares: the public face of :class:`StageEngine`.

Guide §9: stages 0-3 run the same training step — forward, backward with gradient communication,
an optimizer step on fp32 master values — and differ only in *what* each rank keeps and *which*
collectives move it (guide §12.2, "stages as policies"). Every stage holds its parameters in
:class:`~zerodp.engine.group.FlatGroup` s (``self.groups``: buckets at stages 0-2, units at stage
3) under one :class:`~zerodp.engine.config.Policy`. :class:`StageEngine` is this file — the
public API a training script calls (``engine(x, y)``, ``no_sync``,
``require_backward_grad_sync``, ``clip_grad_norm_``, ``step``, ``zero_grad``, ``optimizer``,
``parameters``, the state dicts, ``stats``, ``export_chrome_trace``) and the process groups
(hybrid sharding, guide §14) — holding its parts, each an object with its own constructor
(guide §12.8), read in this order:

- ``engine.construction`` (:class:`~zerodp.engine.construct.Construction`): building the flat
  groups once, at ``parallelize``;
- ``engine.machine`` (:class:`~zerodp.engine.step.StepMachine`): the step's state and everything
  that moves it — backward start and end, the queue of collectives in flight, the gradient sync,
  the master step, publishing, zeroing, torch's ``.grad is None`` rule;
- ``engine.checkpoint`` (:class:`~zerodp.engine.state_dict.CheckpointContract`): checkpoint pieces,
  scalars, full tensors, the layout as data;
- ``engine.hooks``, the stage's: :class:`~zerodp.engine.reducer.BucketHooks` (stages 0-2) or
  :class:`~zerodp.engine.fsdp.UnitHooks` (stage 3), with the state of the forward and backward in
  flight; the machine calls their ``backward_end``, ``backward_abandoned`` and ``abort_forward``.

Constructor (every stage)::

    StageEngine(module, optimizer_factory, config: EngineConfig,
                units: list[nn.Module] | None = None, group: ProcessGroup | None = None)

``optimizer_factory(param_groups) -> torch.optim.Optimizer`` builds a stock, elementwise
optimizer over the engine's fp32 master tensors (see :mod:`zerodp.engine.master`). ``units`` is
used by stage 3 only (FSDP units, guide §10.3); stages 0-2 ignore it.

A stage subclass sets ``stage``, then in ``__init__`` (after ``super().__init__``, which resolved
``self.dtypes`` and ``self.optimizer_plan``) builds ``self.groups`` with ``construction.new_group``,
runs ``construction.check_consistency`` and ``construction.init_groups``, builds its ``hooks``
(which call ``GradBuffers.take`` and ``machine.launch_reduce``) and calls
``finish_construction()`` last (the optimizer part, the machine and the DiLoCo outer loop bound
to the groups); it defines ``_local_used`` and ``_step_unused`` (torch's ``.grad is None`` rule at
``step()``): :mod:`zerodp.engine.reducer` (stages 0-2) and :mod:`zerodp.engine.fsdp` (stage 3) are
the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine import foreign
from zerodp.engine.adopt import Adoption
from zerodp.engine.comm import Collectives
from zerodp.engine.control import (CHROME_TRACE, CLIP_GRAD_NORM, EVAL_FORWARD, FULL_STATE_DICT, OPTIMIZER_STATE_DICT,
                                   STATE_DICT, Control, user_call)
from zerodp.engine.compiled import activate, host_only
from zerodp.engine.config import Dtypes, EngineConfig, Policy
from zerodp.engine.construct import Construction, shard_group_size
from zerodp.engine.deferred import init_device
from zerodp.engine.devices import check_devices
from zerodp.engine.group import FlatGroup
from zerodp.engine.guard import NonFiniteGuard
from zerodp.engine.master import MasterOptimizer, build_master
from zerodp.engine.nest import cast_floats, grad_tensors
from zerodp.engine.optim import EngineOptimizer
from zerodp.engine.optimizer_plan import OptimizerFactory, from_built, is_built, plan_optimizer
from zerodp.engine.outer import OuterLoop, outer_shard_size
from zerodp.engine.state_dict import (BUFFER, CheckpointContract, load_optimizer_state_dict,  # noqa: F401 - BUFFER: hf reads it here
                                     load_state_dict, optimizer_state_dict, state_dict)
from zerodp.engine.stats import collect_stats, measured_bytes
from zerodp.engine.states import StepState
from zerodp.engine.step import StepMachine
from zerodp.engine.trace import COMPUTE, Recorder, write_chrome_trace

_NORM_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


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


class StageEngine(nn.Module):
    """Base class of the stage engines; see the module docstring for the subclass contract.

    An ``nn.Module``, as DDP's wrapper is (docs/porting.md): it goes wherever the script put the
    DDP-wrapped model — a child module of a task object, ``isinstance(model, nn.Module)``, forward
    hooks, ``model.modules()`` — with the user's model as its child ``module``. What would move or
    cast the parameters in place (``.to()``, ``.half()``) is refused: they are views into the
    engine's flat buffers (:meth:`_apply`)."""

    stage: ClassVar[int] = -1
    #: True when ``config.bucket_mb`` was chosen by ``bucket_mb="auto"`` (stages 0-2, guide §4).
    bucket_auto: bool = False

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, config: EngineConfig,
                 units: list[nn.Module] | None = None, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: launch with torchrun (which sets RANK and "
                "WORLD_SIZE) and call torch.distributed.init_process_group(), or use "
                "zerodp.spawn.run_local for local ranks"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"parallelize expects a torch.nn.Module, got {type(module).__name__}")
        activate()  # the hooks' bookkeeping stays out of compiled graphs (zerodp.engine.compiled)
        adopt = optimizer_factory is None  # the script builds its optimizer after the wrap (zerodp.engine.adopt)
        if adopt:
            optimizer_factory = _stand_in_optimizer
        given = []
        if is_built(optimizer_factory):  # the script's configure_optimizers(): one optimizer, or a list
            if config.param_groups is not None:
                raise ValueError("parallelize got a built optimizer and param_groups: the optimizer's own param "
                                 "groups say which options each parameter gets; pass one of the two")
            built = optimizer_factory
            single = isinstance(built, torch.optim.Optimizer)  # taken over at construction (Adoption.take_given)
            optimizer_factory, user_groups = from_built(built, module, with_state=single)
            config = dataclasses.replace(config, param_groups=user_groups)
            given = [built] if single else list(built)
            if not single:
                for opt in given:
                    opt.register_step_pre_hook(_rebuilt_optimizer_step)
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
        # the step's state and what moves it (zerodp.engine.step); bound to the groups once built
        self.shard_size = shard_group_size(config.shard_size, self.policy, self.world_size)
        if config.outer is not None and config.replicas is None:  # DiLoCo (guide §16): replica groups that
            # talk only in its syncs (with replicas=, the groups are jobs of their own: this job is one)
            self.shard_size = outer_shard_size(config.outer, self.world_size, self.shard_size, self.stage,
                                               config.shard_size)
        self.shard_comm = self.comm  # where parameters and gradients are sharded
        replicas = None
        if self.shard_size < self.world_size:
            shard_pg, replica_pg = hybrid_groups(self.world_size, self.shard_size, group)
            self.shard_comm = Collectives(self.recorder, shard_pg, leg="intra", timeout_s=timeout_s)
            replicas = Collectives(self.recorder, replica_pg, leg="inter", timeout_s=timeout_s)
            self.comm.leg = "world"  # control values (flags, token counts) cross every rank
        self.control = Control(self.recorder, group, config.timeout_s, (self.comm, self.shard_comm, replicas))
        # Hybrid sharding: across the replicas. With the outer loop the inner step is plain ZeRO
        # inside the shard group (no replica reduction); only the outer loop's syncs cross the
        # groups (zerodp.engine.outer).
        self.replica_comm: Collectives | None = replicas if config.outer is None else None
        across = replicas  # what the outer loop's syncs cross
        if config.replicas is not None:  # each replica group a job of its own (zerodp.ft): torchft's groups,
            across = config.replicas.bind(self.recorder, comm=self.comm, shard=self.shard_comm, outer=config.outer)
            if config.outer is None:  # every step's gradients; with DiLoCo only its syncs
                self.replica_comm = across
        self.outer: OuterLoop | None = None if config.outer is None else OuterLoop(
            config.outer, stage=self.stage, shard=self.shard_comm, replicas=across)
        # the step's state and what moves it (zerodp.engine.step); bound to the groups once built.
        # Its token counts (average_by_tokens) cross the ranks a gradient is averaged over: the
        # shard group under the outer loop, every rank otherwise.
        averaged = (self.shard_comm, self.shard_size) if config.outer is not None else (self.comm, self.world_size)
        self.machine = StepMachine(self.recorder, *averaged, policy=self.policy, device=self.device,
                                   average_by_tokens=config.average_by_tokens)
        # what a rank waiting in the step's collectives runs to serve a call another rank makes alone
        this = weakref.ref(self)  # no cycle through the control: `del engine` frees it
        self.control.servers = {STATE_DICT: lambda: this().state_dict(),
                                OPTIMIZER_STATE_DICT: lambda: this().optimizer_state_dict(),
                                FULL_STATE_DICT: lambda: this().full_state_dict(),
                                EVAL_FORWARD: lambda: this().hooks.serve_evaluation()}
        self.groups: list[FlatGroup] = []  # the flat groups: buckets (stages 0-2) or units (stage 3)
        self.last_comm_peak = 0
        self.last_grad_bytes = 0
        self._modules["module"] = module  # the child, as DDP's: named_modules(), apply(), a parent's parameters()
        self.__dict__["_module"] = module  # the same model, read without the wait of the property below
        self.register_load_state_dict_post_hook(_restore_child)
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no parameters with requires_grad=True: nothing to train")
        _check_sparse(module, self.stage)
        # The mixed-precision policy asked for, resolved once: every part reads it (guide §1, §9)
        self.dtypes = Dtypes.of(config, [p for _, p in self.named_params])
        # What the optimizer is, where it runs, each parameter's group: decided once (guide §12.3)
        self.optimizer_plan = plan_optimizer(optimizer_factory, self.named_params, config.param_groups, self.device,
                                             self.policy.shard_master, config.elementwise_optimizer,
                                             config.optimizer_layout)
        self.state_buffers = persistent_buffers(module)  # (fqn, owner, local name) of each persistent buffer
        # building the flat groups, once (zerodp.engine.construct)
        self.construction = Construction(module, self.named_params, config, self.policy, group=group,
                                         device=self.device, deferred=self.deferred, comm=self.comm,
                                         shard_comm=self.shard_comm, replica_comm=self.replica_comm,
                                         control=self.control, grad_pool=self.machine.grad_pool,
                                         state_buffers=self.state_buffers)
        # pieces, scalars, full tensors, the layout as data (zerodp.engine.state_dict)
        self.checkpoint = CheckpointContract(module, self.named_params, stage=self.stage, policy=self.policy,
                                             dtypes=self.dtypes, device=self.device, control=self.control,
                                             shard_comm=self.shard_comm, replica_comm=self.replica_comm,
                                             machine=self.machine, outer=self.outer, construction=self.construction,
                                             state_buffers=self.state_buffers, take_values=self.take_module_values)
        self._buffers_stale = True  # DDP's require_forward_param_sync (see forward)
        self._facade: EngineOptimizer | None = None
        self._last_step_end: float | None = None
        self.last_step_time_s: float | None = None
        # Non-finite gradients: skip the step on every rank alike (see zerodp.engine.guard).
        skips = getattr(config, "max_nonfinite_skips", None)
        self.guard = None if skips is None else NonFiniteGuard(skips)
        self.adoption = Adoption(module, self, pending=adopt, given=given)

    def finish_construction(self) -> None:
        """The stage built its groups and hooks (each stage calls this last): the optimizer part
        over every group's master, from the optimizer plan (guide §12.3,
        :func:`zerodp.engine.master.build_master`); the step machine and the DiLoCo outer loop
        (guide §16) bound to them; the optimizer given to ``parallelize`` becomes the engine's, with
        any state it loaded (:meth:`Adoption.take_given`); trace time zero aligned across ranks
        (right after a collective such as the start-up check)."""
        self.build_master(per_param=False)
        self.machine.bind(self.groups, self.hooks, list(self.optimizer_plan.names), self.dtypes.master)
        if self.outer is not None:
            self.outer.bind(self.groups, self.machine.param_gathers, self.dtypes.master)
        self.adoption.take_given(self)
        self.recorder.t0 = self.recorder.clock()
        self._last_step_end = None

    def build_master(self, per_param: bool) -> None:
        """The optimizer part over every group's master (``per_param``: one target per parameter,
        for an optimizer adopted after the wrap); the step machine steps it."""
        plan = self.optimizer_plan
        self.optimizer_plan = dataclasses.replace(plan, built=None)  # the stand-in build is pointed at the master once
        per_param = per_param or self.policy.shard_params or self.config.find_unused_parameters
        self.machine.master = build_master(plan, self.groups, self.policy, self.shard_comm, self.dtypes.master,
                                           self.device, per_param=per_param,
                                           declared_elementwise=self.config.elementwise_optimizer)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer the script built over the module's parameters after the wrap
        (:mod:`zerodp.engine.adopt`): its class, defaults and param groups over the master, one
        target per parameter (a bucket may mix its groups), the engine's optimizer from now on."""
        self.optimizer_plan = self.optimizer_plan.adopted(optimizer, self._module, self.named_params, self.groups,
                                                          self.policy, self.config)
        self.config = dataclasses.replace(self.config, param_groups=self.optimizer_plan.rule)
        self.build_master(per_param=True)
        self._facade = None

    @property
    def master(self) -> MasterOptimizer | None:
        """The optimizer part (:class:`~zerodp.engine.master.MasterOptimizer`), which the step
        machine steps; built by :meth:`finish_construction`, rebuilt on adoption."""
        return self.machine.master

    @property
    def module(self) -> nn.Module:
        """The wrapped model, with its parameters complete (waits for in-flight AllGathers)."""
        self.machine.wait_params()
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
        return self.machine.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.machine.sync = bool(value)

    def forward(self, *args, **kwargs):
        # Traced by torch.compile(engine): only the model's call is; the engine's entry and exit
        # are host bookkeeping, kept out of the graph (zerodp.engine.compiled).
        args, kwargs, span = self._enter_forward(args, kwargs)
        try:
            out = self._module(*args, **kwargs)
        except BaseException:
            self._fail_forward(span)
            raise
        return self._exit_forward(out, span)

    @host_only
    def _enter_forward(self, args: tuple, kwargs: dict):
        self.machine.check_not_failed("forward")
        if torch.is_grad_enabled():
            self.construction.check_requires_grad()
        self.machine.sync_at_forward = self.machine.sync  # as DDP: no_sync applies to the forward it wraps
        # DDP's rule for buffers (BatchNorm statistics): rank 0's are broadcast at a forward that
        # follows a grad-enabled, synchronizing forward (and at the first), so the first evaluation
        # forward after training sees rank 0's, and further no_grad forwards communicate nothing:
        # ranks may run different numbers of them.
        if self._buffers_stale and self.config.broadcast_buffers and self.state_buffers and self.world_size > 1:
            self.construction.broadcast_buffers()
        self._buffers_stale = torch.is_grad_enabled() and self.machine.sync
        if self.dtypes.cast_inputs:  # floating inputs compute in the param dtype, every stage
            args, kwargs = cast_floats((args, kwargs), self.dtypes.param)
        self.machine.reconcile_grads()  # the module's .grad read back; the next backward accumulates as before
        self.machine.wait_params()  # stages 1-2: the step's parameter AllGathers, overlapped until here
        self.take_module_values(fold=False)
        return args, kwargs, self.recorder.begin("forward", COMPUTE)

    @host_only
    def _fail_forward(self, span) -> None:
        self.recorder.end(span)
        self.hooks.abort_forward()

    @host_only
    def _exit_forward(self, out, span):
        self.recorder.end(span)
        outputs = grad_tensors(out)
        for t in outputs:  # an output's gradient is the first thing backward computes
            t.register_hook(self.machine.on_output_grad)
        if not torch.is_grad_enabled() or outputs:
            # torch keeps .grad across a forward: the reduced gradients go back on the parameters
            # (a backward from this output takes them off first, in StepMachine.on_output_grad), so that
            # model.zero_grad() between this forward and the step is seen (guide §12.9)
            self.machine.attach_sharded_grads()
        return out

    def __getattr__(self, name: str):
        """The wrapped model's public attributes, read through the engine: an FSDP2 script's model
        is the model itself (``model.config``, ``model.layers``, ``model.generate(...)``), and a DDP
        script's ``model.module.<name>`` serves as well. The engine's own names come first; DDP's
        and FSDP2's own calls come last (:mod:`zerodp.engine.foreign`)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("_"):
                raise
        try:
            return getattr(inner, name)
        except AttributeError:
            served = foreign.answer(self, name)
            if served is None:
                raise  # the model's own AttributeError
            return served

    def __deepcopy__(self, memo):
        """``copy.deepcopy(model)`` and ``AveragedModel(model)`` (an EMA) on the engine: it holds
        process groups and flat buffers shared with the model, which a copy cannot hold; one line
        names what to copy instead."""
        what = ("AveragedModel(model.module) or copy.deepcopy(model.module): at this stage the wrapped "
                "model's parameters hold the whole values" if not self.policy.shard_params else
                "build a fresh model and load model.state_dict() into it (every rank calls it): at stage 3 "
                "each rank holds a shard of each parameter")
        raise RuntimeError(f"copy.deepcopy of the {type(self).__name__} (an EMA's AveragedModel(model) makes one): "
                           f"it holds process groups and buffers shared with the model; {what}")

    def _fqn_modifiers(self) -> dict[str, str]:
        """The names torch.distributed.checkpoint's ``get_state_dict`` / ``set_state_dict`` (and the
        model-only and optimizer-only forms) use for the engine's entries: the model's own, as
        :meth:`state_dict` and :meth:`named_parameters` give them. torch asks a module for this map
        (attribute name under the model -> the child that holds it) to leave a wrapper's child
        out of its names, as it leaves out DDP's ``module.`` (docs/porting.md, From FSDP2)."""
        return {name: "module" for name, _ in self.module.named_children()}

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module.to/cuda/half/float/...`` pass through here: a call that leaves every
        parameter and buffer as it is (``model.to(its own device)``) is served, one that would move
        or cast them is refused — they are views into the engine's flat buffers. At stage 3 a call
        that makes new tensors of the same kind (``model.to_empty(device=...)``, FSDP2's step before
        ``init_weights()`` of a model built on the meta device) is refused as well, naming ``init_fn``:
        the module's parameters are placeholders there, which ``init_weights`` cannot write."""
        for t in [*self._module.parameters(), *self._module.buffers()]:
            out = fn(t)
            if out is not t and (out.dtype != t.dtype or out.device != t.device):
                raise RuntimeError(
                    f"the engine's parameters are views into its flat buffers and cannot be moved or cast in place "
                    f"({t.dtype} on {t.device} -> {out.dtype} on {out.device}): call model.to(device) before "
                    "zerodp.parallelize, and ask for a compute dtype with mixed_precision='bf16'")
            if out is not t and self.policy.shard_params and isinstance(t, nn.Parameter):
                raise RuntimeError(
                    "model.to_empty(...) (or another call making new parameters) after the wrap at stage 3: the engine "
                    "holds each rank's shard of every parameter, and the module's parameters at rest are placeholders "
                    "that init_weights() cannot write; for a model built on the meta device pass "
                    "parallelize(model, ..., init_fn=<its init, e.g. M.init_weights>) so each rank initializes its "
                    "shards, or write values inside `with model.gathered(writeback=True):` on every rank")
        return self

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters. Once a step's gradients are reduced, their ``.grad`` is what
        torch's clipping needs at every stage: the averaged gradient, or at sharded stages a
        :class:`~zerodp.engine.grads.ShardedGrad` of this rank's slice, so that
        ``torch.nn.utils.clip_grad_norm_(engine.parameters(), c)`` clips as ``engine.clip_grad_norm_``."""
        self.machine.attach_sharded_grads()
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        self.machine.attach_sharded_grads()
        return self.module.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        """The model's buffers under the model's names, as :meth:`named_parameters` and
        :meth:`state_dict` name them."""
        return self.module.named_buffers(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Guide §5: inside, backward accumulates gradients locally and communicates nothing.

        ``with engine.no_sync(micro < grad_acc - 1):`` around forward and backward is the usual
        loop; as with DDP, what counts is whether the *forward* ran inside. ``enabled=False`` makes
        it a no-op. (Stage 2 by default still reduces every micro-batch — memory first — unless
        ``reduce_every_microbatch=False``; see :mod:`zerodp.engine.zero2`.)
        """
        previous = self.machine.sync
        self.machine.sync = previous and not enabled
        try:
            yield
        finally:
            self.machine.sync = previous

    def count_tokens(self, n: int | float) -> None:
        """With ``average_by_tokens=True``: add this micro-batch's token count on this rank, before
        its backward (guide §2.2; :meth:`zerodp.engine.step.StepMachine.count_tokens`)."""
        self.machine.count_tokens(n)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

        The norm covers every gradient of the model. Sharded stages hold disjoint shards, so the
        squared norms of the local shards are summed with one AllReduce (guide §9; guide §12).
        Matches ``torch.nn.utils.clip_grad_norm_``: grads *= min(1, max_norm / (norm + 1e-6)).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: only the 2-norm is supported across shards")
        self.machine.check_not_failed("clip_grad_norm_")
        self.machine.reconcile_grads()
        self.machine.finish_grad_sync()
        grads = [g for g in self.machine.master_grads() if g is not None]
        if grads:
            norms = torch._foreach_norm([g if g.dtype in (torch.float32, torch.float64) else g.float()
                                          for g in grads])
            sq = torch.stack(norms).square().sum().reshape(1)
        else:
            sq = torch.zeros(1, dtype=self.dtypes.master if self.dtypes.master == torch.float64 else torch.float32,
                             device=self.device)
        if self.policy.shard_master and self.shard_comm.world_size > 1:  # disjoint shards; replicas hold the same
            sq = self.shard_comm.reduce_for(CLIP_GRAD_NORM, sq)
        norm = sq.sqrt()[0]
        coef = torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0)
        for g in self.groups:
            g.grads.scale(coef)
        self.machine.attach_sharded_grads()
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
        self.machine.check_not_failed("step")
        if self.adoption.pending:
            raise RuntimeError("engine.step(): zerodp.parallelize was given no optimizer and none has been built "
                               "over model.parameters() yet: pass optimizer=lambda groups: torch.optim.AdamW(groups, "
                               "lr=...) to parallelize, or build one over model.parameters() and call its step()")
        self.machine.reconcile_grads()
        self.take_module_values(fold=True)
        self.adoption.options_in(self)
        with self.recorder.span("step", COMPUTE):
            self.machine.finish_grad_sync()
            # Collective where parameters may go unused: a dropped gradient's used-flag was reset, so
            # the exchange says whether any rank's backward gave it a gradient again since
            unused = self._step_unused()
            self.machine.unused = unused | self.machine.dropped if self._local_used() is None else unused
            skip = self.guard is not None and self.guard.should_skip(self)  # collective
            # zerodp.ft: the quorum of replica groups commits the step — before it is applied, or,
            # under DiLoCo, after the inner step and its sync's exchange, before the outer update
            replicas = self.config.replicas
            commit = None if replicas is None else replicas.should_commit
            if commit is not None and self.outer is None and not commit():
                skip = True  # the quorum did not commit this step
            if skip:
                self.machine.zero_grads()  # inf/NaN somewhere: apply nothing, on every rank
                self.machine.reset_used()
                if commit is not None and self.outer is not None:
                    commit()  # the quorum's protocol: one vote a step (this one applies nothing)
            elif self.outer is None:
                self.machine.optimizer_step()
            else:  # the inner step, then the outer loop's syncs due after it (zerodp.engine.outer)
                self.outer.step(self.machine.optimizer_step, commit=commit)
            if not self.config.overlap_param_gather:
                self.machine.wait_params()  # step() returns with the model's parameters up to date
        self.machine.move(StepState.STEPPED)
        self.adoption.options_out(self)
        self.machine.attach_sharded_grads()  # gradients stay on the parameters until zero_grad, as torch's
        self.last_comm_peak, self.machine.comm_peak = self.machine.comm_peak, 0
        self.machine.tokens = 0.0
        self.machine.token_factor_value = None
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
        if self.machine.state is StepState.BACKWARD:  # the last backward raised: drop what it left
            self.machine.abandon_backward()
        # Wait for the collectives in flight; local gradients of no_sync backwards are dropped
        # unreduced (a reduction here would follow each rank's own data: ranks whose branches
        # differed would issue different collectives).
        self.machine.inflight.wait_all()
        self.machine.grad_pool.clear()
        # What the step's gradients held, for stats(): the shards freed here exist again from the
        # next step's first reduction on (model states are what a step holds, guide §8).
        self.last_grad_bytes = measured_bytes({"grads": [t for g in self.groups for t in g.memory()["grads"]]})["grads"]
        self.machine.reconcile_grads()
        self.machine.dropped.clear()
        self.machine.zero_grads(set_to_none)
        if set_to_none:
            self.machine.reset_used()  # torch: every .grad is None; used-flags start again
        self.machine.move(StepState.IDLE)
        if not set_to_none:
            self.machine.attach_sharded_grads()  # torch: every .grad is a zero tensor, which p.grad = None drops

    def take_module_values(self, fold: bool) -> None:
        """The module's parameters are the truth (guide §12.9): rebound ``.data`` taken back, and
        with ``fold`` values written into them since the last step folded into a separate master."""
        for g in self.groups:
            g.take_rebound()
            if fold:
                g.fold_into_master()

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False) -> Iterator[nn.Module]:
        """Every parameter of the module whole inside the block, on every rank (as FSDP1's
        ``summon_full_params`` or DeepSpeed's ``GatheredParameters``); with ``writeback`` what the
        block wrote into them is the engine's at its end. Stages 0-2 hold whole parameters at all
        times; stage 3 gathers every unit for the block (a collective: every rank enters it)."""
        self.machine.wait_params()
        yield self._module
        if writeback:
            self.take_module_values(fold=True)

    def stats(self):
        """Measured bytes per rank by kind, the last step's collectives, exposed comm, step time."""
        return collect_stats(self)

    @user_call(CHROME_TRACE)
    def export_chrome_trace(self, path: str | os.PathLike, step: int | None = None) -> str | None:
        """Collective: rank 0 writes every rank's events as Chrome-trace JSON (Perfetto-loadable)."""
        gathered = self.control.all_gather_object(self.recorder.chrome_events(step))
        if self.rank != 0:
            return None
        return write_chrome_trace(path, [e for rank_events in gathered for e in rank_events])

    # ---- standard state dicts, keyed by the model's own names (zerodp.engine.state_dict) ----
    def state_dict(self, *, destination: dict | None = None, prefix: str = "", keep_vars: bool = False,
                   **options) -> dict[str, torch.Tensor]:
        """Collective: the model's parameters and persistent buffers by name, like
        ``module.state_dict()`` (see :func:`zerodp.engine.state_dict.state_dict` for options).
        ``destination`` and ``prefix`` are what a parent module's ``state_dict()`` passes its
        children: the same tensors, under the parent's names."""
        own = state_dict(self, **options)
        if destination is None and not prefix:
            return own
        out = destination if destination is not None else {}
        out.update((prefix + k, v) for k, v in own.items())
        return out

    def _load_from_state_dict(self, state, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """A parent module's ``load_state_dict`` reaching the engine: the keys under ``prefix`` are
        loaded by the engine's own :meth:`load_state_dict` (every stage, any saved layout), and the
        parent's walk does not go on into the child ``module`` — it would write around the engine
        (into stage 3's empty parameters) — until :func:`_restore_child` puts the child back."""
        mine = {k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}
        self._modules.pop("module", None)
        try:
            result = self.load_state_dict(mine, strict=False)
        except Exception as e:  # noqa: BLE001 - reported as the parent reports a child's error
            error_msgs.append(f"{prefix or 'engine'}: {e}")
            return
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Collective: load parameters and buffers by name (each rank copies what it holds).
        ``nn.Module``'s signature; ``assign`` copies too — the parameters are views into the
        engine's flat buffers, which keep their dtype and place."""
        return load_state_dict(self, state_dict, strict=strict)

    def optimizer_state_dict(self, **options) -> dict:
        """Collective: the optimizer's state keyed by parameter name, in the shape
        ``torch.optim.Optimizer.state_dict()`` uses."""
        self.adoption.options_in(self)
        return optimizer_state_dict(self, **options)

    def load_optimizer_state_dict(self, state: dict, **options) -> None:
        """Collective: load an :meth:`optimizer_state_dict` saved at any stage and world size."""
        load_optimizer_state_dict(self, state, **options)
        self.adoption.options_out(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter whole, as fp32 (the master), and every persistent buffer."""
        return self.checkpoint.full_state_dict()

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the averaged gradient the next ``step`` applies, whole, by parameter name."""
        return self.checkpoint.full_grad_dict()

    def layout(self) -> list[dict]:
        """The flat groups as data (:meth:`zerodp.engine.state_dict.CheckpointContract.layout`)."""
        return self.checkpoint.layout()




def _restore_child(engine: StageEngine, incompatible) -> None:
    """The post-hook of a parent's ``load_state_dict`` on the engine: its child ``module`` back."""
    engine._modules["module"] = engine._module


def _check_sparse(module: nn.Module, stage: int) -> None:
    """Sparse gradients (``nn.Embedding(sparse=True)``): stage 0 trains them as DDP does (summed
    densely in its bucket); stages 1-3 ReduceScatter flat dense slices, so refuse in one line."""
    if stage == 0:
        return
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ValueError(f"{name or 'the model'} ({type(m).__name__}) has sparse=True: its sparse gradients cannot "
                             f"be sharded at stage {stage}; build it with sparse=False, or use stage=0 (as DDP)")


def _stand_in_optimizer(groups: list[dict]) -> torch.optim.Optimizer:
    """The master's optimizer until the script's own is adopted (never stepped: step() refuses)."""
    return torch.optim.SGD(groups, lr=0.0)


def _rebuilt_optimizer_step(optimizer, args, kwargs):
    """Step pre-hook on each of several optimizers given to ``parallelize`` as a list: they were
    rebuilt over the engine's master as one (a single one given is taken over instead)."""
    raise RuntimeError(
        f"this {type(optimizer).__name__} was given to zerodp.parallelize in a list, which rebuilt them over the "
        "engine's fp32 master as one optimizer: step the engine's instead (optimizer = engine.optimizer after "
        "parallelize)")


def remove_hooks(handles: list) -> None:
    """Run by ``weakref.finalize`` when an engine is collected: its hooks leave the module."""
    for h in handles:
        h.remove()


def grad_hook(hooks: Any, method: str, group: int, j: int) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of trainable parameter ``j`` of ``hooks.groups[group]``:
    calls ``hooks.<method>(that group, j, param)`` (``hooks``: the stage's hooks part). It holds
    the hooks by a weak reference and the group by its index: a parameter's hooks are held from C++,
    where Python's garbage collector cannot see a cycle back through them, so a hook holding the
    engine or a group would keep a deleted engine and its flat buffers alive for the life of the
    process."""
    ref = weakref.ref(hooks)

    @host_only
    def hook(param: nn.Parameter) -> None:
        hooks = ref()
        if hooks is not None:
            getattr(hooks, method)(hooks.groups[group], j, param)
    return hook
