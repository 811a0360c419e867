"""Stage 3: ZeRO-3 / FSDP — parameters, gradients and optimizer states all sharded 1/N.

Guide §9.3: each rank keeps 1/N of everything, (2 + 2 + k)Ψ/N bytes of model states, plus the
temporarily gathered units. A step, unit by unit (guide §10's sharded notation):

forward   for each unit: AllGather its parameters → compute → free them. The unit that finishes
          forward last stays gathered, because backward needs it first: 2L − 1 AllGathers per
          step for L units, not 2L (guide §9.3).
backward  in reverse: AllGather the unit again (§10 "可提前做", may be done early) → its backward
          → ReduceScatter its gradients (§10 "可异步", asynchronous) → free parameters and the
          full gradients; each rank keeps only its gradient shard.
prefetch  while unit i computes, unit i+1's AllGather is in flight (forward), unit i−1's in
          backward (§9.3 预取). It hides when one unit's compute outlasts one unit's AllGather,
          i.e. tokens per rank > C/W (§10.2). At most two gathered units are alive besides the
          kept last one; the engine measures that peak (``stats().peak_gathered_units``).
step      the stock optimizer updates this rank's fp32 master shard; the compute-dtype shard is
          refreshed by a cast. There is no AllGather after the step: the next forward gathers.

Communicated elements per rank per step: Ψ (forward AG) + Ψ (backward AG, minus the kept unit)
+ Ψ (RS) ≈ 3Ψ·(N−1)/N, 1.5× stage 2 (guide §9.3, §10.1). A single unit holding the whole model
degenerates to ZeRO-1/2: one AllGather before forward, one ReduceScatter after backward
(guide §10.3).

Units (guide §10.3) default to each block of the model's largest ``nn.ModuleList`` plus a root
unit for the remaining parameters (embeddings, final norm, head); ``units=[...]`` overrides.

Tied parameters WORK when every module sharing the weight is in the same unit (a GPT's tied
embedding and head both live in the root unit: one slot, one gradient, one update); weights tied
across units are REFUSED at construction with a message naming both. Frozen parameters
(``requires_grad=False``) WORK: they are gathered with their unit (forward needs them), get no
gradient, no optimizer state, and are never updated.

Gradient accumulation has the two options of stage 2 (guide §5, §9.2): by default every
micro-batch's gradients are ReduceScattered and accumulated on the shard (memory first); with
``reduce_every_microbatch=False`` the full unsharded gradients of every unit are kept across
the ``no_sync`` micro-batches and reduced once (communication first, +2Ψ of memory).

At rest (between steps) the module's parameters are empty placeholders — nothing is gathered —
so read weights with ``engine.full_state_dict()`` (a collective), not ``module.state_dict()``;
``engine.module(x)`` still runs, gathering unit by unit (under ``torch.no_grad()`` every unit is
freed again after its forward).

Mechanics: parameters are views into each unit's flat buffer (:class:`zerodp.engine.group.FlatGroup`);
module forward pre/post hooks gather and free; hooks on each unit's outputs start its backward
(gather, prefetch); a unit's backward is over when post-accumulate-grad hooks have counted all
its gradients *and* an identity function on its inputs has received their gradient; then its
ReduceScatter is launched and it is freed. An end-of-backward callback catches units whose
parameters got no gradient and waits for the last ReduceScatters. Prefetch follows the order
recorded in the previous forward (module registration order before the first one), so every
rank issues the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.base import StageEngine, grad_hook, remove_hooks
from zerodp.engine.buckets import cast_floating_buffers
from zerodp.engine.compiled import host_only
from zerodp.engine.config import EngineConfig
from zerodp.engine.control import EVAL_FORWARD
from zerodp.engine.deferred import materialize_buffers, materialize_params, owners
from zerodp.engine.group import FlatGroup
from zerodp.engine.optimizer_plan import OptimizerFactory
from zerodp.engine.module_view import restore_class, shard_view_class
from zerodp.engine.nest import cast_floats, grad_tensors, replace, tensors
from zerodp.engine.schedule import UnitSchedule
from zerodp.engine.states import ParamState, Phase, StepState
from zerodp.engine.stats import EngineStats, fmt_bytes
from zerodp.engine.trace import COMPUTE
from zerodp.engine.unit import plan_units

Unit = FlatGroup  # a unit is a flat group whose policy shards its parameters (guide §12.1)


@dataclass
class UnitInfo:
    """One unit as data: Ψ_u, padded to a multiple of N, the shard each rank keeps, and the
    bytes of its gathered buffer in the compute dtype."""

    name: str
    numel: int
    padded_numel: int
    shard_numel: int
    gathered_bytes: int


@dataclass
class FSDPStats(EngineStats):
    """:class:`~zerodp.engine.stats.EngineStats` for stage 3: ``memory["gathered"]`` is the peak
    of the last step, ``peak_gathered_units`` how many units that was, ``units`` the unit sizes."""

    peak_gathered_units: int = 0
    units: list[UnitInfo] = field(default_factory=list)

    @property
    def all_gathers_expected(self) -> int:
        """Guide §9.3: 2L − 1 AllGathers per step for L units."""
        return 2 * len(self.units) - 1

    def table(self) -> str:
        lines = [super().table(),
                 f"units: L = {len(self.units)} → 2L−1 = {self.all_gathers_expected} AllGathers/step "
                 f"expected; peak gathered {self.peak_gathered_units} units "
                 f"({fmt_bytes(self.memory.get('gathered', 0))})"]
        for u in self.units:
            lines.append(f"  {u.name:<18}Ψ_u {u.numel:>10,}  padded {u.padded_numel:>10,}  "
                         f"shard {u.shard_numel:>9,}  gathered {fmt_bytes(u.gathered_bytes):>10}")
        return "\n".join(lines)


class FSDPEngine(StageEngine):
    """ZeRO-3 / FSDP over units; see the module docstring. Built by ``parallelize(stage=3)``."""

    stage = 3

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, config: EngineConfig,
                 units: list[nn.Module] | None = None, group: dist.ProcessGroup | None = None):
        super().__init__(module, optimizer_factory, config, units=units, group=group)
        group_index = {id(p): g for (_, p), g in zip(self.named_params, self.optimizer_plan.group_of)}
        specs = plan_units(module, units, lambda fqn, p: group_index[id(p)])
        # Check before the first broadcast, so that mismatched ranks fail with words, not a hang.
        self.construction.check_consistency({
            "stage": self.stage, "world_size": self.world_size,
            "dtypes": repr(self.dtypes), "prefetch": config.prefetch,
            "units": [{"name": s.label, "params": [[f, list(p.shape), str(p.dtype), g]
                                                   for f, p, g in s.params]} for s in specs],
        })
        self.groups = [self.construction.new_group(i, spec.label, list(spec.params), self.optimizer_plan, self.dtypes)
                       for i, spec in enumerate(specs)]
        for u, spec in zip(self.groups, specs):
            u.module = spec.module
        if self.deferred:  # buffers now; each unit's parameters one unit at a time, in construction.init_groups
            unit_of = {id(p): u for u in self.groups for p in u.params}
            self._init_modules: list[list[tuple[str, nn.Module]]] = [[] for _ in self.groups]
            for name, m in owners(module):
                first = next((p for p in m._parameters.values() if p is not None), None)
                if first is not None:
                    self._init_modules[unit_of[id(first)].index].append((name, m))
            materialize_buffers(module, self.device, config.init_fn, config.init_seed,
                                {id(m) for ms in self._init_modules for _, m in ms})
        if self.dtypes.cast_inputs:  # floating-point buffers compute in the param dtype, as at stages 0-2
            cast_floating_buffers(module, self.dtypes.param)
        self.construction.init_groups(self.groups, self.dtypes.master, extra_broadcast=[b for b in module.buffers()],
                                      materialize=self._materialize)
        self.schedule = UnitSchedule(self.comm, self.group, self.world_size, self.device)
        self.machine.on_launch = functools.partial(self.schedule.log, "RS")  # every ReduceScatter, in order

        self.last_peak_gathered_units = 0
        self.last_peak_gathered_bytes = 0
        # the module's hooks and what they keep between calls
        self.hooks = UnitHooks(self.groups, module, self.machine, self.recorder, self.control, self.schedule,
                               self.checkpoint, dtypes=self.dtypes, device=self.device, world_size=self.world_size,
                               prefetch=config.prefetch, reduce_every_microbatch=config.reduce_every_microbatch,
                               take_values=self.take_module_values, full_state=self.state_dict, owner=self)
        self.hooks.install()
        self.finish_construction()

    def _materialize(self, u: Unit) -> None:
        """Deferred initialization of one unit, just before it is packed and sharded (§9.3)."""
        materialize_params(u.params, self._init_modules[u.index], self.device, self.config.init_fn,
                           self.config.init_seed)

    # ---- the module's own values (guide §12.9) ----------------------------------------------
    def take_module_values(self, fold: bool) -> None:
        """Between calls, a unit still gathered (the last unit of a forward whose graph was dropped)
        is freed first: what the script wrote into it meanwhile goes into the shard (``free``)."""
        if not self.hooks.forwarding and self.machine.state is not StepState.BACKWARD:
            self.hooks.free_all()
        super().take_module_values(fold)

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False):
        """Every unit gathered for the block, on every rank (a collective); with ``writeback`` what
        the block wrote into the parameters goes into the shards at its end (see the base class)."""
        self.machine.check_not_failed("gathered")
        self.machine.inflight.wait_all()
        self.take_module_values(fold=False)
        for u in self.groups:
            self.hooks.ensure_gathered(u)
        ok = False
        try:
            yield self._module
            ok = True
        finally:
            for u in self.groups:
                if ok and writeback:
                    u.write_back()
                u.free()

    # ---- StageEngine contract ------------------------------------------------------------------
    def _local_used(self) -> list[bool]:
        return list(self.machine.step_used)

    def _step_unused(self) -> set[str]:
        """One small AllReduce at each step serves two checks: which parameters no rank used
        (MAX of used-flags = OR), and whether every rank issued the same unit collectives
        (MAX of hash and of −hash: equal iff every rank's hash is the same)."""
        used = self._local_used()
        h = float(self.schedule.hash)
        flags = torch.tensor([h, -h] + [1.0 if x else 0.0 for x in used], dtype=torch.float64,
                             device=self.device)
        if self.world_size > 1:
            self.comm.all_reduce_max(flags, "used_params")
            if flags[0].item() != -flags[1].item():
                self.schedule.mismatch()
        return {n for (n, _), f in zip(self.named_params, flags[2:].tolist()) if f == 0.0}

    def step(self) -> None:
        super().step()
        self.schedule.reset()  # compared across ranks at each step
        # The gathered peak of the step just completed, for stats(); start the next one.
        self.last_peak_gathered_units, self.last_peak_gathered_bytes = self.hooks.take_peak()

    # ---- stage-3 specific views ------------------------------------------------------------------
    def stats(self) -> "FSDPStats":
        """:meth:`StageEngine.stats` plus the units and the measured peak of gathered units.

        At rest a ZeRO-3 rank holds no gathered unit, so ``memory["gathered"]`` reports the peak
        bytes of simultaneously gathered units during the last step (measured from the storages
        when they were allocated); ``peak_gathered_units`` counts them (guide §9.3: the unit in use
        + the one prefetched, plus the last unit kept from forward into backward).
        """
        base = super().stats()
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        fields["memory"] = dict(fields["memory"], gathered=self.last_peak_gathered_bytes)
        # Ψ from the layouts: at rest the module's parameters are empty placeholders.
        fields["num_params"] = sum(u.layout.slots[i].numel for u in self.groups for i in u.trainable)
        return FSDPStats(
            **fields, peak_gathered_units=self.last_peak_gathered_units,
            units=[UnitInfo(u.label, u.numel, u.layout.padded_numel, u.layout.shard_numel,
                            u.full_nbytes()) for u in self.groups],
        )



class UnitHooks:
    """Stage 3's module hooks and what they keep between calls (one part of :class:`FSDPEngine`,
    ``engine.hooks``): the forward and backward of each unit — gather, prefetch, free, the
    ReduceScatter once its gradients are final — the order recorded for prefetching, the unit kept
    from forward into backward, and the module's own state-dict hooks (see the module docstring)."""

    def __init__(self, groups: list[Unit], module: nn.Module, machine, recorder, control, schedule, checkpoint, *,
                 dtypes, device: torch.device, world_size: int, prefetch: bool, reduce_every_microbatch: bool,
                 take_values: Callable[[bool], None], full_state: Callable[[], dict], owner: object):
        self.groups = groups  # the units (grad_hook finds a unit here by its index)
        self.module = module  # the model, whose hooks these are
        self.machine = machine  # the step machine: backward start and end, the queue in flight
        self.recorder, self.control, self.schedule, self.checkpoint = recorder, control, schedule, checkpoint
        self.dtypes, self.device, self.world_size = dtypes, device, world_size
        self.prefetch, self.reduce_every_microbatch = prefetch, reduce_every_microbatch
        self.take_values = take_values  # the module's own values taken back (the engine's take_module_values)
        self.full_state = full_state  # the engine's state_dict(): model.state_dict()'s full values
        self.owner = owner  # the hooks leave the module when it is collected
        # Prefetch order: registration order until a forward has been seen, then the recorded one.
        order = list(groups)
        self.next_fwd: dict[int, Unit] = {a.index: b for a, b in zip(order, order[1:])}
        self.next_bwd: dict[int, Unit] = {b.index: a for a, b in zip(order, order[1:])}
        self.fwd_order: list[Unit] = []
        self.post_order: list[Unit] = []
        self.deferred: Unit | None = None  # finished forward, not yet freed (maybe the last one)
        self.forwarding = False
        self.reduce_this_pass = True
        self.peak_units = 0
        self.peak_bytes = 0
        self.tokens_issued = itertools.count()  # one per watched forward call (BackwardState)
        self.evaluation: contextlib.ExitStack | None = None  # the control call of a no_grad forward
        self.handles: list = []
        self.watching = True  # until the first training forward ends: units' inner modules checked (module_runs)
        self.loaded_keys: set[str] = set()  # model.load_state_dict: the keys written into shards

    # ---- hooks ------------------------------------------------------------------------------
    def install(self) -> None:
        """The module's hooks hold the engine weakly (a module outlives its engine: ``del engine``
        frees the engine and its buffers), and are removed when the engine is collected."""
        root, ref = self.module, weakref.ref(self)

        def call(method: str):
            return functools.partial(_engine_hook, ref, method)

        def unit_call(method: str, index: int, skip: int):
            return functools.partial(_unit_hook, ref, method, index, skip)

        self.handles.append(root.register_forward_pre_hook(call("top_pre_forward"), prepend=True))
        for u in self.groups:
            self.handles.append(u.module.register_forward_pre_hook(
                unit_call("pre_forward", u.index, 1), with_kwargs=True))
            self.handles.append(u.module.register_forward_hook(
                unit_call("post_forward", u.index, 2)))
            for j, p in enumerate(u.trainable_params):
                self.handles.append(p.register_post_accumulate_grad_hook(
                    grad_hook(self, "grad_ready", u.index, j)))
        self.handles.append(root.register_forward_hook(call("top_post_forward")))
        # The first training forward also watches every module that holds a unit's parameters
        # below the unit's own module: one run while its unit is not gathered is shared across
        # units or called from outside the model (it would read the placeholders). The hooks stay
        # (removing them would make torch.compile recompile) and return at once afterwards.
        unit_of = {id(p): u for u in self.groups for p in u.params}
        for name, m in root.named_modules():
            owner = next((unit_of[id(p)] for p in m._parameters.values() if p is not None and id(p) in unit_of), None)
            if owner is not None and m is not owner.module:
                self.handles.append(m.register_forward_pre_hook(_watch_hook(ref, owner.index, name)))
        # The module's own state dict holds full values (gathered: a collective), and its
        # load_state_dict writes into the shards; deepcopy is refused (module_view).
        self.handles.append(root.register_state_dict_post_hook(call("module_state_dict")))
        self.handles.append(root.register_load_state_dict_pre_hook(call("module_load_state_dict")))
        self.handles.append(root.register_load_state_dict_post_hook(call("module_loaded")))
        weakref.finalize(self.owner, remove_hooks, list(self.handles))
        weakref.finalize(self.owner, restore_class, root, shard_view_class(root))

    @host_only
    def top_pre_forward(self, module, args):
        if self.forwarding:
            return None
        self.machine.reconcile_grads()
        self.take_values(fold=False)
        if not torch.is_grad_enabled() and self.world_size > 1:
            self.open_evaluation()
        self.forwarding = True
        self.machine.inflight.wait_all()
        for u in self.groups:  # e.g. the kept unit of a forward that had no backward
            if u.gathered:
                self.free(u)
        self.fwd_order = []
        self.post_order = []
        # u.bwd.pending_inputs is NOT reset here: a graph of an earlier forward of this step (two
        # forwards, one backward) still counts on its units while it is alive.
        self.reduce_this_pass = self.machine.sync or self.reduce_every_microbatch
        return None

    @host_only
    def pre_forward(self, u: Unit, args, kwargs):
        if not self.forwarding:
            # Called outside the model's own forward (a unit run on its own, or activation
            # recomputation during backward): make sure the parameters are there; when this runs
            # inside backward (recomputation), the unit's backward is over only once the gradient
            # of these inputs is computed too, so watch them.
            self.ensure_gathered(u)
            cast = self.cast_inputs(args, kwargs)
            if cast is not None:
                args, kwargs = cast
            if torch.is_grad_enabled() and self.machine.state is StepState.BACKWARD:
                args, kwargs = self.watch_inputs(u, args, kwargs)
            return args, kwargs
        d = self.deferred
        if d is not None and d is not u:
            self.free(d)
            self.deferred = None
        self.fwd_order.append(u)
        self.ensure_gathered(u)
        if self.prefetch:
            nxt = self.next_fwd.get(u.index)
            if nxt is not None and not nxt.gathered:
                self.gather(nxt, async_op=True)
        u.bwd.fwd_event = self.recorder.begin(f"forward {u.label}", COMPUTE, unit=u.label)
        cast = self.cast_inputs(args, kwargs)
        if cast is not None:
            args, kwargs = cast
        if torch.is_grad_enabled():
            args, kwargs = self.watch_inputs(u, args, kwargs)
        return args, kwargs

    def watch_inputs(self, u: Unit, args, kwargs):
        """Route the unit's grad-requiring inputs through :class:`_InputsGradient`, whose backward
        runs once the gradient w.r.t. those inputs is complete, i.e. the unit's backward is over."""
        flat = [t for t in tensors((args, kwargs)) if t.requires_grad]
        if not flat:
            return args, kwargs
        token = next(self.tokens_issued)
        u.bwd.pending_inputs.add(token)
        outs = _InputsGradient.apply(weakref.ref(self), u.index, token, *flat)
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        swap = {id(a): b for a, b in zip(flat, outs)}
        return replace((args, kwargs), swap)

    @host_only
    def post_forward(self, u: Unit, out):
        ev = u.bwd.fwd_event
        if ev is not None:
            self.recorder.end(ev)
            u.bwd.fwd_event = None
        if not self.forwarding:
            return None
        d = self.deferred
        if d is not None and d is not u:
            self.free(d)
        self.deferred = u
        self.post_order.append(u)
        if torch.is_grad_enabled():
            hook = lambda grad, u=u: self.pre_backward(u)  # noqa: E731
            for t in grad_tensors(out):
                t.register_hook(hook)
        return None

    @host_only
    def top_post_forward(self, module, args, out):
        if not self.forwarding:
            return None
        self.forwarding = False
        last, self.deferred = self.deferred, None
        if self.fwd_order and torch.is_grad_enabled() and self.world_size > 1:
            self.schedule.check_forward_order(self.fwd_order)
        if self.fwd_order:
            seq = self.fwd_order
            self.next_fwd = {a.index: b for a, b in zip(seq, seq[1:])}
            back = self.post_order[::-1]
            self.next_bwd = {a.index: b for a, b in zip(back, back[1:])}
        if torch.is_grad_enabled():
            self.watching = False
        if last is not None and not torch.is_grad_enabled():
            self.free(last)  # else kept gathered: backward uses it first (guide §9.3: 2L − 1 gathers),
            # also when the output shows no tensor needing grad (a loss kept on an attribute): the
            # next forward frees it when no backward came
        if not torch.is_grad_enabled():
            self.machine.attach_sharded_grads()  # an evaluation forward of the module keeps .grad, as torch's
        self.close_evaluation()
        return None

    @host_only
    def module_runs(self, index: int, name: str, module, args) -> None:
        """A module holding unit ``index``'s parameters starts its forward (the first training
        forward only): its unit must be gathered — a gather in flight is waited for."""
        u = self.groups[index]
        if u.param_state is ParamState.GATHERING:
            u.wait_gather()
        elif u.param_state is ParamState.SHARDED:
            raise RuntimeError(
                f"module {name!r} holds parameters of stage-3 unit {u.label!r} but runs while that unit is not "
                "gathered (it is shared with another unit, or called from outside the model): make the shared "
                "module its own unit or part of one unit that encloses every use (parallelize(..., units=[...])), "
                "or call it inside `with engine.gathered():`")

    # ---- an evaluation on some ranks only (guide §12.9, zerodp.engine.control) -------------------
    def open_evaluation(self) -> None:
        """A forward under ``no_grad`` is a call every rank checks, as a state dict is: made on
        every rank it gathers on the engine's groups as any forward; made on some ranks only
        (``if rank == 0: evaluate()``), the others serve its unit gathers from their next step's
        waits, over the control group (:meth:`serve_evaluation`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.control.call(EVAL_FORWARD))
        self.evaluation = stack

    def close_evaluation(self) -> None:
        stack, self.evaluation = self.evaluation, None
        if stack is None:
            return
        with stack:
            if self.control.routed:
                self.control.end_routed()

    def serve_evaluation(self) -> None:
        """This rank, waiting in one of its step's collectives, serves another rank's evaluation:
        this rank's shard of each unit that forward gathers (its own units stay as they are)."""
        control = self.control
        groups = self.groups
        with control.call(EVAL_FORWARD):
            control.serve_gathers(lambda i: (groups[i].param_shard, groups[i].comm.group))

    @host_only
    def pre_backward(self, u: Unit) -> None:
        if torch.is_grad_enabled():  # backward(create_graph=True) runs its graph with grad mode on
            raise RuntimeError(
                "a double backward (backward(create_graph=True), torch.autograd.grad(..., create_graph=True)) at "
                "stage 3: each unit's gradient is reduced to shards and its parameters freed as its backward ends, "
                "so no graph of the gradient can be kept; use stage 2 (parameters stay whole), or compute the "
                "gradient penalty outside the engine")
        i = u.index
        if not u.pre_backward():
            return
        self.machine.backward_started()
        self.ensure_gathered(u)
        if self.prefetch:
            nxt = self.next_bwd.get(i)
            if nxt is not None and not nxt.gathered and nxt.bwd.phase is Phase.WAITING:
                self.gather(nxt, async_op=True)
        u.bwd.bwd_event = self.recorder.begin(f"backward {u.label}", COMPUTE, unit=u.label)

    # A unit's backward is over when (a) every trainable parameter's gradient is accumulated and
    # (b) the gradient w.r.t. its inputs is computed — (b) matters when a parameter without
    # gradient (frozen) is still needed after the last trainable one, e.g. a frozen norm weight
    # at the start of a block. Units whose inputs need no gradient rely on (a); the end-of-backward
    # callback catches whatever got no gradient at all.
    @host_only
    def grad_ready(self, u: Unit, j: int, param: nn.Parameter) -> None:
        self.machine.backward_started()
        self.machine.bound_in_flight(u)
        if u.grad_ready(j, param):  # into the unit's gradient buffer; .grad is dropped at once
            self.post_backward(u)

    @host_only
    def inputs_grad(self, u: Unit, token: int) -> None:
        if u.inputs_grad(token):
            self.post_backward(u)

    @host_only
    def post_backward(self, u: Unit) -> None:
        """A unit's gradients are final: ReduceScatter them (async), free its parameters."""
        if u.post_backward() is None:  # (parameters without a gradient in this backward: zeros)
            return
        ev = u.bwd.bwd_event
        if ev is not None:
            self.recorder.end(ev)
            u.bwd.bwd_event = None
        if u.trainable:  # every rank reduces every unit that ran, used or not: same collectives
            if self.reduce_this_pass:
                self.machine.launch_reduce(u)
            else:
                u.grads.end_local()  # no_sync with reduce_every_microbatch=False: keep the local sum
        self.free(u)

    def backward_end(self) -> None:
        # Units whose parameters got no (or not every) gradient in this backward.
        for u in self.groups:
            if u.bwd.phase is Phase.RUNNING or (u.bwd.phase is Phase.WAITING and u.bwd.remaining < len(u.trainable)):
                self.post_backward(u)
        self.machine.record_used()
        for u in self.groups:
            if u.gathered:
                self.free(u)
        self.machine.inflight.wait_all()
        for u in self.groups:
            u.reset_backward()

    def backward_abandoned(self) -> None:
        """A backward raised: free whatever it had gathered; the next forward starts afresh."""
        self.abort_forward()

    def abort_forward(self) -> None:
        self.forwarding = False
        stack, self.evaluation = self.evaluation, None
        if stack is not None:
            with contextlib.suppress(Exception):  # the forward's own error is the one to see
                with stack:
                    if self.control.routed:
                        self.control.end_routed()
        self.deferred = None
        for u in self.groups:
            for ev in (u.bwd.fwd_event, u.bwd.bwd_event):
                if ev is not None:
                    self.recorder.end(ev)
            u.bwd.fwd_event = u.bwd.bwd_event = None
            self.free(u)

    def module_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """``model.state_dict()`` at stage 3: the module's entries are empty placeholders at rest, so
        they are replaced by the full values (``engine.state_dict()``: a collective, every rank)."""
        if self.checkpoint.raw_module_state:
            return
        full = self.full_state()
        for key in list(state_dict):
            name = key[len(prefix):]
            value = state_dict[key]
            if name in full and torch.is_tensor(value) and any(u.holds_placeholder(value) for u in self.groups):
                state_dict[key] = full[name]

    def module_load_state_dict(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                                errors) -> None:
        """``model.load_state_dict(sd)`` at stage 3: each parameter's value goes into the shard this
        rank keeps, and its key leaves the dict torch loads from (a placeholder takes no copy);
        ``_module_loaded`` then takes those keys off torch's missing list."""
        where = {id(p): (u, i) for u in self.groups for i, p in enumerate(u.params)}
        taken = self.loaded_keys
        for name, p in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if key not in state_dict or id(p) not in where:
                continue
            u, i = where[id(p)]
            value = state_dict[key]
            if u.holds_placeholder(p) and torch.is_tensor(value) and tuple(value.shape) == u.layout.slots[i].shape:
                u.write_param(i, value.detach().to(self.device))
                del state_dict[key]
                taken.add(key)

    def module_loaded(self, module, incompatible) -> None:
        taken, self.loaded_keys = self.loaded_keys, set()
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]

    # ---- gather / free / reduce ---------------------------------------------------------------
    def gather(self, u: Unit, async_op: bool) -> None:
        if not self.control.routed:  # a served evaluation's gathers are not the step's
            self.schedule.log("AG", u)
        u.gather(async_op=async_op)
        units, nbytes = self.gathered_now()
        self.peak_units = max(self.peak_units, units)
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def gathered_now(self) -> tuple[int, int]:
        """Units gathered (or gathering) now and their bytes, measured from the storages."""
        held = [u for u in self.groups if u.gathered]
        return len(held), sum(u.gathered_nbytes() for u in held)

    def ensure_gathered(self, u: Unit) -> None:
        if not u.gathered:
            self.gather(u, async_op=False)
        else:
            u.wait_gather()

    def free(self, u: Unit) -> None:
        u.free()

    def cast_inputs(self, args, kwargs):
        if not self.dtypes.cast_inputs:
            return None
        dt = self.dtypes.param
        return cast_floats(args, dt), cast_floats(kwargs, dt)


    def free_all(self) -> None:
        for u in self.groups:
            self.free(u)
        self.deferred = None

    def take_peak(self) -> tuple[int, int]:
        """The most units (and bytes) gathered at once since the last call; the count starts again
        from what is gathered now."""
        peak = self.peak_units, self.peak_bytes
        self.peak_units, self.peak_bytes = self.gathered_now()
        return peak


