"""The step machine of every stage: where a step is, and what moves it on (guide §12.4, §12.5, §12.9).

:class:`StepMachine` is the part of :class:`~zerodp.engine.base.StageEngine` that runs a step
over ``self.groups`` once they exist: the step's state (:class:`~zerodp.engine.states.StepState`, one value, checked
transitions), the start and end of a backward (an autograd-engine callback), a backward that
raised, the one queue of gradient collectives in flight and its bound, finishing the gradient
sync, the master optimizer step on fp32 gradients, publishing parameters, zeroing, the
used-parameter flags that implement torch's ``.grad is None`` rule, and the
:class:`~zerodp.engine.grads.ShardedGrad` s that torch's clipping reads. The stage classes fill
in ``_on_backward_end``, ``_local_used`` and friends (:mod:`zerodp.engine.reducer`,
:mod:`zerodp.engine.fsdp`).
"""

from __future__ import annotations

import torch

from zerodp.engine.grads import ShardedGrad
from zerodp.engine.group import FlatGroup
from zerodp.engine.states import STEP_MOVES, GradState, StepState, moved
from zerodp.engine.trace import COMPUTE

#: gradient reductions allowed in flight before the oldest is waited for (bounds transient buffers)
MAX_REDUCE_IN_FLIGHT = 2
#: the most fp32 gradient bytes cast at once for the optimizer step (see ``_optimizer_step``)
STEP_BATCH_BYTES = 16 * 1024 * 1024


