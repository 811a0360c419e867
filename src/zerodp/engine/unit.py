"""FSDP units: one flat buffer per unit, sharded 1/N, gathered only while the unit computes.

Guide §9.3: ZeRO-3 keeps only 1/N of the parameters on each rank and AllGathers a layer's
parameters just before it runs, then drops them. Guide §10.3: FSDP does this not per parameter
but per *unit* (usually one transformer block) — the same trade-off as the buckets of §4: small
units mean many collectives, each paying the latency α; big units mean big temporary buffers and
an un-hidden first gather. A unit that is the whole model degenerates to ZeRO-1/2.

A :class:`Unit` owns, for its parameters laid out back to back by a
:class:`~zerodp.engine.layout.FlatLayout` (padded to a multiple of N):

===============  ==========================  ====================================================
buffer           size, dtype                 lifetime
===============  ==========================  ====================================================
``master``       Ψ_u/N, fp32                 always: what the optimizer updates (guide §9.1)
``param_shard``  Ψ_u/N, compute dtype        always (= ``master`` without mixed precision):
                                             the AllGather input, refreshed after each step
``grad_shard``   Ψ_u/N, grad dtype           always: the ReduceScatter result, accumulated
``full``         Ψ_u, compute dtype          gathered: from AllGather to free
``grad_full``    Ψ_u, compute dtype          from the unit's backward until its ReduceScatter
===============  ==========================  ====================================================

The module's parameters are *views* into ``full``; freeing is ``untyped_storage().resize_(0)``
and re-gathering is ``resize_(n)`` + AllGather into the same storage (guide §12), so tensors that
autograd saved in forward (``weight.t()`` …) read the right values again in backward. While a
unit is freed its parameters point at an empty tensor, so that an accidental use outside
forward/backward raises a shape error instead of reading freed memory. When a unit's backward is
over its gradients are packed into ``grad_full`` with one fused copy, and ``.grad`` is unset
again, so the ReduceScatter reads one contiguous buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.comm import Collectives, Pending
from zerodp.engine.layout import FlatLayout

FROZEN = -1  # group index of parameters with requires_grad=False: gathered, never updated


@dataclass(frozen=True)
class UnitSpec:
    """Which parameters one unit owns, before any buffer exists (pure bookkeeping)."""

    name: str  # fully qualified module name; "" for the root unit
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter, int], ...]  # (fqn, parameter, group index or FROZEN)

    @property
    def label(self) -> str:
        return self.name or "root"


def _owner_map(root: nn.Module, unit_modules: list[nn.Module]) -> dict[int, tuple[str, nn.Module]]:
    """Each parameter's owning unit = the innermost unit module that reaches it (guide §10.3).

    Returns ``id(param) -> (unit name, unit module)``. A parameter reached from two different
    units (weights tied across units) is refused: each unit shards and reduces its own flat
    buffer, so a shared parameter would be updated twice with half its gradient each time.
    """
    unit_ids = {id(m) for m in unit_modules}
    owners: dict[int, tuple[str, nn.Module]] = {}
    first_fqn: dict[int, str] = {}

    def walk(module: nn.Module, prefix: str, owner: tuple[str, nn.Module], path: tuple[int, ...]):
        if id(module) in path:  # a module cycle cannot occur in a tree, but guard anyway
            return
        if id(module) in unit_ids:
            owner = (prefix, module)
        for pname, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{prefix}.{pname}" if prefix else pname
            prev = owners.get(id(p))
            if prev is not None and prev[1] is not owner[1]:
                raise ValueError(
                    f"parameter {first_fqn[id(p)]!r} is shared with {fqn!r} but they fall in different "
                    f"FSDP units ({prev[0] or 'root'!r} and {owner[0] or 'root'!r}). Each unit shards "
                    "and reduces its own flat buffer, so a tied weight must live in one unit: put the "
                    "modules that share it in the same unit (e.g. leave both in the root unit), or untie "
                    "the weights."
                )
            owners.setdefault(id(p), owner)
            first_fqn.setdefault(id(p), fqn)
        for cname, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{cname}" if prefix else cname, owner, path + (id(module),))

    walk(root, "", ("", root), ())
    return owners


def default_unit_modules(root: nn.Module) -> list[nn.Module]:
    """The blocks of the model's largest ``nn.ModuleList`` (guide §10.3: one unit per block).

    "Largest" means most parameters (ties: most children, then first found). Returns ``[]`` when
    the model has no ``ModuleList`` with parameters: then the root unit is the whole model.
    """
    best, best_key = None, (0, 0)
    for m in root.modules():
        if isinstance(m, nn.ModuleList):
            key = (sum(p.numel() for p in m.parameters()), len(m))
            if key > best_key:
                best, best_key = m, key
    return [] if best is None else [c for c in best if any(True for _ in c.parameters())]


def plan_units(root: nn.Module, unit_modules: list[nn.Module] | None,
               group_of) -> list[UnitSpec]:
    """Split ``root``'s parameters into units: the given modules plus a root unit for the rest.

    ``group_of(fqn, param) -> int`` gives the parameter group index (ignored for frozen ones).
    Units are returned in module registration order (the root unit, if it owns parameters,
    first); within a unit parameters are ordered by group, frozen ones last, so that each group
    is one contiguous range of the flat buffer and of every shard.
    """
    modules = default_unit_modules(root) if unit_modules is None else list(unit_modules)
    all_modules: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        all_modules.setdefault(id(m), name)
    seen = set()
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"units must be nn.Module objects inside the model, got {type(m).__name__}")
        if id(m) not in all_modules:
            raise ValueError(
                f"unit {type(m).__name__} is not a submodule of the model: pass modules reachable "
                "from the model given to parallelize (e.g. units=list(model.blocks))"
            )
        if id(m) in seen:
            raise ValueError(f"module {all_modules[id(m)]!r} is listed twice in units")
        seen.add(id(m))
    owners = _owner_map(root, modules)
    by_unit: dict[int, list[tuple[str, nn.Parameter, int]]] = {}
    for fqn, p in root.named_parameters():  # deduplicated: a tied parameter appears once
        name, mod = owners[id(p)]
        group = group_of(fqn, p) if p.requires_grad else FROZEN
        by_unit.setdefault(id(mod), []).append((fqn, p, group))
    specs = []
    position = {}
    for i, (_, m) in enumerate(root.named_modules(remove_duplicate=False)):
        position.setdefault(id(m), i)
    ordered = ([root] if id(root) not in seen else []) + modules
    ordered.sort(key=lambda m: position[id(m)])
    for mod in ordered:
        name = all_modules[id(mod)]
        params = by_unit.get(id(mod), [])
        if not params:
            if mod is root:
                continue  # every parameter is inside some unit: no root unit needed
            raise ValueError(
                f"unit {name!r} owns no parameters (all of them belong to nested units or it has "
                "none): drop it from units"
            )
        dtypes = {p.dtype for _, p, _ in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"unit {name or 'root'!r} mixes parameter dtypes {sorted(map(str, dtypes))}: one flat "
                "buffer holds one dtype; cast the model to one dtype (mixed precision is a separate option)"
            )
        order = sorted(range(len(params)), key=lambda i: (params[i][2] == FROZEN, params[i][2], i))
        specs.append(UnitSpec(name, mod, tuple(params[i] for i in order)))
    return specs


@dataclass
class BackwardState:
    """Where one unit is in the current backward (and what forward left for it to wait for).

    A unit's backward is over when every trainable parameter's gradient arrived (``grads``) and
    the gradient w.r.t. its inputs was computed for every forward call that fed it inputs needing
    one (``inputs_fired`` ≥ ``inputs_expected``): a frozen parameter can still be needed after the
    last trainable one, e.g. a frozen norm weight at the start of a block."""

    started: bool = False
    done: bool = False
    grads: int = 0
    inputs_expected: int = 0  # forward calls whose grad-requiring inputs the unit watches
    inputs_fired: int = 0
    fwd_event: object = None  # the trace's open "forward <unit>" span
    bwd_event: object = None

    def over(self, trainable: int) -> bool:
        return self.grads >= trainable and self.inputs_fired >= self.inputs_expected

    def reset(self) -> None:
        """After a backward: the next one starts from nothing."""
        self.started = self.done = False
        self.grads = 0
        self.reset_inputs()

    def reset_inputs(self) -> None:
        self.inputs_expected = self.inputs_fired = 0


class Unit:
    """The flat buffers of one FSDP unit on one rank, its backward state, and its three operations:
    :meth:`gather` (AllGather), :meth:`free`, :meth:`reduce` (ReduceScatter of the gradients)."""

    def __init__(self, index: int, spec: UnitSpec, rank: int, world_size: int,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 fp32_grad_accum: bool, group: dist.ProcessGroup | None):
        self.index = index
        self.name = spec.label
        self.module = spec.module
        self.fqns = [fqn for fqn, _, _ in spec.params]
        self.params = [p for _, p, _ in spec.params]
        self.groups = [g for _, _, g in spec.params]
        self.layout = FlatLayout.pack([(fqn, tuple(p.shape)) for fqn, p, _ in spec.params], world_size)
        self.rank = rank
        master_dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.param_dtype = param_dtype or master_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        n, s = self.layout.padded_numel, self.layout.shard_numel
        lo, hi = self.layout.shard_range(rank)

        # Rank 0's values are the truth (as DDP broadcasts at construction), then keep slice r.
        with torch.no_grad():
            init = torch.zeros(n, dtype=master_dtype, device=self.device)
            for slot, p in zip(self.layout.slots, self.params):
                init[slot.offset:slot.stop].copy_(p.detach().reshape(-1))
            if world_size > 1:
                dist.broadcast(init, src=dist.get_global_rank(group, 0) if group is not None else 0,
                               group=group)
            self.master = init[lo:hi].clone()
        del init
        self.param_shard = (self.master if self.param_dtype == master_dtype
                            else self.master.to(self.param_dtype))

        self.full = torch.empty(n, dtype=self.param_dtype, device=self.device)
        self._full_storage = self.full.untyped_storage()
        self._full_nbytes = self._full_storage.nbytes()
        self._views = [self.full[sl.offset:sl.stop].view(sl.shape) for sl in self.layout.slots]
        self._empty = torch.empty(0, dtype=self.param_dtype, device=self.device)

        self.trainable = [i for i, g in enumerate(self.groups) if g != FROZEN]
        self.grad_full = torch.empty(n, dtype=self.param_dtype, device=self.device)
        self._grad_storage = self.grad_full.untyped_storage()
        self._grad_nbytes = self._grad_storage.nbytes()
        self._grad_views = [self.grad_full[self.layout.slots[i].offset:self.layout.slots[i].stop]
                            .view(self.layout.slots[i].shape) for i in self.trainable]
        self._trainable_params = [self.params[i] for i in self.trainable]
        # Parts of grad_full no gradient is written to: frozen parameters and the padding.
        self._grad_holes = [self.grad_full[sl.offset:sl.stop] for sl, g in zip(self.layout.slots, self.groups)
                            if g == FROZEN]
        if self.layout.padding:
            self._grad_holes.append(self.grad_full[self.layout.numel:])
        grad_dtype = (master_dtype if (fp32_grad_accum or self.reduce_dtype == master_dtype)
                      else self.reduce_dtype)
        self.grad_shard = torch.zeros(s, dtype=grad_dtype, device=self.device)
        # ReduceScatter lands here while in flight when it cannot land in grad_shard directly
        # (accumulating onto earlier micro-batches, or a different dtype).
        self._rs_scratch: torch.Tensor | None = None
        self._rs_src: torch.Tensor | None = None  # reduce-dtype copy of grad_full, while in flight

        self.gathered = False
        self.bwd = BackwardState()
        self.pending_gather: Pending | None = None
        self.grad_allocated = False
        self.grad_shard_fresh = True  # nothing accumulated since zero_grad: RS may overwrite

        with torch.no_grad():
            for p in self.params:
                p.data = self._empty
                p.grad = None
        self._full_storage.resize_(0)
        self._grad_storage.resize_(0)

    # ---- bookkeeping ------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def has_trainable(self) -> bool:
        return bool(self.trainable)

    # ---- parameters ---------------------------------------------------------------------
    def gather(self, comm: Collectives, async_op: bool) -> Pending:
        """Allocate ``full`` and AllGather every rank's ``param_shard`` into it (guide §9.3)."""
        self._full_storage.resize_(self._full_nbytes)
        for p, v in zip(self.params, self._views):
            p.data = v
        self.gathered = True
        self.pending_gather = comm.all_gather(self.full, self.param_shard, self.name, async_op=async_op)
        if not async_op:
            self.pending_gather = None
        return self.pending_gather

    def wait_gather(self) -> None:
        if self.pending_gather is not None:
            self.pending_gather.wait()
            self.pending_gather = None

    def free(self) -> None:
        """Drop the gathered parameters: ``resize_(0)`` of the storage the views share."""
        self.wait_gather()
        for p in self.params:
            p.data = self._empty
        self._full_storage.resize_(0)
        self.gathered = False

    def refresh_param_shard(self) -> None:
        """After the optimizer step: the compute-dtype shard ← the fp32 master (guide §9.1 step 4)."""
        if self.param_shard is not self.master:
            self.param_shard.copy_(self.master)

    # ---- gradients ----------------------------------------------------------------------
    def collect_grads(self) -> list[bool]:
        """After the unit's backward: move each parameter's ``.grad`` into ``grad_full``.

        Autograd leaves each gradient in a tensor of its own (``.grad`` is unset during backward,
        so accumulation steals the computed tensor, no extra add); one fused copy then packs
        them into the flat buffer the ReduceScatter reads — the copy-in every FSDP does. A
        ``grad_full`` still allocated holds the local sum of earlier ``no_sync`` micro-batches
        (``reduce_every_microbatch=False``) and is added to instead. Parameters that got no
        gradient count as zero. Returns, per trainable parameter, whether it got a gradient.
        """
        fresh = not self.grad_allocated
        if fresh:
            self._grad_storage.resize_(self._grad_nbytes)
            self.grad_allocated = True
            for hole in self._grad_holes:
                hole.zero_()
        dst, src, got = [], [], []
        for p, view in zip(self._trainable_params, self._grad_views):
            g = p.grad
            got.append(g is not None)
            if g is None:
                if fresh:
                    view.zero_()
                continue
            dst.append(view)
            src.append(g)
            p.grad = None
        if dst:
            if fresh:
                torch._foreach_copy_(dst, src)
            else:
                torch._foreach_add_(dst, src)
        return got

    def reduce(self, comm: Collectives) -> tuple[Pending, "callable"]:
        """Issue the ReduceScatter of ``grad_full``; return it and the finisher to run after wait.

        The mean over ranks of this rank's slice lands in ``grad_shard`` directly when nothing is
        accumulated there yet and the dtypes agree; otherwise in a scratch shard that the
        finisher adds in (gradient accumulation across micro-batches, guide §5, §9.2).
        """
        src = self.grad_full
        if self.reduce_dtype != self.param_dtype:
            src = self._rs_src = self.grad_full.to(self.reduce_dtype)
        direct = self.grad_shard_fresh and self.grad_shard.dtype == self.reduce_dtype
        if not direct:  # a shard-sized buffer in flight, dropped by the finisher
            self._rs_scratch = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
        pending = comm.reduce_scatter_grad(self.grad_shard, src, self.name, overwrite=self.grad_shard_fresh,
                                           scratch=self._rs_scratch)

        def finish():
            self.grad_shard_fresh = False
            self._rs_src = self._rs_scratch = None
            self.free_grads()

        return pending, finish

    def free_grads(self) -> None:
        if self.grad_allocated:
            self._grad_storage.resize_(0)
            self.grad_allocated = False

    # ---- memory -------------------------------------------------------------------------
    def gathered_bytes_when_full(self) -> int:
        return self._full_nbytes

    def gathered_nbytes(self) -> int:
        """Bytes of the gathered parameters now, measured from the storage (0 when freed)."""
        return self._full_storage.nbytes()