class _InputsGradient(torch.autograd.Function):
    """Identity on a unit's inputs; its backward tells the engine the unit's backward is over."""

    @staticmethod
    def forward(ctx, engine: "weakref.ref[UnitHooks]", unit: int, token: int, *inputs: torch.Tensor):
        ctx.engine, ctx.unit, ctx.token = engine, unit, token
        # The graph dropped without a backward (its loss discarded): the unit stops waiting for it.
        weakref.finalize(ctx, _drop_token, engine, unit, token)
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        eng = ctx.engine()
        if eng is not None:
            eng.inputs_grad(eng.groups[ctx.unit], ctx.token)
        return (None, None, None) + grads


def _drop_token(engine: "weakref.ref[UnitHooks]", unit: int, token: int) -> None:
    eng = engine()
    if eng is not None:
        eng.groups[unit].bwd.pending_inputs.discard(token)


@host_only
def _engine_hook(ref: "weakref.ref[UnitHooks]", method: str, *args):
    """A module hook of stage 3's, holding its :class:`UnitHooks` weakly (``del engine`` frees it)."""
    eng = ref()
    return None if eng is None else getattr(eng, method)(*args)


@host_only
def _watch_hook(ref: "weakref.ref[UnitHooks]", index: int, name: str):
    """The first training forward's check on a unit's inner module (:meth:`UnitHooks.module_runs`);
    a forward being compiled skips it (no graph break: the check is for eager scripts)."""
    def hook(module, args):
        if torch.compiler.is_compiling():
            return None
        eng = ref()
        if eng is None or not eng.watching:
            return None
        return eng.module_runs(index, name, module, args)
    return hook


@host_only
def _unit_hook(ref: "weakref.ref[UnitHooks]", method: str, index: int, skip: int, *args):
    """A unit's forward hook: ``method(unit, *args[skip:])`` (the module and, after forward, its
    inputs left out), holding the engine weakly."""
    eng = ref()
    return None if eng is None else getattr(eng, method)(eng.groups[index], *args[skip:])
