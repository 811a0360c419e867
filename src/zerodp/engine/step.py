"""The step machine of every stage: where a step is, and what moves it on (guide §12.4, §12.5, §12.9).

:class:`StepMachine` is the part of :class:`~zerodp.engine.base.StageEngine` that runs a step
over ``self.groups`` once they exist: the step's state (:class:`~zerodp.engine.states.StepState`, one value, checked
transitions), the start and end of a backward (an autograd-engine callback), a backward that
raised, the one queue of gradient collectives in flight and its bound, finishing the gradient
sync, the master optimizer step on fp32 gradients, publishing parameters, zeroing, the
used-parameter flags that implement torch's ``.grad is None`` rule, and the
:class:`~zerodp.engine.grads.ShardedGrad` s that torch's clipping reads. The stage classes fill
in the hooks a backward ends with (``engine.hooks``), ``_local_used`` and ``_step_unused``
(:mod:`zerodp.engine.reducer`,
:mod:`zerodp.engine.fsdp`).
"""

from __future__ import annotations

from typing import Callable

import torch

from zerodp.engine.comm import InFlight
from zerodp.engine.gradbuf import StoragePool
from zerodp.engine.grads import ShardedGrad
from zerodp.engine.group import FlatGroup
from zerodp.engine.states import STEP_MOVES, GradState, StepState, moved
from zerodp.engine.trace import COMPUTE

#: gradient reductions allowed in flight before the oldest is waited for (bounds transient buffers)
MAX_REDUCE_IN_FLIGHT = 2


