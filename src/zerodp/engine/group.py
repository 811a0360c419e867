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

Its operations are the three collectives of the guide, each written once for every stage:

- :meth:`reduce` — AllReduce of ``grad_full`` (stage 0, §3-§4) or ReduceScatter into
  ``grad_shard`` (stages 1-3, §9), straight into it when nothing is accumulated there and the
  dtypes agree, else through a shard-sized scratch that is then added (§5). Under hybrid
  sharding the shard is then averaged across the replicas (guide §14).
- :meth:`gather` / :meth:`free` — AllGather of the parameter shards into ``full`` (after the step
  at stages 1-2, before each use at stage 3) and the release of ``full`` (stage 3 only).
- :meth:`publish` — after the optimizer step, ``param_shard`` ← the fp32 master (a cast), then
  the AllGather where parameters are not sharded.

Freeing is ``untyped_storage().resize_(0)`` and re-allocating ``resize_(n)`` of the same storage
(:func:`free_storage`, :func:`restore_storage`; guide §12), so tensors that autograd saved in
forward (``weight.t()`` …) read the right values again in backward, and gradient views stay valid.
The :class:`Policy` says which of these a stage uses; there is no other difference between a
bucket and a unit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from zerodp.engine.comm import Collectives, Pending
from zerodp.engine.layout import FlatLayout

FROZEN = -1  # param-group index of a parameter with requires_grad=False: gathered, never updated


def free_storage(t: torch.Tensor) -> None:
    """Drop ``t``'s memory; ``t`` and every view of its storage stay valid, empty (module docstring)."""
    t.untyped_storage().resize_(0)


