"""Stages 0-2: gradient hooks fill buckets; each full bucket launches its collective.

Guide §3: a parameter's gradient is final as soon as its post-accumulate-grad hook fires, so its
communication can start right away while backward computes earlier layers. Guide §4: the hooks
only count down a bucket; when the bucket's last gradient arrived, one collective is launched
for the whole bucket. A bucket is a :class:`~zerodp.engine.group.FlatGroup` and the collective is
its gradients' :meth:`~zerodp.engine.gradbuf.GradBuffers.reduce` — an AllReduce at stage 0, a ReduceScatter at
stages 1-2, chosen by the stage's :class:`~zerodp.engine.config.Policy` (guide §12.2).

Rules that keep every rank in step (a mismatch would hang, guide §12):

- buckets are launched strictly in bucket order: bucket i only after buckets 0..i-1, even if
  it fills first (as DDP's reducer does);
- at the end of backward (an autograd-engine callback, queued by the first hook) every bucket
  not yet launched is launched, in order, then all collectives are waited for — so gradients
  are final when ``loss.backward()`` returns, as with DDP;
- a parameter that got no gradient in a synchronizing backward is an error naming it, raised
  after its bucket was still launched on this rank so the other ranks do not hang; with
  ``find_unused_parameters=True`` it contributes zeros on this rank (its bucket is launched at
  the end of backward). A parameter that *no* rank used in any backward of the step is skipped
  by the optimizer — no weight decay, no moment update, no step count — as with DDP, where its
  ``.grad`` stays None (one small AllReduce of a used-flag per parameter at ``step()``).

Inside ``no_sync()`` (guide §5) the hooks launch nothing and gradients accumulate locally —
except at stage 2 with ``reduce_every_microbatch=True`` (memory first), which reduces every
micro-batch into its gradient shard.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from zerodp.engine.base import StageEngine, grad_hook, remove_hooks
from zerodp.engine.buckets import cast_floating_buffers
from zerodp.engine.compiled import host_only
from zerodp.engine.config import AUTO, EngineConfig, resolve_auto_bucket
from zerodp.engine.deferred import materialize_module
from zerodp.engine.group import FlatGroup
from zerodp.engine.optimizer_plan import OptimizerFactory
from zerodp.engine.states import Phase, StepState


class BucketEngine(StageEngine):
    """Stages 0-2: parameters in bucketed flat groups, one collective per bucket."""

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, config: EngineConfig,
                 units: list[nn.Module] | None = None, group=None):
        super().__init__(module, optimizer_factory, config, units=units, group=group)
        if self.deferred:  # every rank keeps every parameter: allocate and initialize the whole model
            materialize_module(module, self.device, config.init_fn, config.init_seed)
        # bucket_mb="auto" (guide §4): chosen once, here, before the buckets are planned.
        self.bucket_auto = config.bucket_mb == AUTO
        wire = torch.float32 if self.policy.full_grads and self.dtypes.accum == torch.float32 else self.dtypes.reduce
        config = self.config = resolve_auto_bucket(config, module, self.world_size, self.dtypes.param, wire)
        plan = self.construction.buckets(config, self.optimizer_plan, self.dtypes.param)
        if self.dtypes.cast_inputs:  # buffers and frozen parameters compute in the param dtype too
            cast_floating_buffers(module, self.dtypes.param)
            with torch.no_grad():
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(self.dtypes.param)
        self.groups: list[FlatGroup] = [
            self.construction.new_group(b, f"bucket {b}", [(self.named_params[i][0], self.named_params[i][1],
                                                            self.optimizer_plan.group_of[i]) for i in idx],
                                        self.optimizer_plan, self.dtypes)
            for b, idx in enumerate(plan)]
        self.construction.check_consistency(self._description())
        frozen = [p for p in module.parameters() if not p.requires_grad]
        self.construction.init_groups(self.groups, self.dtypes.master,
                                      extra_broadcast=frozen + [b for b in module.buffers()])
        # the gradient hooks and the backward's bucket state
        self.hooks = BucketHooks(self.groups, self.machine, self.policy, config.sync, config.find_unused_parameters,
                                 owner=self)
        self.finish_construction()

    def _local_used(self) -> list[bool] | None:
        """Per trainable parameter (``named_params`` order): did this rank compute a gradient for
        it in any backward of this step? None when every parameter must be used (an unused one is
        an error raised at backward), so no exchange is needed."""
        return list(self.machine.step_used) if self.config.find_unused_parameters else None

    def _step_unused(self) -> set[str]:
        """Names of the parameters no rank used this step (one small AllReduce, MAX = OR)."""
        used = self._local_used()
        if used is None:
            return set()
        flags = torch.tensor([1.0 if u else 0.0 for u in used], device=self.device)
        if self.world_size > 1:
            self.comm.all_reduce_max(flags, "used_params")
        return {n for (n, _), f in zip(self.named_params, flags.tolist()) if f == 0.0}

    # ---- description for the start-up consistency check -----------------------------------------
    def _description(self) -> dict:
        return {
            "engine": type(self).__name__,
            "world_size": self.world_size,
            "sync": self.config.sync,
            "param_dtype": str(self.dtypes.param),
            "params": {n: {"shape": list(p.shape), "dtype": str(p.dtype),
                           "options": sorted(map(str, self.optimizer_plan.group_options[g].items()))}
                       for (n, p), g in zip(self.named_params, self.optimizer_plan.group_of)},
            "param_order": [n for n, _ in self.named_params],
            "buckets": [g.describe() for g in self.groups],
        }


class BucketHooks:
    """Stages 0-2: the gradient hooks and the state of the backward in flight (one part of
    :class:`BucketEngine`, ``engine.hooks``): a bucket counts its gradients down and, full, is
    launched in index order (guide §3: buckets in the order backward fills them)."""

    def __init__(self, groups: list[FlatGroup], machine, policy, sync: str, find_unused: bool, owner: object):
        self.groups = groups  # the buckets, in index order
        self.machine = machine  # the step machine: backward start, the queue in flight, the used-flags
        self.keep_local = policy.keep_local
        self.naive = sync == "naive"  # guide §2.5: everything waits for the end of backward
        self.find_unused = find_unused
        # Hooks: trainable parameter j of bucket g calls grad_ready(g, j); removed with ``owner``.
        handles = [p.register_post_accumulate_grad_hook(grad_hook(self, "grad_ready", i, j))
                   for i, g in enumerate(groups) for j, p in enumerate(g.trainable_params)]
        weakref.finalize(owner, remove_hooks, handles)
        self.reset_backward()

    @host_only
    def grad_ready(self, g: FlatGroup, j: int, param: nn.Parameter) -> None:
        """Hook of trainable parameter ``j`` of bucket ``g``: take its gradient, count down."""
        if self.machine.state is not StepState.BACKWARD:
            self.machine.backward_started()
            self.reducing = self.machine.sync_at_forward or not self.keep_local
        if self.reducing and not g.policy.full_grads:
            self.machine.bound_in_flight(g)
        if g.grad_ready(j, param):
            self.bucket_full(g)

    def bucket_full(self, g: FlatGroup) -> None:
        g.post_backward()
        if not self.reducing:
            g.grads.end_local()
            return
        if not self.naive:
            self.launch_ready()

    def launch_ready(self) -> None:
        """Launch, in index order, the buckets whose backward is done (while reducing, a bucket's
        ``Phase.DONE`` is what makes it ready), up to the first one still filling."""
        groups = self.groups
        while self.next < len(groups) and groups[self.next].bwd.phase is Phase.DONE:
            g = groups[self.next]
            self.next += 1
            self.machine.launch_reduce(g)

    def backward_end(self) -> None:
        self.machine.record_used()
        try:
            if self.reducing:
                missing = []
                for g in self.groups:
                    if g.bwd.phase is not Phase.DONE:
                        missing += [g.names[g.trainable[j]] for j in g.post_backward()]
                self.launch_ready()
                self.machine.inflight.wait_all()
                if missing and not self.find_unused:
                    raise RuntimeError(
                        f"parameters that require grad received no gradient in this backward: "
                        f"{missing}. Their buckets were still reduced so other ranks do not hang. If "
                        f"this is expected (conditional branches, unused heads), pass "
                        f"find_unused_parameters=True; if they are frozen, set requires_grad=False "
                        f"before parallelize()"
                    )
            else:
                # Every group ends a no_sync backward holding local gradients, on every rank alike
                # (zeros where this rank's data used none of its parameters, not stale memory), so
                # that the reduction at step(), zero_grad() or a clip covers the same groups on
                # every rank whatever each rank's data took (find_unused_parameters=True).
                for g in self.groups:
                    if g.post_backward() is not None:
                        g.grads.end_local()
        finally:
            self.reset_backward()

    def backward_abandoned(self) -> None:
        """A backward raised midway. Buckets launch in index order as they fill; a rank whose data
        used parameters another rank's did not (find_unused_parameters=True) may have launched
        more of them before the raise. Each rank launches the rest, in order, zeros where nothing
        arrived — every rank then issued every bucket's collective once, and ``zero_grad`` drops
        the results."""
        if self.reducing:
            for g in self.groups[self.next:]:
                if g.bwd.phase is not Phase.DONE:
                    self.machine.bound_in_flight(g)
                    g.post_backward()
                self.launch_ready()
        self.reset_backward()

    def reset_backward(self) -> None:
        for g in self.groups:
            g.reset_backward()
        self.next = 0  # the next bucket to launch, in index order
        self.reducing = False

    def abort_forward(self) -> None:
        """The model's forward raised: nothing of a bucket's is in flight before backward."""