class StepMachine:
    """The step over the flat groups (module docstring): one part of every stage engine
    (``engine.machine``), which owns the step's state and the queues below. It is built before the
    groups exist, from what it talks through (the recorder, the job's collectives, the policy);
    :meth:`bind` gives it the groups, the optimizer part and the stage's hooks once the stage built
    them, and the hooks' ``backward_end`` / ``backward_abandoned`` are called from here."""

    def __init__(self, recorder, comm, world_size: int, *, policy, device: torch.device, average_by_tokens: bool):
        self.recorder = recorder
        self.comm = comm  # the ranks a gradient is averaged over: the token count crosses them
        self.shard_master = policy.shard_master
        self.device = device
        self.world_size = world_size  # their number
        self.average_by_tokens = average_by_tokens
        self.groups: list[FlatGroup] = []
        self.master = None  # the optimizer part (zerodp.engine.master.MasterOptimizer): StageEngine.build_master
        self.hooks = None  # the stage's: BucketHooks (stages 0-2) or UnitHooks (stage 3)
        self.master_dtype: torch.dtype | None = None
        self.used_index: list[list[int]] = []  # per group, per trainable parameter: its used-flag
        self.n_params = 0
        self.state = StepState.IDLE
        self.sync = True  # False inside no_sync(): gradients accumulate locally (guide §5)
        self.sync_at_forward = True  # what sync was at the forward the backward belongs to
        self.unused: set[str] = set()  # parameters no rank used in this step (their .grad is None)
        self.inflight = InFlight()  # gradient collectives issued, not yet waited for
        self.param_gathers = InFlight()  # stages 1-2: parameter AllGathers after the step
        self.grad_pool = StoragePool(MAX_REDUCE_IN_FLIGHT)  # released transient gradient buffers
        self.comm_peak = 0  # most bytes of transient gradient buffers alive at once, this step
        self.tokens = 0.0  # this rank's tokens in this step (average_by_tokens, guide §2.2)
        self.token_factor_value: float | None = None
        self.dropped: set[str] = set()  # reduced gradients the script set to None (model.zero_grad())
        self.grads_under_sharded: dict[int, tuple] = {}  # id(param) -> (.grad under it, its ShardedGrad)
        self.backward_event = None
        self.step_used: list[bool] = []  # per trainable parameter: a gradient in this step's backwards
        #: stage 3 logs each ReduceScatter in its unit schedule (zerodp.engine.schedule)
        self.on_launch: Callable[[FlatGroup], None] | None = None

    def bind(self, groups: list[FlatGroup], hooks, names: list[str], master_dtype: torch.dtype) -> None:
        """The stage built its groups, hooks and optimizer part: the machine steps them from now on.
        ``names``: the trainable parameters in order; each group's used-flags index into them."""
        self.groups, self.hooks, self.master_dtype = groups, hooks, master_dtype
        position = {n: i for i, n in enumerate(names)}
        self.used_index = [[position[g.names[i]] for i in g.trainable] for g in groups]
        self.n_params = len(names)
        self.reset_used()

    def move(self, to: StepState) -> None:
        self.state = moved(STEP_MOVES, self.state, to, "engine state")

    def check_not_failed(self, call: str) -> None:
        """A backward that raised before its end (anomaly mode, an OOM caught by the script) left
        this step's gradients partial: say so, and what to call, instead of training on them."""
        if self.state is StepState.BACKWARD:
            raise RuntimeError(
                f"engine.{call}(): the last backward raised before it finished, so this step's gradients are "
                "partial on this rank; call optimizer.zero_grad() (or engine.zero_grad()) to drop them, then run "
                "the step again")

    def backward_started(self) -> None:
        """Call from gradient hooks: arms ``backward_end`` once per backward pass."""
        if self.state is not StepState.BACKWARD:
            if self.grads_under_sharded:
                self.reconcile_grads()  # (stage 3's unit hooks come first) before autograd accumulates
            self.move(StepState.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_end)

    def on_output_grad(self, grad):
        if self.grads_under_sharded and self.state is not StepState.BACKWARD:
            self.reconcile_grads()  # before autograd accumulates into any parameter's .grad
        if self.backward_event is None:
            self.backward_event = self.recorder.begin("backward", COMPUTE)
        return None

    def backward_end(self) -> None:
        self.move(StepState.ACCUMULATED)
        if self.backward_event is not None:
            self.recorder.end(self.backward_event)
            self.backward_event = None
        self.hooks.backward_end()
        self.attach_sharded_grads()  # the module shows the reduced gradients after every backward

    def abandon_backward(self) -> None:
        """zero_grad after a raised backward: the stage completes the collectives the backward
        would have launched, so that every rank has issued the same ones whatever its data did
        before the raise; wait for them, reset every group's backward state, and leave the
        gradients to ``zero_grads``, which drops them."""
        if self.backward_event is not None:
            self.recorder.end(self.backward_event)
            self.backward_event = None
        self.hooks.backward_abandoned()
        self.inflight.wait_all()
        for g in self.groups:
            g.reset_backward()
        self.move(StepState.IDLE)

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
        self.tokens += float(n)

    def token_factor(self) -> float | None:
        """Guide §2.2: factor to pre-multiply local gradients with before a mean reduction, so that
        the mean over ranks becomes Σ_r n_r g_r / Σ_r n_r. None when averaging plainly."""
        if not self.average_by_tokens:
            return None
        if self.token_factor_value is None:
            if self.tokens <= 0:
                raise RuntimeError(
                    "average_by_tokens=True but this rank counted no tokens this step: call "
                    "engine.count_tokens(n) for every micro-batch before its backward"
                )
            total = self.comm.all_reduce_sum(torch.tensor([self.tokens], dtype=torch.float64,
                                                          device=self.device), "token_count")
            self.token_factor_value = self.tokens * self.world_size / float(total[0])
        return self.token_factor_value

    def bound_in_flight(self, g: FlatGroup) -> None:
        """Before a group allocates gradients for a reduction: wait for the oldest collectives
        while ``MAX_REDUCE_IN_FLIGHT`` are in flight, so that transient gradient buffers are
        bounded by the groups in flight, not by the model (guide §9.2)."""
        if not g.grads.holds_grads:
            while len(self.inflight) >= MAX_REDUCE_IN_FLIGHT:
                self.inflight.wait_oldest()

    def launch_reduce(self, g: FlatGroup) -> None:
        if self.on_launch is not None:
            self.on_launch(g)
        self.inflight.add(*g.grads.reduce(self.token_factor()))
        held = (sum(t.untyped_storage().nbytes() for g in self.groups for t in g.grads.comm_tensors())
                + sum(st.nbytes() for st in self.grad_pool.free))
        self.comm_peak = max(self.comm_peak, held)

    def finish_grad_sync(self) -> None:
        """Wait for every gradient collective; groups still holding local gradients of a
        ``no_sync`` backward (the step's last micro-batch ran inside it) are reduced now, on every
        rank alike, at every stage — stage 0 included, where DDP would step each replica on its own
        gradients and let them drift apart. Then the released gradient storages are freed: the
        optimizer step creates its states next, and nothing reduces again before the next backward.
        What the script did to ``.grad`` meanwhile (``model.zero_grad()``) is read back first."""
        if any(g.grads.has_local for g in self.groups):
            self.reconcile_grads()
        self.inflight.wait_all()
        pending = [g for g in self.groups if g.grads.has_local]
        for g in pending:
            self.launch_reduce(g)
        self.inflight.wait_all()
        self.grad_pool.clear()

    def master_grads(self) -> list[torch.Tensor | None]:
        grads = {id(g): g.grads.read() for g in self.groups}
        return [None if grads[id(g)] is None else grads[id(g)][lo:hi] for g, lo, hi in self.master.target_slices]

    def optimizer_step(self) -> None:
        """The optimizer part steps the master on the step's fp32 gradients
        (:meth:`zerodp.engine.master.MasterOptimizer.step_on`), then the compute parameters follow."""
        self.master.step_on(self.master_grads(), self.unused, self.master_dtype)
        self.publish_params()

    def publish_params(self) -> None:
        """After the step, the compute parameters ← the master, in the order the next forward
        needs them (the last bucket holds the first layers; guide §9.1 step 5)."""
        for g in reversed(self.groups):
            pending = g.publish()
            if pending is not None:
                self.param_gathers.add(pending)

    def wait_params(self) -> None:
        self.param_gathers.wait_all()
        for g in self.groups:
            g.wait_gather()  # GATHERING -> GATHERED (the work itself is done)

    def zero_grads(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.grads.zero(set_to_none)

    def record_used(self) -> None:
        """End of a backward: note which parameters got a gradient (for the step's used-flags)."""
        used = self.step_used
        for g, index in zip(self.groups, self.used_index):
            for fired, i in zip(g.bwd.fired, index):
                if fired:
                    used[i] = True
        # A gradient the script dropped has one again on every rank once a backward reduced it (or
        # will, at the step): whether any rank's data used it is the used-flags' exchange to say
        self.dropped.clear()

    def reset_used(self) -> None:
        self.step_used = [False] * self.n_params

    def attach_sharded_grads(self) -> None:
        """After a backward whose gradients were reduced (and on ``engine.parameters()``), the
        module's parameters show them in torch's terms (guide §12.9): where no module tensor holds
        the reduced gradient (a shard of its own, stages 1-3) ``param.grad`` becomes a
        :class:`ShardedGrad` of this rank's slice, as FSDP2's DTensor gradient is. Local: nothing
        is attached while a group still holds unreduced gradients (that would need a collective)."""
        if self.state not in (StepState.ACCUMULATED, StepState.STEPPED, StepState.IDLE) \
                or not self.shard_master or self.grads_under_sharded \
                or any(g.grads.has_local for g in self.groups):
            return
        self.inflight.wait_all()
        with torch.inference_mode(False):  # (after a forward under inference_mode: normal tensors still)
            self.attach_shards()

    def attach_shards(self) -> None:
        for g in self.groups:
            if g.grads.shard_in_full or g.grads.state not in (GradState.REDUCED, GradState.ZEROS):
                continue
            lo, hi = g.shard_range
            full = g.grads.full_local()
            for i in g.trainable:
                slot, p = g.layout.slots[i], g.params[i]
                a, b = max(slot.offset, lo), min(slot.stop, hi)
                local = g.grads.grad_shard[a - lo:b - lo] if a < b else g.grads.grad_shard[:0]
                sharded = ShardedGrad(p, local, g.comm, also=None if full is None else full[slot.offset:slot.stop],
                                      mine=None if full is None else full[a:b] if a < b else full[:0])
                self.grads_under_sharded[id(p)] = (p.grad, sharded)
                p.grad = sharded

    def reconcile_grads(self) -> None:
        """Read the module's ``.grad`` back before anything uses the engine's gradients (a forward,
        a backward, a clip, ``step``): ``model.zero_grad()`` or ``p.grad = None`` drops a reduced
        gradient, ``p.grad.zero_()`` zeroes it (torch then still applies the zeros), ``p.grad = t``
        replaces it — exactly as torch's optimizers would see it (guide §12.9). The sharded gradients
        come off the parameters again, so that the next backward accumulates as before."""
        attached, self.grads_under_sharded = self.grads_under_sharded, {}
        if self.state is StepState.BACKWARD:
            for g in self.groups:  # (a backward in progress: only put back what was under)
                for p in g.trainable_params:
                    if id(p) in attached:
                        p.grad = attached[id(p)][0]
            return
        for g in self.groups:
            g.take_rebound()  # a rebound p.data (of another dtype too) before .grad is set
        for g, index in zip(self.groups, self.used_index):
            own = []  # gradients the script assigned where no backward put one (after torch.autograd.grad)
            for j, i in enumerate(g.trainable):
                p = g.params[i]
                entry = attached.get(id(p))
                expected = entry[1] if entry is not None else g.grads.held_grad(j)
                if entry is not None:
                    seen, p.grad = p.grad, entry[0]
                else:
                    seen = p.grad
                if seen is not None and seen is not expected and not self.step_used[index[j]]:
                    own.append((j, seen))
                    continue
                if g.grads.state is GradState.NONE or expected is None or seen is expected:
                    continue
                if seen is None:
                    g.grads.drop(j)
                    self.dropped.add(g.names[i])
                    self.step_used[index[j]] = False  # as zero_grad: used again only by a later backward
                else:
                    g.grads.write(j, seen)
                    self.dropped.discard(g.names[i])
                    if entry is None and expected is not None:
                        p.grad = expected
            if own:
                self.take_own(g, index, own)
            elif all(n in self.dropped for n in (g.names[i] for i in g.trainable)):
                g.grads.zero(set_to_none=True)  # model.zero_grad(): as engine.zero_grad() for this group

    def take_own(self, g: FlatGroup, index: list[int], own: list[tuple[int, torch.Tensor]]) -> None:
        """``p.grad = t`` on a parameter no backward gave a gradient since ``zero_grad`` (the script
        ran ``torch.autograd.grad`` and assigned the result): ``t`` is this rank's own gradient, as a
        backward's would be, so it goes into the local gradients and the step averages it over the
        ranks (guide §2: the data-parallel mean). Trainable parameters assigned nothing stay
        without a gradient (torch does not step them)."""
        assigned = {j for j, _ in own}
        if g.grads.state in (GradState.NONE, GradState.ZEROS):
            for j, i in enumerate(g.trainable):
                if j not in assigned and not self.step_used[index[j]]:
                    self.dropped.add(g.names[i])
        g.grads.add_own(own)
        for j, _ in own:
            self.step_used[index[j]] = True
            self.dropped.discard(g.names[g.trainable[j]])

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for g in self.groups:
            for kind, tensors in g.memory().items():
                out.setdefault(kind, []).extend(tensors)
        out.setdefault("comm_buffers", []).extend(torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
                                                  for st in self.grad_pool.free)
        return out