def restore_storage(t: torch.Tensor) -> bool:
    """Give ``t`` (a whole buffer, not a slice) its memory back, uninitialized, if
    :func:`free_storage` dropped it; True if it did."""
    storage = t.untyped_storage()
    if storage.nbytes():
        return False
    storage.resize_(t.nbytes)
    return True


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
    """

    stage: int
    shard_master: bool
    full_grads: bool
    shard_params: bool
    keep_local: bool

    @classmethod
    def of(cls, stage: int, reduce_every_microbatch: bool = True) -> "Policy":
        memory_first = stage >= 2 and reduce_every_microbatch
        return cls(stage=stage, shard_master=stage >= 1, full_grads=stage <= 1 or (stage == 2 and not memory_first),
                   shard_params=stage == 3, keep_local=not memory_first)


class StoragePool:
    """Released transient gradient storages, kept for the next group of the same size (guide §12.5).

    A group's ``grad_full`` lives from its first gradient to the end of its collective; allocating
    and freeing it every micro-batch costs fresh pages each time and leaves holes in a CPU heap.
    Released storages wait here, at most ``capacity`` of them, and the next group whose buffer has
    the same size takes one over instead of allocating (the buckets of a model, the blocks of a
    transformer, are mostly of one size). The pool is emptied when the step's gradients are all
    reduced (``clear``), so that the optimizer step and the time between steps hold none of them;
    while it holds some, they count as ``comm_buffers``."""

    def __init__(self, capacity: int = 2):
        self.capacity = capacity
        self.free: list[torch.UntypedStorage] = []

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        for i, storage in enumerate(self.free):
            if storage.nbytes() == nbytes:
                return self.free.pop(i)
        return None

    def give(self, storage: torch.UntypedStorage) -> None:
        self.free.append(storage)
        if len(self.free) > self.capacity:
            self.free.pop(0)  # the oldest is freed

    def clear(self) -> None:
        self.free.clear()


class GradState(enum.Enum):
    """What a group's gradient buffers hold (guide §12.5). One value per group; every change goes
    through :meth:`FlatGroup._move`, which refuses a transition not in ``GRAD_MOVES``.

    ``NONE``: no gradient since ``zero_grad(set_to_none=True)`` (the master reads None, as torch
    reads ``.grad is None``). ``ZEROS``: ``zero_grad(set_to_none=False)`` zeroed them: the master
    reads zeros, which torch's optimizers still apply (momentum, weight decay). ``LOCAL``: local
    gradients of ``no_sync`` backwards, not reduced. ``REDUCED``: the mean over ranks is where the
    master reads it. ``REDUCED_LOCAL``: that, plus local gradients of later ``no_sync`` backwards
    waiting in ``grad_full`` for the next reduction, which adds them."""

    NONE = "none"
    ZEROS = "zeros"
    LOCAL = "local"
    REDUCED = "reduced"
    REDUCED_LOCAL = "reduced+local"


_G = GradState
GRAD_MOVES: dict[GradState, frozenset[GradState]] = {
    _G.NONE: frozenset({_G.NONE, _G.LOCAL, _G.REDUCED}),
    _G.ZEROS: frozenset({_G.NONE, _G.ZEROS, _G.LOCAL, _G.REDUCED}),
    _G.LOCAL: frozenset({_G.NONE, _G.ZEROS, _G.LOCAL, _G.REDUCED}),
    _G.REDUCED: frozenset({_G.NONE, _G.ZEROS, _G.REDUCED, _G.REDUCED_LOCAL}),
    _G.REDUCED_LOCAL: frozenset({_G.NONE, _G.ZEROS, _G.REDUCED, _G.REDUCED_LOCAL}),
}
#: the states in which ``grad_full`` holds gradients not yet reduced
HOLDS_LOCAL = frozenset({_G.LOCAL, _G.REDUCED_LOCAL})


class Phase(enum.Enum):
    """Where one group is in the current backward: no gradient yet, running (a gradient arrived
    or, stage 3, the unit's pre-backward hook ran), done (its reduction launched, or kept local)."""

    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass
class BackwardState:
    """Where one group is in the current backward.

    ``fired[i]``: trainable parameter i got its gradient in this backward; ``remaining``: how many
    have not. A unit (stage 3) is also over only when the gradient w.r.t. its inputs was computed
    for every live graph that fed it inputs needing one (``pending_inputs`` is empty): a frozen
    parameter can still be needed after the last trainable one. ``pending_inputs`` holds one token
    per forward call whose graph is alive and not yet backwarded through the unit; a graph that is
    dropped (a validation loss under grad, a GAN's ``G(z).detach()``) takes its token with it."""

    remaining: int = 0
    fired: list[bool] | None = None
    phase: Phase = Phase.WAITING
    pending_inputs: set[int] = field(default_factory=set)
    fwd_event: object = None  # the trace's open "forward <unit>" span
    bwd_event: object = None

    def over(self) -> bool:
        return self.remaining <= 0 and not self.pending_inputs

    def reset(self, trainable: int) -> None:
        self.remaining = trainable
        self.fired = [False] * trainable
        self.phase = Phase.WAITING

    def fire(self, j: int) -> None:
        """Trainable parameter ``j`` got its gradient (once per backward; a second is an error)."""
        if self.fired[j]:
            raise RuntimeError("a parameter received two gradients in one backward pass through its group: "
                               "a parameter used twice must be reached by one autograd path per backward")
        self.fired[j] = True
        self.remaining -= 1


class FlatGroup:
    """One bucket or unit on one rank: its buffers, collectives and backward state (see module)."""

    def __init__(self, index: int, label: str, entries: list[tuple[str, nn.Parameter, int]], policy: Policy,
                 comm: Collectives, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 accum_dtype: torch.dtype, replicas: Collectives | None = None, quant_params: int = 0,
                 quant_grads: int = 0):
        self.index = index
        self.label = label
        self.policy = policy
        self.comm = comm  # the shard group: ReduceScatter and AllGather run here
        self.replicas = replicas  # hybrid sharding: the same shard on the other replicas (guide §14)
        self.names = [n for n, _, _ in entries]
        self.params = [p for _, p, _ in entries]
        self.groups = [g for _, _, g in entries]
        self.trainable = [i for i, g in enumerate(self.groups) if g != FROZEN]
        self.layout = FlatLayout.pack([(n, tuple(p.shape)) for n, p, _ in entries], comm.world_size)
        self.rank = comm.rank
        self.device = self.params[0].device
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.accum_dtype = accum_dtype
        self.quant_params = quant_params  # int8 AllGather with one scale per this many elements (§15)
        self.quant_grads = quant_grads  # int8 all-to-all gradient reduction, same
        self.module: nn.Module | None = None  # stage 3: the module whose forward gathers this unit
        self.pool: StoragePool | None = None  # where released gradient storages wait (the engine's)
        self.bwd = BackwardState()
        self.bwd.reset(len(self.trainable))
        # Set by init_values / init_grads.
        self.full: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.master_start = 0  # where ``master`` starts in the layout
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.gathered = False
        self.pending_gather: Pending | None = None
        self.grad_state = GradState.NONE  # what the gradient buffers hold (GradState)
        self._shard_in_full = False  # grad_shard is a slice of grad_full (stage 1 on CPU, init_grads)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _move(self, to: GradState) -> None:
        if to not in GRAD_MOVES[self.grad_state]:
            raise RuntimeError(f"{self.label}: gradient state {self.grad_state.value} -> {to.value} is not a "
                               "step of the training loop (zerodp internal error: please report it)")
        self.grad_state = to

    @property
    def has_local(self) -> bool:
        """``grad_full`` holds gradients not yet reduced (``GradState.LOCAL`` or ``REDUCED_LOCAL``)."""
        return self.grad_state in HOLDS_LOCAL

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
    def holds_grads(self) -> bool:
        """Whether ``grad_full`` has storage now (always, when full gradients are kept at rest)."""
        return self.grad_full.numel() > 0

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [self.params[i] for i in self.trainable]

    def views(self, flat: torch.Tensor, which: list[int] | None = None) -> list[torch.Tensor]:
        """Each parameter's view into a flat buffer of this layout (``which``: indices)."""
        slots = self.layout.slots
        return [flat[slots[i].offset:slots[i].stop].view(slots[i].shape)
                for i in (range(len(slots)) if which is None else which)]

    def describe(self) -> dict:
        return {"label": self.label, "groups": sorted(set(self.groups)), "dtype": str(self.param_dtype),
                **self.layout.to_dict()}

    # ---- parameters -----------------------------------------------------------------------------
    @torch.no_grad()
    def init_values(self, values: torch.Tensor) -> None:
        """Set up the parameter buffers and the master from ``values``, an fp32 flat tensor of the
        whole padded layout (rank 0's values, already broadcast)."""
        lo, hi = self.shard_range
        p = self.policy
        self.device = values.device  # (a model built on the meta device is materialized here)
        if not p.shard_params:
            self.full = values if self.param_dtype == values.dtype else values.to(self.param_dtype)
            for param, view in zip(self.params, self.views(self.full)):
                param.data = view
            self.gathered = True
            if not p.shard_master:
                self.master, self.master_start = values, 0  # is ``full`` itself in fp32
            else:
                # A view of the parameters where dtypes agree — unless the AllGather is quantized:
                # it writes dequantized values over this slice too, and the master stays exact.
                share = values is self.full and not self.quant_params
                self.master = values[lo:hi] if share else values[lo:hi].clone()
                self.master_start = lo
            self.param_shard = self.full[lo:hi]
        else:
            self.master, self.master_start = values[lo:hi].clone(), lo
            self.param_shard = self.master if self.param_dtype == torch.float32 else self.master.to(self.param_dtype)
            self.full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, device=self.device)
            self._full_views = self.views(self.full)
            self._empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
            free_storage(self.full)
            for param in self.params:
                param.data = self._empty

    def gather(self, async_op: bool = True) -> Pending | None:
        """``full`` ← every rank's ``param_shard`` (guide §9.1 step 5, §9.3). At stage 3 the
        storage is allocated first and the module's parameters pointed at their views."""
        if self.policy.shard_params:
            restore_storage(self.full)
            for param, view in zip(self.params, self._full_views):
                param.data = view
            self.gathered = True
        if self.comm.world_size == 1:
            if self.policy.shard_params:
                self.full.copy_(self.param_shard)
            return None
        pending = self.comm.all_gather(self.full, self.param_shard, self.label, async_op=async_op,
                                       quant_block=self.quant_params)
        self.pending_gather = pending if async_op else None
        return self.pending_gather

    def wait_gather(self) -> None:
        if self.pending_gather is not None:
            self.pending_gather.wait()
            self.pending_gather = None

    def free(self) -> None:
        """Stage 3: drop the gathered parameters (``resize_(0)``; the views stay, empty)."""
        if not self.policy.shard_params or not self.gathered:
            return
        self.wait_gather()
        for param in self.params:
            param.data = self._empty
        free_storage(self.full)
        self.gathered = False

    @torch.no_grad()
    def publish(self) -> Pending | None:
        """After the optimizer step: ``param_shard`` ← master (a cast where dtypes differ), then
        at stages 1-2 the AllGather that brings every rank the whole updated bucket (guide §9.1
        step 5). Stage 0 updated ``full`` itself; stage 3 gathers at the next use."""
        dst = self.param_shard if self.policy.shard_master else self.full
        if dst.data_ptr() != self.master.data_ptr():  # same storage when the dtypes agree
            dst.copy_(self.master)
        if self.policy.shard_master and not self.policy.shard_params:
            return self.gather(async_op=True)
        return None

    def gathered_nbytes(self) -> int:
        """Bytes of the gathered parameters now, measured from the storage (0 when freed)."""
        return self.full.untyped_storage().nbytes()

    def full_nbytes(self) -> int:
        return self.layout.padded_numel * self.full.element_size()

    # ---- gradients ---------------------------------------------------------------------------
    def init_grads(self) -> None:
        """Gradient buffers of the policy: a persistent ``grad_full`` that ``param.grad`` views
        (full gradients at rest), or one allocated per reduction; ``grad_shard`` when sharded."""
        n, s = self.layout.padded_numel, self.layout.shard_numel
        # Left uninitialized where a gradient is always written before it is read (a trainable
        # parameter's first gradient is copied in, a reduction overwrites the fresh shard), so that
        # their pages are touched by the first backward, not at construction, as DDP's buckets.
        if self.policy.full_grads:
            self.grad_full = torch.empty(n, dtype=self.param_dtype, device=self.device)
            self._zero_unwritten()
            self._grad_views = self.views(self.grad_full, self.trainable)
            # fp32 accumulation of full gradients (+4Ψ): every filled bucket is added in (guide §9).
            self.acc_full = (torch.zeros(n, dtype=torch.float32, device=self.device)
                             if self.accum_dtype == torch.float32 and self.param_dtype != torch.float32 else None)
        else:
            self.grad_full = torch.empty(0, dtype=self.reduce_dtype, device=self.device)
            self._grad_nbytes = n * self.grad_full.element_size()
            self.acc_full = None
        # Stage 1 on CPU: the in-place AllReduce leaves the mean in ``grad_full``, so its own
        # slice is the gradient shard, no separate Ψ/N buffer (guide §12.5).
        self._shard_in_full = (self.policy.full_grads and self.policy.shard_master and self.acc_full is None
                               and self.accum_dtype == self.param_dtype == self.reduce_dtype
                               and not self.quant_grads and not self._hybrid
                               and self.comm.reduces_in_place(self.grad_full))
        if self._shard_in_full:
            lo, hi = self.shard_range
            self.grad_shard = self.grad_full[lo:hi]
        elif self.policy.shard_master:
            self.grad_shard = torch.empty(s, dtype=self.accum_dtype, device=self.device)
        for param in self.params:
            param.grad = None
        self._scratch: torch.Tensor | None = None  # shard-sized, while a reduction is in flight
        self._cast: torch.Tensor | None = None  # grad_full in the reduce dtype, while in flight

    def _ensure_grad_storage(self) -> None:
        """``grad_full`` before a gradient is written to it: full gradients get their storage back
        if ``zero_grad`` freed it (the views stay valid, guide §12); a transient ``grad_full`` takes
        a storage from the pool, or a new one. Zeros where no gradient is ever written (frozen
        parameters and the padding), and in a re-allocated fp32 accumulator."""
        if self.policy.full_grads:
            if restore_storage(self.grad_full):
                self._zero_unwritten()
                if self.acc_full is not None:
                    restore_storage(self.acc_full)
                    self.acc_full.zero_()
            return
        if self.grad_full.numel():
            return
        n = self.layout.padded_numel
        storage = self.pool.take(self._grad_nbytes) if self.pool is not None else None
        if storage is None:
            storage = torch.UntypedStorage(self._grad_nbytes, device=self.device)
        self.grad_full = torch.empty(0, dtype=self.reduce_dtype, device=self.device).set_(storage, 0, (n,))
        self._grad_views = self.views(self.grad_full, self.trainable)
        self._zero_unwritten()

    def _zero_unwritten(self) -> None:
        """Zeros in ``grad_full`` where no gradient is ever written: frozen parameters, padding."""
        for sl, g in zip(self.layout.slots, self.groups):
            if g == FROZEN:
                self.grad_full[sl.offset:sl.stop].zero_()
        self.grad_full[self.layout.numel:].zero_()

    def _release_grad_storage(self) -> None:
        if self.policy.full_grads or not self.grad_full.numel():
            return
        if self.pool is not None:
            self.pool.give(self.grad_full.untyped_storage())
        self.grad_full = torch.empty(0, dtype=self.reduce_dtype, device=self.device)
        self._grad_views = []

    def take_grad(self, j: int, param: nn.Parameter) -> None:
        """The gradient hook's work for trainable parameter ``j`` (index into ``trainable``):
        move its fresh gradient into ``grad_full`` (one copy, or an add onto local gradients of
        earlier micro-batches). With full gradients at rest ``param.grad`` then *is* the view, so
        later micro-batches accumulate in place; otherwise ``.grad`` is dropped at once."""
        if self.policy.full_grads:
            view = self._grad_views[j]
            if param.grad is not view:  # first gradient since zero_grad: move it into the bucket
                self._ensure_grad_storage()  # zero_grad may have freed it; only a first gradient can follow
                view.copy_(param.grad)
                param.grad = view
        else:
            self._ensure_grad_storage()
            view = self._grad_views[j]
            if self.has_local:
                view.add_(param.grad)
            else:
                view.copy_(param.grad)
            param.grad = None
        self.bwd.fire(j)

    def fill_missing(self) -> list[int]:
        """Trainable parameters that got no gradient in this backward contribute zeros (their
        local sum is kept where earlier micro-batches left one). Returns their indices."""
        missing = [j for j, f in enumerate(self.bwd.fired) if not f]
        if not missing:
            return missing
        self._ensure_grad_storage()
        if self.policy.full_grads:
            for j in missing:
                param = self.params[self.trainable[j]]
                if param.grad is not self._grad_views[j]:
                    self._grad_views[j].zero_()
                    param.grad = self._grad_views[j]
        elif not self.has_local:
            for j in missing:
                self._grad_views[j].zero_()
        return missing

    def end_local(self) -> None:
        """A backward filled this group but does not reduce it (``no_sync``): the gradients stay
        local. With an fp32 accumulator they are added into it now, so the next micro-batch copies."""
        self._move(GradState.REDUCED_LOCAL if self.grad_state in (GradState.REDUCED, GradState.REDUCED_LOCAL)
                   else GradState.LOCAL)
        if self.acc_full is not None:
            self.fill_missing()
            self.acc_full.add_(self.grad_full)
            for param in self.trainable_params:
                param.grad = None

    def reduce(self, factor: float | None = None) -> tuple[Pending | None, Callable[[], None]]:
        """Launch this group's gradient collective (guide §3-§4 stage 0, §9 stages 1-3); return
        it and the finisher to run once it completed.

        ``factor`` pre-multiplies local gradients (token averaging, guide §2.2). The ReduceScatter
        overwrites ``grad_shard`` when ``grad_full`` holds the step's whole local sum (full
        gradients at rest) or nothing was reduced since ``zero_grad``; otherwise it adds."""
        if self.policy.full_grads:
            self._ensure_grad_storage()
        if self.acc_full is not None:
            self.end_local()
            src = self.acc_full
        else:
            src = self.grad_full
        if factor is not None:
            src.mul_(factor)
        if self.acc_full is None and src.dtype != self.reduce_dtype:  # e.g. fp32 gradients sent in bf16
            src = self._cast = src.to(self.reduce_dtype)
        # Nothing reduced into the shard since zero_grad (or only zeros): the collective writes it.
        fresh = self.grad_state in (GradState.NONE, GradState.ZEROS, GradState.LOCAL)
        self._move(GradState.REDUCED)  # in flight now; the master reads it after the wait
        if not self.policy.shard_master:
            pending = self.comm.all_reduce_mean(src, self.label)
            back = src is self._cast

            def finish_all_reduce() -> None:
                if back:
                    (self.acc_full if self.acc_full is not None else self.grad_full).copy_(src)
                self._cast = None
            return pending, finish_all_reduce
        overwrite = self.policy.full_grads or fresh
        restore_storage(self.grad_shard)  # a shard of its own freed by zero_grad: written, not added
        if self._hybrid:
            return self._reduce_hybrid(src, overwrite)
        in_place = self.comm.reduces_in_place(src, self.quant_grads)
        direct = (overwrite and self.grad_shard.dtype == src.dtype) or self.quant_grads or in_place
        if not direct:
            self._scratch = torch.empty(self.layout.shard_numel, dtype=src.dtype, device=self.device)
        pending = self.comm.reduce_scatter_grad(self.grad_shard, src, self.label, overwrite=overwrite,
                                                scratch=self._scratch, quant_block=self.quant_grads, clobber=True,
                                                average_full=self.policy.full_grads)
        return pending, self._finish_reduce

    def _reduce_hybrid(self, src: torch.Tensor, overwrite: bool) -> tuple[Pending, Callable[[], None]]:
        """Hybrid sharding (guide §14): ReduceScatter inside the shard group into a scratch of the
        wire dtype, then the scratch — Ψ_g/g elements, this step's contribution only — averaged
        across the replicas in that dtype, then written or added into ``grad_shard``."""
        scratch = self._scratch = torch.empty(self.layout.shard_numel, dtype=src.dtype, device=self.device)
        pending = self.comm.reduce_scatter_grad(scratch, src, self.label, overwrite=True,
                                                quant_block=self.quant_grads, clobber=True,
                                                average_full=self.policy.full_grads)

        def finish() -> None:
            self.replicas.all_reduce_mean(scratch, f"{self.label} replicas", async_op=False)
            self.grad_shard.copy_(scratch) if overwrite else self.grad_shard.add_(scratch)
            self._finish_reduce()
        return pending, finish

    def _finish_reduce(self) -> None:
        self._scratch = self._cast = None
        if not self.policy.full_grads:
            self._release_grad_storage()  # bounded by the groups in flight

    def grad(self) -> torch.Tensor | None:
        """The gradient the master reads (same range as ``master``): None in ``GradState.NONE``,
        zeros in ``ZEROS``, the mean over ranks in ``REDUCED``. Local gradients are reduced before
        anything reads them (``StageEngine._finish_grad_sync``)."""
        if self.grad_state is GradState.NONE:
            return None
        if self.has_local:
            raise RuntimeError(f"{self.label}: local gradients were read before their reduction (zerodp internal "
                               "error: please report it)")
        if not self.policy.shard_master:
            return self.acc_full if self.acc_full is not None else self.grad_full
        return self.grad_shard

    def full_local(self) -> torch.Tensor | None:
        """Where full gradients stay at rest beside a separate gradient shard, the buffer later
        micro-batches add into (the fp32 accumulator, else ``grad_full``); None without one."""
        if not self.policy.full_grads or not self.holds_grads:
            return None
        return self.acc_full if self.acc_full is not None else self.grad_full

    @torch.no_grad()
    def scale_grads(self, coef: torch.Tensor) -> None:
        """Clip (guide §12.5): scale what the master reads and, where full gradients stay at rest,
        the local sums the next reduction overwrites the shard with — so that micro-batches
        accumulated after the clip add onto the clipped gradient, as onto a clipped ``.grad``
        (the reduction is linear: mean(c·g₁ + g₂) = c·mean(g₁) + mean(g₂))."""
        if self.grad_state is GradState.NONE:
            return
        full = self.full_local()
        if full is not None:
            full.mul_(coef.to(full.dtype))
        if self.policy.shard_master and not self._shard_in_full:
            self.grad_shard.mul_(coef.to(self.grad_shard.dtype))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Next step's gradients. With ``set_to_none`` (torch's default) they are None and their
        storages are freed, as torch frees a ``.grad``: full gradients (and their fp32 accumulator)
        until the group's first gradient of the next backward, a gradient shard of its own until the
        first reduction. Forward runs without them: Ψ_g elements less at its peak with full
        gradients (stages 0-1), Ψ_g/N with a shard (stages 2-3). ``set_to_none=False`` zeroes them
        in place, as ``torch.optim.Optimizer.zero_grad(set_to_none=False)`` does: the next step
        applies those zeros to every parameter that had a gradient (``GradState.ZEROS``), and
        ``param.grad`` keeps viewing the bucket where full gradients stay at rest."""
        if not set_to_none and self.grad_state is not GradState.NONE:
            self._zero_in_place()
            return
        for param in self.trainable_params:
            param.grad = None
        if self.policy.full_grads:
            for t in (self.grad_full, self.acc_full):  # the shard of stage 1 on CPU is a slice of grad_full
                if t is not None:
                    free_storage(t)
        if self.grad_full is not None:
            self._release_grad_storage()
        if self.grad_shard is not None and not self._shard_in_full:
            free_storage(self.grad_shard)
        self._move(GradState.NONE)

    @torch.no_grad()
    def _zero_in_place(self) -> None:
        if self.policy.full_grads:
            self._ensure_grad_storage()
            self.grad_full.zero_()
            for param, view in zip(self.trainable_params, self._grad_views):
                param.grad = view if self.acc_full is None else None
        else:
            self._release_grad_storage()  # local gradients of no_sync backwards: now zeros
            for param in self.trainable_params:
                param.grad = None
        if self.acc_full is not None:
            self.acc_full.zero_()
        if self.grad_shard is not None and not self._shard_in_full:
            restore_storage(self.grad_shard)
            self.grad_shard.zero_()
        self._move(GradState.ZEROS)

    def memory(self) -> dict[str, list[torch.Tensor]]:
        """This group's tensors by kind (``master`` and optimizer states are counted elsewhere)."""
        out: dict[str, list[torch.Tensor]] = {"params": [], "grads": [], "gathered": [],
                                              "comm_buffers": self.comm_tensors()}
        if self.policy.shard_params:
            if self.param_shard is not self.master:
                out["params"].append(self.param_shard)
            out["gathered"].append(self.full)
        else:
            out["params"].append(self.full)
        if self.policy.full_grads:
            out["grads"].append(self.grad_full)
            if self.acc_full is not None:
                out["grads"].append(self.acc_full)
        elif self.policy.keep_local:  # full local gradients kept across no_sync micro-batches
            out["grads"].append(self.grad_full)
        if self.grad_shard is not None and not self.policy.full_grads:
            out["grads"].append(self.grad_shard)
        return out

    def comm_tensors(self) -> list[torch.Tensor]:
        """What serves communication only: full gradients in flight to the ReduceScatter (memory
        first), the gradient shard beside full gradients (stage 1), scratch and cast copies."""
        out = [t for t in (self._scratch, self._cast) if t is not None]
        if not self.policy.full_grads and not self.policy.keep_local:
            out.append(self.grad_full)
        if self.grad_shard is not None and self.policy.full_grads and not self._shard_in_full:
            out.append(self.grad_shard)
        return out

    @property
    def _hybrid(self) -> bool:
        return self.replicas is not None and self.replicas.world_size > 1