class StepMachine:
    """The step over the flat groups (module docstring); mixed into every stage engine."""

    def _move(self, to: StepState) -> None:
        self.step_state = moved(STEP_MOVES, self.step_state, to, "engine state")

    def _check_not_failed(self, call: str) -> None:
        """A backward that raised before its end (anomaly mode, an OOM caught by the script) left
        this step's gradients partial: say so, and what to call, instead of training on them."""
        if self.step_state is StepState.BACKWARD:
            raise RuntimeError(
                f"engine.{call}(): the last backward raised before it finished, so this step's gradients are "
                "partial on this rank; call optimizer.zero_grad() (or engine.zero_grad()) to drop them, then run "
                "the step again")

    def _backward_started(self) -> None:
        """Call from gradient hooks: arms ``_on_backward_end`` once per backward pass."""
        if self.step_state is not StepState.BACKWARD:
            if self._grads_under_sharded:
                self._reconcile_grads()  # (stage 3's unit hooks come first) before autograd accumulates
            self._move(StepState.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _on_output_grad(self, grad):
        if self._grads_under_sharded and self.step_state is not StepState.BACKWARD:
            self._reconcile_grads()  # before autograd accumulates into any parameter's .grad
        if self._backward_event is None:
            self._backward_event = self.recorder.begin("backward", COMPUTE)
        return None

    def _backward_end(self) -> None:
        self._move(StepState.ACCUMULATED)
        if self._backward_event is not None:
            self.recorder.end(self._backward_event)
            self._backward_event = None
        self._on_backward_end()
        self._attach_sharded_grads()  # the module shows the reduced gradients after every backward

    def _abandon_backward(self) -> None:
        """zero_grad after a raised backward: the stage completes the collectives the backward
        would have launched, so that every rank has issued the same ones whatever its data did
        before the raise; wait for them, reset every group's backward state, and leave the
        gradients to ``_zero_grad``, which drops them."""
        if self._backward_event is not None:
            self.recorder.end(self._backward_event)
            self._backward_event = None
        self._on_backward_abandoned()
        self._inflight.wait_all()
        for g in self.groups:
            g.reset_backward()
        self._move(StepState.IDLE)

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

    def _bound_in_flight(self, g: FlatGroup) -> None:
        """Before a group allocates gradients for a reduction: wait for the oldest collectives
        while ``MAX_REDUCE_IN_FLIGHT`` are in flight, so that transient gradient buffers are
        bounded by the groups in flight, not by the model (guide §9.2)."""
        if not g.grads.holds_grads:
            while len(self._inflight) >= MAX_REDUCE_IN_FLIGHT:
                self._inflight.wait_oldest()

    def _launch_reduce(self, g: FlatGroup) -> None:
        self._inflight.add(*g.grads.reduce(self._token_factor()))
        held = (sum(t.untyped_storage().nbytes() for g in self.groups for t in g.grads.comm_tensors())
                + sum(st.nbytes() for st in self._grad_pool.free))
        self._comm_peak = max(self._comm_peak, held)

    def _finish_grad_sync(self) -> None:
        """Wait for every gradient collective; groups still holding local gradients of a
        ``no_sync`` backward (the step's last micro-batch ran inside it) are reduced now, on every
        rank alike, at every stage — stage 0 included, where DDP would step each replica on its own
        gradients and let them drift apart. Then the released gradient storages are freed: the
        optimizer step creates its states next, and nothing reduces again before the next backward.
        What the script did to ``.grad`` meanwhile (``model.zero_grad()``) is read back first."""
        if any(g.grads.has_local for g in self.groups):
            self._reconcile_grads()
        self._inflight.wait_all()
        pending = [g for g in self.groups if g.grads.has_local]
        for g in pending:
            self._launch_reduce(g)
        self._inflight.wait_all()
        self._grad_pool.clear()

    def _master_grads(self) -> list[torch.Tensor | None]:
        grads = {id(g): g.grads.read() for g in self.groups}
        return [None if grads[id(g)] is None else grads[id(g)][lo:hi] for g, lo, hi in self._target_slices]

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
        cast = any(g is not None and g.dtype != self.master_dtype for g in grads)
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

    def _publish_params(self) -> None:
        """After the step, the compute parameters ← the master, in the order the next forward
        needs them (the last bucket holds the first layers; guide §9.1 step 5)."""
        for g in reversed(self.groups):
            pending = g.publish()
            if pending is not None:
                self._param_gathers.add(pending)

    def _wait_params(self) -> None:
        self._param_gathers.wait_all()
        for g in self.groups:
            g.wait_gather()  # GATHERING -> GATHERED (the work itself is done)

    def _zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            g.grads.zero(set_to_none)

    def _record_used(self) -> None:
        """End of a backward: note which parameters got a gradient (for the step's used-flags)."""
        used = self._step_used
        for g, index in zip(self.groups, self._used_index):
            for fired, i in zip(g.bwd.fired, index):
                if fired:
                    used[i] = True
        # A gradient the script dropped has one again on every rank once a backward reduced it (or
        # will, at the step): whether any rank's data used it is the used-flags' exchange to say
        self._dropped.clear()

    def _reset_used(self) -> None:
        self._step_used = [False] * len(self.named_params)

    def _local_used(self) -> list[bool] | None:
        """Per trainable parameter (``named_params`` order): did this rank compute a gradient
        for it in any backward of this step? None when every parameter must be used (an unused
        one is an error raised at backward), so no exchange is needed."""
        return None

    def _step_unused(self) -> set[str]:
        """Names of the parameters no rank used this step (one small AllReduce, MAX = OR)."""
        used = self._local_used()
        if used is None:
            return set()
        flags = torch.tensor([1.0 if u else 0.0 for u in used], device=self.device)
        if self.world_size > 1:
            self.comm.all_reduce_max(flags, "used_params")
        return {n for (n, _), f in zip(self.named_params, flags.tolist()) if f == 0.0}

    def _attach_sharded_grads(self) -> None:
        """After a backward whose gradients were reduced (and on ``engine.parameters()``), the
        module's parameters show them in torch's terms (guide §12.9): where no module tensor holds
        the reduced gradient (a shard of its own, stages 1-3) ``param.grad`` becomes a
        :class:`ShardedGrad` of this rank's slice, as FSDP2's DTensor gradient is. Local: nothing
        is attached while a group still holds unreduced gradients (that would need a collective)."""
        if self.step_state not in (StepState.ACCUMULATED, StepState.STEPPED, StepState.IDLE) \
                or not self.policy.shard_master or self._grads_under_sharded \
                or any(g.grads.has_local for g in self.groups):
            return
        self._inflight.wait_all()
        with torch.inference_mode(False):  # (after a forward under inference_mode: normal tensors still)
            self._attach_shards()

    def _attach_shards(self) -> None:
        for g in self.groups:
            if g.grads.shard_in_full or g.grads.state not in (GradState.REDUCED, GradState.ZEROS):
                continue
            lo, hi = g.shard_range
            full = g.grads.full_local()
            for i in g.trainable:
                slot, p = g.layout.slots[i], g.params[i]
                a, b = max(slot.offset, lo), min(slot.stop, hi)
                local = g.grads.grad_shard[a - lo:b - lo] if a < b else g.grads.grad_shard[:0]
                sharded = ShardedGrad(p, local, g.comm, also=None if full is None else full[slot.offset:slot.stop])
                self._grads_under_sharded[id(p)] = (p.grad, sharded)
                p.grad = sharded

    def _reconcile_grads(self) -> None:
        """Read the module's ``.grad`` back before anything uses the engine's gradients (a forward,
        a backward, a clip, ``step``): ``model.zero_grad()`` or ``p.grad = None`` drops a reduced
        gradient, ``p.grad.zero_()`` zeroes it (torch then still applies the zeros), ``p.grad = t``
        replaces it — exactly as torch's optimizers would see it (guide §12.9). The sharded gradients
        come off the parameters again, so that the next backward accumulates as before."""
        attached, self._grads_under_sharded = self._grads_under_sharded, {}
        if self.step_state is StepState.BACKWARD:
            for g in self.groups:  # (a backward in progress: only put back what was under)
                for p in g.trainable_params:
                    if id(p) in attached:
                        p.grad = attached[id(p)][0]
            return
        for g in self.groups:
            g.take_rebound()  # a rebound p.data (of another dtype too) before .grad is set
        for g, index in zip(self.groups, self._used_index):
            if g.grads.state is GradState.NONE:
                continue
            for j, i in enumerate(g.trainable):
                p = g.params[i]
                entry = attached.get(id(p))
                expected = entry[1] if entry is not None else g.grads.held_grad(j)
                if entry is not None:
                    seen, p.grad = p.grad, entry[0]
                else:
                    seen = p.grad
                if expected is None or seen is expected:
                    continue
                if seen is None:
                    g.grads.drop(j)
                    self._dropped.add(g.names[i])
                    self._step_used[index[j]] = False  # as zero_grad: used again only by a later backward
                else:
                    g.grads.write(j, seen)
                    self._dropped.discard(g.names[i])
                    if entry is None and expected is not None:
                        p.grad = expected
            if all(n in self._dropped for n in (g.names[i] for i in g.trainable)):
                g.grads.zero(set_to_none=True)  # model.zero_grad(): as engine.zero_grad() for this group

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for g in self.groups:
            for kind, tensors in g.memory().items():
                out.setdefault(kind, []).extend(tensors)
        out.setdefault("comm_buffers", []).extend(torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
                                                  for st in self._grad_pool.free)
        return out


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs hooks (its own or torch's global ones)."""
    from torch.optim import optimizer as torch_optimizer

    from zerodp.engine.adopt import is_adoption_hook

    hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or any(not is_adoption_hook(h) for h in hooks))
