"""The flat group: one bucket (stages 0-2) or one unit (stage 3), its whole life in one object.

Guide §12.1: parameters are packed back to back into flat buffers, padded to a multiple of the
shard-group size N so that rank r owns the contiguous slice r. A *bucket* (guide §4) and an FSDP
*unit* (guide §10.3) are the same thing seen by two policies: a few parameters in one flat
buffer, whose gradients travel in one collective. A :class:`FlatGroup` owns, for its layout:

==============  ===================  ================================================================
tensor          size, dtype          lifetime
==============  ===================  ================================================================
``full``        Ψ_g, compute dtype   the parameters; module parameters are views into it. Always
                                     there when parameters are not sharded (stages 0-2); at stage 3
                                     only between :meth:`gather` and :meth:`free`
``param_shard`` Ψ_g/N, compute       this rank's slice of the parameters: a view of ``full`` (stages
                                     1-2) or its own buffer (stage 3); the AllGather's input
``master``      Ψ_g or Ψ_g/N, fp32   what the optimizer updates: the whole buffer at stage 0, slice
                                     r at stages 1-3 (= ``param_shard`` when the dtypes agree)
``grad_full``   Ψ_g, reduce dtype    local gradients. When the policy keeps full gradients
                                     ``param.grad`` views into it (as DDP's ``gradient_as_bucket_
                                     view``) from the group's first gradient of a step until
                                     ``zero_grad()``; otherwise allocated by the first gradient and
                                     released once its collective completed (guide §9.2, §12.5)
``grad_shard``  Ψ_g/N, accum dtype   the mean over ranks of slice r, accumulated across micro-
                                     batches (stages 1-3; fp32 with ``fp32_grad_accum``)
==============  ===================  ================================================================

The gradient tensors and their state are one part object, ``group.grads``
(:class:`~zerodp.engine.gradbuf.GradBuffers`); the group holds the parameters' side and the
backward state. Its operations are the three collectives of the guide, each written once for
every stage:

- ``grads.reduce`` — AllReduce of ``grad_full`` (stage 0, §3-§4) or ReduceScatter into
  ``grad_shard`` (stages 1-3, §9), straight into it when nothing is accumulated there and the
  dtypes agree, else through a shard-sized scratch that is then added (§5). Under hybrid
  sharding the shard is then averaged across the replicas (guide §14).
- :meth:`gather` / :meth:`free` — AllGather of the parameter shards into ``full`` (after the step
  at stages 1-2, before each use at stage 3) and the release of ``full`` (stage 3 only).
- :meth:`publish` — after the optimizer step, ``param_shard`` ← the fp32 master (a cast), then
  the AllGather where parameters are not sharded.

Freeing is ``untyped_storage().resize_(0)`` and re-allocating ``resize_(n)`` of the same storage
(``gradbuf.free_storage`` / ``restore_storage``; guide §12), so tensors that autograd saved in
forward (``weight.t()`` …) read the right values again in backward, and gradient views stay valid.
The stage's :class:`~zerodp.engine.config.Policy` says which of these a stage uses; there is no
other difference between a bucket and a unit.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zerodp.engine.comm import Collectives, Pending
from zerodp.engine.config import Dtypes, Policy
from zerodp.engine.gradbuf import GradBuffers, free_storage, restore_storage
from zerodp.engine.layout import FlatLayout
from zerodp.engine.states import PARAM_MOVES, BackwardState, ParamState, Phase, moved

FROZEN = -1  # param-group index of a parameter with requires_grad=False: gathered, never updated


class FlatGroup:
    """One bucket or unit on one rank: its buffers, collectives and backward state (see module)."""

    def __init__(self, index: int, label: str, entries: list[tuple[str, nn.Parameter, int]], policy: Policy,
                 comm: Collectives, *, dtypes: Dtypes, replicas: Collectives | None = None, quant_params: int = 0,
                 quant_grads: int = 0, layout: FlatLayout | None = None):
        self.index = index
        self.label = label
        self.policy = policy
        self.comm = comm  # the shard group: ReduceScatter and AllGather run here
        self.replicas = replicas  # hybrid sharding: the same shard on the other replicas (guide §14)
        self.names = [n for n, _, _ in entries]
        self.params = [p for _, p, _ in entries]
        self.groups = [g for _, _, g in entries]
        self.trainable = [i for i, g in enumerate(self.groups) if g != FROZEN]
        # Packed back to back unless given (tensor ownership: FlatLayout.owned, guide §12.3).
        self.layout = layout or FlatLayout.pack([(n, tuple(p.shape)) for n, p, _ in entries], comm.world_size)
        self.rank = comm.rank
        self.device = self.params[0].device
        self.dtypes = dtypes  # the engine's: compute, on the wire, accumulated (guide §9)
        self.quant_params = quant_params  # int8 AllGather with one scale per this many elements (§15)
        self.quant_grads = quant_grads  # int8 all-to-all gradient reduction, same
        self.module: nn.Module | None = None  # stage 3: the module whose forward gathers this unit
        self.bwd = BackwardState()
        self.bwd.reset(len(self.trainable))
        # Set by init_values / grads.init.
        self.full: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.master_start = 0  # where ``master`` starts in the layout
        self.param_state = ParamState.SHARDED  # GATHERED from init_values where parameters are not sharded
        self._gather_work: Pending | None = None  # the AllGather in flight, while GATHERING
        # The outer loop (zerodp.engine.outer) rewrites this group's master right after the inner
        # step: publish waits for it, so the parameters are gathered once, with the outer update.
        self.held = False
        self.grads = GradBuffers(  # the gradient half: buffers, reductions, GradState
            label, self.layout, policy, comm, replicas=replicas, params=self.params, trainable=self.trainable,
            bwd=self.bwd, dtypes=dtypes, quant_grads=quant_grads)

    # ---- bookkeeping --------------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """Whether the full buffer is allocated and the parameters view it (gathered or gathering)."""
        return self.param_state is not ParamState.SHARDED

    def _move_params(self, to: ParamState) -> None:
        self.param_state = moved(PARAM_MOVES, self.param_state, to, f"{self.label}: parameters")

    def reset_backward(self) -> None:
        """A backward is over (or was abandoned when it raised): the next one starts afresh."""
        self.bwd.reset(len(self.trainable))

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.rank)

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [self.params[i] for i in self.trainable]

    def views(self, flat: torch.Tensor, which: list[int] | None = None) -> list[torch.Tensor]:
        """Each parameter's view into a flat buffer of this layout (``which``: indices)."""
        slots = self.layout.slots
        return [flat[slots[i].offset:slots[i].stop].view(slots[i].shape)
                for i in (range(len(slots)) if which is None else which)]

    def describe(self) -> dict:
        return {"label": self.label, "groups": sorted(set(self.groups)), "dtype": str(self.dtypes.param),
                **self.layout.to_dict()}

    # ---- the group's part of a backward (guide §12.9); the stage's hooks (engine.hooks) call these
    def pre_backward(self) -> bool:
        """The gradient of a unit's outputs arrived: WAITING → RUNNING. False when its backward had
        started already (another output's gradient, or a parameter's first)."""
        if self.bwd.phase is not Phase.WAITING:
            return False
        self.bwd.move(Phase.RUNNING)
        return True

    def grad_ready(self, j: int, param: nn.Parameter) -> bool:
        """Trainable parameter ``j``'s gradient is accumulated: into the group's buffers
        (:meth:`GradBuffers.take`), counted. Returns whether the group's backward is over — every
        gradient in and, for a unit, the gradient w.r.t. its inputs computed (``pending_inputs``)."""
        self.grads.take(j, param)
        if self.bwd.phase is Phase.WAITING:  # a bucket; a unit run under no_grad, recomputed in backward
            self.bwd.move(Phase.RUNNING)
        return self.bwd.over()

    def inputs_grad(self, token: int) -> bool:
        """The gradient w.r.t. the inputs of one forward call of the unit arrived; whether the
        unit's backward is over now."""
        self.bwd.pending_inputs.discard(token)
        return self.bwd.phase is Phase.RUNNING and self.bwd.over()

    def post_backward(self) -> list[int] | None:
        """The group's gradients are final for this backward: → DONE, and a trainable parameter that
        got no gradient counts as zeros (so every rank reduces the same groups). Returns those
        parameters' indices, or None when the group's backward was over already; the stage then
        reduces the gradients or, inside ``no_sync``, keeps the local sum."""
        if self.bwd.phase is Phase.DONE:
            return None
        if self.bwd.phase is Phase.WAITING:  # no gradient at all in this backward
            self.bwd.move(Phase.RUNNING)
        self.bwd.move(Phase.DONE)
        return self.grads.fill_missing() if self.trainable else []

    # ---- parameters -----------------------------------------------------------------------------
    @torch.no_grad()
    def init_values(self, values: torch.Tensor) -> None:
        """Set up the parameter buffers and the master from ``values``, an fp32 flat tensor of the
        whole padded layout (rank 0's values, already broadcast)."""
        lo, hi = self.shard_range
        p = self.policy
        self.device = values.device  # (a model built on the meta device is materialized here)
        if not p.shard_params:
            self.full = values if self.dtypes.param == values.dtype else values.to(self.dtypes.param)
            for param, view in zip(self.params, self.views(self.full)):
                param.data = view
            self._move_params(ParamState.GATHERED)
            if not p.shard_master:
                self.master, self.master_start = values, 0  # is ``full`` itself in fp32
            else:
                # A view of the parameters where dtypes agree — unless the AllGather is quantized:
                # it writes dequantized values over this slice too, and the master stays exact.
                share = values is self.full and not self.quant_params
                self.master = values[lo:hi] if share else values[lo:hi].clone()
                self.master_start = lo
            self.param_shard = self.full[lo:hi]
            self._full_views = self.views(self.full)
        else:
            self.master, self.master_start = values[lo:hi].clone(), lo
            same = self.dtypes.param == self.master.dtype
            self.param_shard = self.master if same else self.master.to(self.dtypes.param)
            self.full = torch.empty(self.layout.padded_numel, dtype=self.dtypes.param, device=self.device)
            self._full_views = self.views(self.full)
            # At rest each parameter keeps its shape over one shared element (a stride-0 view, as
            # FSDP2's sharded DTensor keeps the global shape): p.shape, p.dim() and p.numel() stay
            # what scripts group parameters by; in-place writes to it are refused by torch itself.
            # The element is NaN: a value read from it (an EMA, a norm, ``p.data.clone()``) is loudly
            # not the parameter's, never a quiet zero, and a rebinding to such a value is refused.
            one = torch.full((), float("nan"), dtype=self.dtypes.param, device=self.device)
            self._placeholders = [one.expand(sl.shape) for sl in self.layout.slots]
            free_storage(self.full)
            for param, held in zip(self.params, self._placeholders):
                param.data = held
        self._versions = [p._version for p in self.params]

    def gather(self, async_op: bool = True) -> Pending | None:
        """``full`` ← every rank's ``param_shard`` (guide §9.1 step 5, §9.3). At stage 3 the
        storage is allocated first and the module's parameters pointed at their views. A gather
        still in flight (two steps with no forward between) is finished first."""
        self.wait_gather()
        if self.policy.shard_params:
            restore_storage(self.full)
            for param, view in zip(self.params, self._full_views):
                param.data = view
        if self.comm.world_size == 1:
            if self.policy.shard_params:
                self.full.copy_(self.param_shard)
            self._move_params(ParamState.GATHERED)
            return None
        control = self.comm.control
        if control is not None and control.routed:  # a served evaluation (zerodp.engine.control)
            control.routed_gather(self.full, self.param_shard, self.comm.group, self.index)
            self._gather_work = None
            self._move_params(ParamState.GATHERED)
            return None
        pending = self.comm.all_gather(self.full, self.param_shard, self.label, async_op=async_op,
                                       quant_block=self.quant_params)
        self._gather_work = pending if async_op else None
        self._move_params(ParamState.GATHERING if async_op else ParamState.GATHERED)
        return self._gather_work

    def wait_gather(self) -> None:
        if self.param_state is ParamState.GATHERING:
            self._gather_work.wait()
            self._gather_work = None
            self._move_params(ParamState.GATHERED)

    def free(self) -> None:
        """Stage 3: drop the gathered parameters (``resize_(0)``; the views stay, empty)."""
        if not self.policy.shard_params or not self.gathered:
            return
        self.wait_gather()
        written = any(p._version != v for p, v in zip(self.params, self._versions))
        for param, view in zip(self.params, self._full_views):
            if param.data_ptr() != view.data_ptr() or param.stride() != view.stride():
                view.copy_(param.detach().reshape(view.shape))  # p.data = t while gathered: the unit's value now
                written = True
        if written:
            self.write_back()  # written while gathered (a kept unit, between calls): the shard takes it
        for param, held in zip(self.params, self._placeholders):
            param.data = held
        free_storage(self.full)
        self._move_params(ParamState.SHARDED)
        self._versions = [p._version for p in self.params]  # writes while gathered were to the gathered copy

    @torch.no_grad()
    def publish(self) -> Pending | None:
        """After the optimizer step: ``param_shard`` ← master (a cast where dtypes differ), then
        at stages 1-2 the AllGather that brings every rank the whole updated bucket (guide §9.1
        step 5). Stage 0 updated ``full`` itself; stage 3 gathers at the next use. Nothing while
        ``held`` (the outer loop publishes after its update)."""
        if self.held:
            return None
        self.wait_gather()  # the previous step's AllGather still writes into ``full``
        dst = self.param_shard if self.policy.shard_master else self.full
        if dst.data_ptr() != self.master.data_ptr():  # same storage when the dtypes agree
            dst.copy_(self.master)
        if self.policy.shard_master and not self.policy.shard_params:
            return self.gather(async_op=True)
        return None

    # ---- the module's parameters are the truth between steps (guide §12.9) ----------------------
    @torch.no_grad()
    def take_rebound(self) -> None:
        """A parameter whose ``.data`` the script rebound (``p.data = t``) is taken back: its value
        copied into the flat buffer (stages 0-2) or this rank's slice of it into the shard (stage 3,
        at rest), and the parameter viewing the engine's storage again."""
        if self.policy.shard_params:
            if self.gathered:
                return
            for i, (param, held) in enumerate(zip(self.params, self._placeholders)):
                if param.data_ptr() != held.data_ptr() or param.stride() != held.stride():
                    if param.numel() and bool(param.detach().isnan().all()):
                        param.data = held
                        raise RuntimeError(
                            f"parameter {self.names[i]!r} was rebound (p.data = ...) to a value read while stage 3 "
                            "held only this rank's shard of it (at rest the module's parameter is a NaN placeholder): "
                            "read and rebind inside `with engine.gathered(writeback=True):` on every rank, or load "
                            "values with model.load_state_dict(...)")
                    self.write_param(i, param.detach())
                    param.data = held
                    self._versions[i] = param._version  # writes into the rebound tensor were taken with it
            self._check_sharded_writes()
            return
        for param, view in zip(self.params, self._full_views):
            if param.data_ptr() != view.data_ptr() or param.shape != view.shape:
                view.copy_(param.detach().reshape(view.shape))
                param.data = view

    def _check_sharded_writes(self) -> None:
        """Stage 3 at rest: a module parameter is a placeholder, so an in-place write that reached it
        (``p.data.mul_``, ``p.detach().copy_``) changed nothing the engine keeps; refuse it in one line."""
        for i, param in enumerate(self.params):
            if param._version != self._versions[i]:
                self._versions = [p._version for p in self.params]
                raise RuntimeError(
                    f"parameter {self.names[i]!r} was written in place while stage 3 holds only this rank's shard of "
                    "it (at rest the module's parameter is a placeholder, so the write changed nothing): write "
                    "inside `with engine.gathered(writeback=True):` on every rank, or load values with "
                    "model.load_state_dict(...) / engine.load_state_dict(...)")

    def holds_placeholder(self, t: torch.Tensor) -> bool:
        """Stage 3: whether ``t`` is (a view of) this group's placeholder storage: a parameter at rest."""
        return self.policy.shard_params and t.data_ptr() == self._placeholders[0].data_ptr()

    @torch.no_grad()
    def write_param(self, i: int, value: torch.Tensor) -> None:
        """Parameter ``i``'s whole value (the same on every rank) → the part of it this rank keeps:
        the master slice and, where separate, the compute-dtype shard (stage 3)."""
        slot = self.layout.slots[i]
        if value.numel() != slot.numel:
            raise RuntimeError(f"{slot.name}: a value of shape {tuple(value.shape)} for a parameter of shape "
                               f"{tuple(slot.shape)}")
        lo, hi = self.shard_range
        a, b = max(slot.offset, lo), min(slot.stop, hi)
        if a >= b:
            return
        part = value.reshape(-1)[a - slot.offset:b - slot.offset]
        self.master[a - lo:b - lo].copy_(part)
        if self.param_shard is not self.master:
            self.param_shard[a - lo:b - lo].copy_(part)

    @torch.no_grad()
    def fold_into_master(self) -> None:
        """Values written into the parameters since the last step (in place, ``load_state_dict``,
        ``model.apply``) go into a master kept apart from them (bf16 compute, fp32 master): each
        element of the master's range that differs from the master's own cast takes the written
        value; the others keep the master's full precision. Where the master is the parameters'
        storage there is nothing to fold; under a quantized AllGather the slice holds dequantized
        values, so nothing is read from it."""
        m = self.master
        if self.policy.shard_params or self.quant_params or \
                m.untyped_storage().data_ptr() == self.full.untyped_storage().data_ptr():
            return
        src = self.full[self.master_start:self.master_start + m.numel()]
        torch.where(src != m.to(src.dtype), src.to(m.dtype), m, out=m)

    @torch.no_grad()
    def write_back(self) -> None:
        """Stage 3, leaving ``engine.gathered(writeback=True)``: this rank's slice of what the
        gathered parameters hold now → the shard, elements that differ from the master's cast only."""
        lo, hi = self.shard_range
        src = self.full[lo:hi]
        m = self.master
        torch.where(src != m.to(src.dtype), src.to(m.dtype), m, out=m)
        if self.param_shard is not m:
            self.param_shard.copy_(m)

    def gathered_nbytes(self) -> int:
        """Bytes of the gathered parameters now, measured from the storage (0 when freed)."""
        return self.full.untyped_storage().nbytes()

    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    def memory(self) -> dict[str, list[torch.Tensor]]:
        """This group's tensors by kind (``master`` and optimizer states are counted elsewhere)."""
        out: dict[str, list[torch.Tensor]] = {"params": [], "gathered": [], **self.grads.memory()}
        if self.policy.shard_params:
            if self.param_shard is not self.master:
                out["params"].append(self.param_shard)
            out["gathered"].append(self.full)
        else:
            out["params"].append(self.full)
        return out
