"""A flat group's gradient buffers and what moves them (guide §9.2, §12.5).

:class:`GradBuffers` is the gradient half of one :class:`~zerodp.engine.group.FlatGroup` (a bucket
or a unit): the buffers of the module docstring of :mod:`zerodp.engine.group` — ``grad_full``
(local gradients, Ψ_g in the reduce dtype), its fp32 accumulator ``acc_full`` where kept, and
``grad_shard`` (the mean over ranks of slice r, Ψ_g/N) — and their one state value
(:class:`~zerodp.engine.states.GradState`, checked transitions). Its operations: take a fresh
gradient in (:meth:`GradBuffers.take`), fill what a backward left out, keep a ``no_sync``
backward's gradients local, reduce (AllReduce at stage 0, ReduceScatter at stages 1-3, hybrid:
then across the replicas), give the master what it reads, clip, zero. Storages are dropped and
re-allocated in place (:func:`free_storage` / :func:`restore_storage`) so that every view stays
valid; transient ones wait in a :class:`StoragePool`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from zerodp.engine.comm import Collectives, Pending
from zerodp.engine.config import Dtypes, Policy
from zerodp.engine.layout import FlatLayout
from zerodp.engine.states import GRAD_MOVES, HOLDS_LOCAL, BackwardState, GradState, moved


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


class GradBuffers:
    """The gradient buffers of one flat group and their state (module docstring)."""

    def __init__(self, label: str, layout: FlatLayout, policy: Policy, comm: Collectives, *,
                 replicas: Collectives | None, params: list[nn.Parameter], trainable: list[int],
                 bwd: BackwardState, dtypes: Dtypes, quant_grads: int = 0):
        """What the buffers serve, given by the group that owns them (:class:`FlatGroup`): its
        ``layout``, its stage's ``policy``, the shard group ``comm`` (and ``replicas`` under hybrid
        sharding), its parameters and which of them train, the backward state that counts their
        gradients, and the dtypes of guide §9: compute, on the wire, accumulated in."""
        self.label = label
        self.layout = layout
        self.policy = policy
        self.comm = comm
        self.replicas = replicas
        self.params = params
        self.trainable = trainable
        self.trainable_params = [params[i] for i in trainable]
        self.bwd = bwd
        self.dtypes = dtypes
        self.quant_grads = quant_grads
        self.device = params[0].device  # the group's, once its values exist (init)
        self.state = GradState.NONE
        self.pool: StoragePool | None = None  # where released gradient storages wait (the engine's)
        self.grad_full: torch.Tensor | None = None
        self.acc_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.shard_in_full = False  # grad_shard is a slice of grad_full (stage 1 on CPU, see init)
        self._scratch: torch.Tensor | None = None
        self._cast: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []

    def _move(self, to: GradState) -> None:
        self.state = moved(GRAD_MOVES, self.state, to, f"{self.label}: gradient state")

    @property
    def has_local(self) -> bool:
        """``grad_full`` holds gradients not yet reduced (``GradState.LOCAL`` or ``REDUCED_LOCAL``)."""
        return self.state in HOLDS_LOCAL

    @property
    def holds_grads(self) -> bool:
        """Whether ``grad_full`` has storage now (always, when full gradients are kept at rest)."""
        return self.grad_full.numel() > 0

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.comm.rank)

    @property
    def _hybrid(self) -> bool:
        return self.replicas is not None and self.replicas.world_size > 1

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each trainable parameter's view into a flat gradient buffer of the layout."""
        slots = self.layout.slots
        return [flat[slots[i].offset:slots[i].stop].view(slots[i].shape) for i in self.trainable]

    def init(self, device: torch.device) -> None:
        """Gradient buffers of the policy: a persistent ``grad_full`` that ``param.grad`` views
        (full gradients at rest), or one allocated per reduction; ``grad_shard`` when sharded."""
        self.device = device
        n, s = self.layout.padded_numel, self.layout.shard_numel
        # Left uninitialized where a gradient is always written before it is read (a trainable
        # parameter's first gradient is copied in, a reduction overwrites the fresh shard), so that
        # their pages are touched by the first backward, not at construction, as DDP's buckets.
        if self.policy.full_grads:
            self.grad_full = torch.empty(n, dtype=self.dtypes.param, device=self.device)
            self._zero_unwritten()
            self._grad_views = self._views(self.grad_full)
            # fp32 accumulation of full gradients (+4Ψ): every filled bucket is added in (guide §9).
            self.acc_full = (torch.zeros(n, dtype=torch.float32, device=self.device)
                             if self.dtypes.accum == torch.float32 and self.dtypes.param != torch.float32 else None)
        else:
            self.grad_full = torch.empty(0, dtype=self.dtypes.reduce, device=self.device)
            self._grad_nbytes = n * self.grad_full.element_size()
            self.acc_full = None
        # Stage 1 on CPU: the in-place AllReduce leaves the mean in ``grad_full``, so its own
        # slice is the gradient shard, no separate Ψ/N buffer (guide §12.5).
        self.shard_in_full = (self.policy.full_grads and self.policy.shard_master and self.acc_full is None
                               and self.dtypes.accum == self.dtypes.param == self.dtypes.reduce
                               and not self.quant_grads and not self._hybrid
                               and self.comm.reduces_in_place(self.grad_full))
        if self.shard_in_full:
            lo, hi = self.shard_range
            self.grad_shard = self.grad_full[lo:hi]
        elif self.policy.shard_master:
            self.grad_shard = torch.empty(s, dtype=self.dtypes.accum, device=self.device)
        for param in self.params:
            param.grad = None
        self._scratch: torch.Tensor | None = None  # shard-sized, while a reduction is in flight
        self._receive: torch.Tensor | None = None  # the all-to-all's receive buffer (CPU, stages 2-3), in flight
        self._cast: torch.Tensor | None = None  # grad_full in the reduce dtype, while in flight

    def _ensure_storage(self) -> None:
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
        self.grad_full = torch.empty(0, dtype=self.dtypes.reduce, device=self.device).set_(storage, 0, (n,))
        self._grad_views = self._views(self.grad_full)
        self._zero_unwritten()

    def _zero_unwritten(self) -> None:
        """Zeros in ``grad_full`` where no gradient is ever written: frozen parameters, padding
        (at the end, and between the slices of an owner-aligned layout)."""
        trainable = set(self.trainable)
        for i, sl in enumerate(self.layout.slots):
            if i not in trainable:
                self.grad_full[sl.offset:sl.stop].zero_()
        for lo, hi in self.layout.padding_ranges():
            self.grad_full[lo:hi].zero_()

    def _release_storage(self) -> None:
        if self.policy.full_grads or not self.grad_full.numel():
            return
        if self.pool is not None:
            self.pool.give(self.grad_full.untyped_storage())
        self.grad_full = torch.empty(0, dtype=self.dtypes.reduce, device=self.device)
        self._grad_views = []

    def take(self, j: int, param: nn.Parameter) -> None:
        """The gradient hook's work for trainable parameter ``j`` (index into ``trainable``):
        move its fresh gradient into ``grad_full`` (one copy, or an add onto local gradients of
        earlier micro-batches). With full gradients at rest ``param.grad`` then *is* the view, so
        later micro-batches accumulate in place; otherwise ``.grad`` is dropped at once."""
        grad = param.grad
        if grad.layout != torch.strided:  # nn.Embedding(sparse=True), stage 0 only: the bucket is dense
            grad = grad.to_dense()
        if self.policy.full_grads:
            view = self._grad_views[j]
            if grad is not view:  # first gradient since zero_grad: move it into the bucket
                self._ensure_storage()  # zero_grad may have freed it; only a first gradient can follow
                view.copy_(grad)
                param.grad = view
        else:
            self._ensure_storage()
            view = self._grad_views[j]
            if self.has_local:
                view.add_(grad)
            else:
                view.copy_(grad)
            param.grad = None
        self.bwd.fire(j)

    def fill_missing(self) -> list[int]:
        """Trainable parameters that got no gradient in this backward contribute zeros (their
        local sum is kept where earlier micro-batches left one). Returns their indices."""
        missing = [j for j, f in enumerate(self.bwd.fired) if not f]
        if not missing:
            return missing
        self._ensure_storage()
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
        self._move(GradState.REDUCED_LOCAL if self.state in (GradState.REDUCED, GradState.REDUCED_LOCAL)
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
            self._ensure_storage()
        if self.acc_full is not None:
            self.end_local()
            src = self.acc_full
        else:
            src = self.grad_full
        if factor is not None:
            src.mul_(factor)
        if self.acc_full is None and src.dtype != self.dtypes.reduce:  # e.g. fp32 gradients sent in bf16
            src = self._cast = src.to(self.dtypes.reduce)
        # Nothing reduced into the shard since zero_grad (or only zeros): the collective writes it.
        fresh = self.state in (GradState.NONE, GradState.ZEROS, GradState.LOCAL)
        self._move(GradState.REDUCED)  # in flight now; the master reads it after the wait
        if not self.policy.shard_master:
            pending = self.comm.all_reduce_mean(src, self.label)
            back = src is self._cast

            def finish_all_reduce() -> None:
                if self._hybrid:  # replica groups that are jobs of their own (zerodp.ft): then across them
                    self.replicas.all_reduce_mean(src, f"{self.label} replicas", async_op=False)
                if back:
                    (self.acc_full if self.acc_full is not None else self.grad_full).copy_(src)
                self._cast = None
            return pending, finish_all_reduce
        overwrite = self.policy.full_grads or fresh
        restore_storage(self.grad_shard)  # a shard of its own freed by zero_grad: written, not added
        if self._hybrid:
            return self._reduce_hybrid(src, overwrite)
        in_place = self.comm.reduces_in_place(src, self.quant_grads, self.policy.full_grads)
        direct = (overwrite and self.grad_shard.dtype == src.dtype) or self.quant_grads or in_place
        if not direct:
            self._scratch = torch.empty(self.layout.shard_numel, dtype=src.dtype, device=self.device)
        pending = self.comm.reduce_scatter_grad(self.grad_shard, src, self.label, overwrite=overwrite,
                                                scratch=self._scratch, quant_block=self.quant_grads, clobber=True,
                                                average_full=self.policy.full_grads,
                                                receive=self._receive_buffer(src))
        return pending, self._finish_reduce

    def _reduce_hybrid(self, src: torch.Tensor, overwrite: bool) -> tuple[Pending, Callable[[], None]]:
        """Hybrid sharding (guide §14): ReduceScatter inside the shard group into a scratch of the
        wire dtype, then the scratch — Ψ_g/g elements, this step's contribution only — averaged
        across the replicas in that dtype, then written or added into ``grad_shard``."""
        scratch = self._scratch = torch.empty(self.layout.shard_numel, dtype=src.dtype, device=self.device)
        pending = self.comm.reduce_scatter_grad(scratch, src, self.label, overwrite=True,
                                                quant_block=self.quant_grads, clobber=True,
                                                average_full=self.policy.full_grads,
                                                receive=self._receive_buffer(src))

        def finish() -> None:
            self.replicas.all_reduce_mean(scratch, f"{self.label} replicas", async_op=False)
            self.grad_shard.copy_(scratch) if overwrite else self.grad_shard.add_(scratch)
            self._finish_reduce()
        return pending, finish

    def _receive_buffer(self, src: torch.Tensor) -> torch.Tensor | None:
        """The receive buffer of a CPU ReduceScatter run as an all-to-all (``comm.reduce_scatter_into``):
        a storage of ``src``'s size from the pool of released gradient storages when one waits there
        (the blocks of a model are mostly of one size), given back when the reduction is finished —
        no fresh pages, and no heap holes, per reduction (guide §12.5). None where none is needed."""
        if self.quant_grads or src.device.type != "cpu" or self.comm.world_size == 1 \
                or self.comm.reduces_in_place(src, self.quant_grads, self.policy.full_grads):
            return None
        nbytes = src.numel() * src.element_size()
        storage = self.pool.take(nbytes) if self.pool is not None else None
        if storage is None:
            storage = torch.UntypedStorage(nbytes, device=src.device)
        self._receive = torch.empty(0, dtype=src.dtype, device=src.device).set_(storage, 0, (src.numel(),))
        return self._receive

    def _finish_reduce(self) -> None:
        if self._receive is not None and self.pool is not None:
            self.pool.give(self._receive.untyped_storage())
        self._receive = None
        self._scratch = self._cast = None
        if not self.policy.full_grads:
            self._release_storage()  # bounded by the groups in flight

    def read(self) -> torch.Tensor | None:
        """The gradient the master reads (same range as ``master``): None in ``GradState.NONE``,
        zeros in ``ZEROS``, the mean over ranks in ``REDUCED``. Local gradients are reduced before
        anything reads them (:meth:`~zerodp.engine.step.StepMachine.finish_grad_sync`)."""
        if self.state is GradState.NONE:
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

    def held_grad(self, j: int) -> torch.Tensor | None:
        """What ``param.grad`` of trainable parameter ``j`` is after a backward where full gradients
        stay at rest (its view into ``grad_full``); None where no module tensor holds it."""
        if self.policy.full_grads and self.acc_full is None and self._grad_views and self.state is not GradState.NONE:
            return self._grad_views[j]
        return None

    def _ranges(self, j: int) -> list[tuple[torch.Tensor, int, int]]:
        """The places that hold trainable parameter ``j``'s gradient for the next step: (buffer,
        start, stop) in the local full buffer and in the gradient shard where it is separate."""
        slot = self.layout.slots[self.trainable[j]]
        out = []
        full = self.full_local() if self.policy.full_grads else None
        if full is not None:
            out.append((full, slot.offset, slot.stop))
        elif not self.policy.shard_master and self.holds_grads:
            out.append((self.grad_full, slot.offset, slot.stop))
        if self.policy.shard_master and not self.shard_in_full and self.grad_shard is not None \
                and self.grad_shard.untyped_storage().nbytes():  # (freed by zero_grad until the next reduction)
            lo, hi = self.shard_range
            a, b = max(slot.offset, lo), min(slot.stop, hi)
            if a < b:
                out.append((self.grad_shard, a - lo, b - lo))
        return out

    @torch.no_grad()
    def drop(self, j: int) -> None:
        """The script set ``param.grad`` of trainable parameter ``j`` to None (``model.zero_grad()``,
        ``p.grad = None``) after its reduction: what the engine holds for it becomes zeros, so a later
        backward starts it afresh (guide §12.9); the step skips it unless one does, as torch's."""
        if self.state is GradState.NONE:
            return
        for buf, a, b in self._ranges(j):
            buf[a:b].zero_()

    def _assigned_slot(self, j: int, grad: torch.Tensor):
        """Trainable parameter ``j``'s slot, once ``grad`` (assigned to its ``.grad``) has its shape."""
        slot = self.layout.slots[self.trainable[j]]
        if tuple(grad.shape) != tuple(slot.shape):
            raise RuntimeError(f"{slot.name}.grad was assigned a tensor of shape {tuple(grad.shape)}; the parameter's "
                               f"shape is {tuple(slot.shape)}")
        return slot

    @torch.no_grad()
    def write(self, j: int, grad: torch.Tensor) -> None:
        """The script assigned ``param.grad = grad`` (the parameter's whole gradient, the same on every
        rank, as DDP's would be): the engine takes it as the reduced gradient for the next step."""
        slot = self._assigned_slot(j, grad)
        flat = grad.detach().reshape(-1)
        for buf, a, b in self._ranges(j):
            base = self.shard_range[0] if buf is self.grad_shard else 0  # buffer index + base = flat index
            buf[a:b].copy_(flat[a + base - slot.offset:b + base - slot.offset])

    @torch.no_grad()
    def add_own(self, own: list[tuple[int, torch.Tensor]]) -> None:
        """This rank's own gradients for some trainable parameters (index ``j``, the whole tensor),
        assigned by the script where no backward put one: added to the local gradients the next
        reduction averages, as a ``no_sync`` backward's would be (``LOCAL``, or ``REDUCED_LOCAL``
        after a reduction — the reduction is linear, so it adds their mean to what is reduced)."""
        for j, grad in own:
            self._assigned_slot(j, grad)
        kept = self.has_local or (self.policy.full_grads and self.state is not GradState.NONE)
        self._ensure_storage()
        target = self.acc_full if self.acc_full is not None else self.grad_full
        views = self._views(target)
        if not kept:
            for view in views:
                view.zero_()
        for j, grad in own:
            views[j].add_(grad.detach().to(target.dtype).reshape(views[j].shape))
        self._move(GradState.REDUCED_LOCAL if self.state in (GradState.REDUCED, GradState.REDUCED_LOCAL)
                   else GradState.LOCAL)
        for j, i in enumerate(self.trainable):
            self.params[i].grad = self.held_grad(j)

    @torch.no_grad()
    def scale(self, coef: torch.Tensor) -> None:
        """Clip (guide §12.5): scale what the master reads and, where full gradients stay at rest,
        the local sums the next reduction overwrites the shard with — so that micro-batches
        accumulated after the clip add onto the clipped gradient, as onto a clipped ``.grad``
        (the reduction is linear: mean(c·g₁ + g₂) = c·mean(g₁) + mean(g₂))."""
        if self.state is GradState.NONE:
            return
        full = self.full_local()
        if full is not None:
            full.mul_(coef.to(full.dtype))
        if self.policy.shard_master and not self.shard_in_full:
            self.grad_shard.mul_(coef.to(self.grad_shard.dtype))

    def zero(self, set_to_none: bool = True) -> None:
        """Next step's gradients. With ``set_to_none`` (torch's default) they are None and their
        storages are freed, as torch frees a ``.grad``: full gradients (and their fp32 accumulator)
        until the group's first gradient of the next backward, a gradient shard of its own until the
        first reduction. Forward runs without them: Ψ_g elements less at its peak with full
        gradients (stages 0-1), Ψ_g/N with a shard (stages 2-3). ``set_to_none=False`` zeroes them
        in place, as ``torch.optim.Optimizer.zero_grad(set_to_none=False)`` does: the next step
        applies those zeros to every parameter that had a gradient (``GradState.ZEROS``), and
        ``param.grad`` keeps viewing the bucket where full gradients stay at rest."""
        if not set_to_none and self.state is not GradState.NONE:
            self._zero_in_place()
            return
        for param in self.trainable_params:
            param.grad = None
        if self.policy.full_grads:
            for t in (self.grad_full, self.acc_full):  # the shard of stage 1 on CPU is a slice of grad_full
                if t is not None:
                    free_storage(t)
        if self.grad_full is not None:
            self._release_storage()
        if self.grad_shard is not None and not self.shard_in_full:
            free_storage(self.grad_shard)
        self._move(GradState.NONE)

    @torch.no_grad()
    def _zero_in_place(self) -> None:
        if self.policy.full_grads:
            self._ensure_storage()
            self.grad_full.zero_()
            for param, view in zip(self.trainable_params, self._grad_views):
                param.grad = view if self.acc_full is None else None
        else:
            self._release_storage()  # local gradients of no_sync backwards: now zeros
            for param in self.trainable_params:
                param.grad = None
        if self.acc_full is not None:
            self.acc_full.zero_()
        if self.grad_shard is not None and not self.shard_in_full:
            restore_storage(self.grad_shard)
            self.grad_shard.zero_()
        self._move(GradState.ZEROS)

    def comm_tensors(self) -> list[torch.Tensor]:
        """What serves communication only: full gradients in flight to the ReduceScatter (memory
        first), the gradient shard beside full gradients (stage 1), scratch and cast copies."""
        out = [t for t in (self._scratch, self._cast, self._receive) if t is not None]
        if not self.policy.full_grads and not self.policy.keep_local:
            out.append(self.grad_full)
        if self.grad_shard is not None and self.policy.full_grads and not self.shard_in_full:
            out.append(self.grad_shard)
        return out

    def memory(self) -> dict[str, list[torch.Tensor]]:
        """The gradient tensors by kind: ``grads`` and ``comm_buffers`` (see ``comm_tensors``)."""
        grads: list[torch.Tensor] = []
        if self.policy.full_grads:
            grads.append(self.grad_full)
            if self.acc_full is not None:
                grads.append(self.acc_full)
        elif self.policy.keep_local:  # full local gradients kept across no_sync micro-batches
            grads.append(self.grad_full)
        if self.grad_shard is not None and not self.policy.full_grads:
            grads.append(self.grad_shard)
        return {"grads": grads, "comm_buffers": self.comm_tensors()}
