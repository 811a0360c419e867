"""What a stage engine does once, at ``parallelize``: its dtypes, shard groups and flat groups.

:class:`Construction` is the part of :class:`~zerodp.engine.base.StageEngine` that builds
``self.groups`` from the module (guide §12.1): the compute, reduce and accumulation dtypes, the
shard-group size (hybrid sharding, guide §14), one :class:`~zerodp.engine.group.FlatGroup` per
bucket or unit, the start-up consistency check across ranks, rank 0's values broadcast into
every group, the optimizer part over the master built from the optimizer plan (guide §12.3;
:func:`zerodp.engine.master.build_master`) — and, after
construction, the checks that what it planned still holds (buffers broadcast by DDP's rule,
``requires_grad`` unchanged).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.comm import wait_serving
from zerodp.engine.config import ALIGNED, Dtypes, parse_dtype
from zerodp.engine.group import FlatGroup
from zerodp.engine.layout import FlatLayout
from zerodp.engine.optim import from_built
from zerodp.engine.master import build_master
from zerodp.engine.optimizer_plan import FLAT, OWNER, choose_layout, state_cost
from zerodp.plan.units import OwnerLedger, plan_buckets



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


class Construction:
    """Building the flat groups (module docstring): one part of every stage engine
    (``engine.construction``), which the stage calls in its ``__init__`` and which keeps what the
    building decided (the optimizer's placement, the owners' ledger) for the checks after it."""

    def __init__(self, engine):
        self.engine = engine
        self._owners: OwnerLedger | None = None  # tensor ownership: owners balanced across groups
        self._per_param_targets = False  # an adopted optimizer: one target per parameter

    def set_dtypes(self, param_dtype: torch.dtype) -> None:
        """The engine's dtypes (:class:`~zerodp.engine.config.Dtypes`, guide §1, §9) from the policy
        asked for, the compute dtype and ``master_dtype=``."""
        asked = parse_dtype(self.engine.config.master_dtype, "master_dtype")
        self.engine.dtypes = Dtypes.resolve(self.engine.mixed_precision, param_dtype, asked)

    def shard_size(self) -> int:
        """Ranks per shard group (guide §14): ``config.shard_size``, else one node (torchrun's
        ``LOCAL_WORLD_SIZE``) when it divides the world, else every rank. Stage 0 shards nothing."""
        g = self.engine.config.shard_size
        if not self.engine.policy.shard_master:
            return self.engine.world_size
        if g is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            g = int(local) if local.isdigit() and int(local) > 0 and self.engine.world_size % int(local) == 0 \
                else self.engine.world_size
        if self.engine.world_size % g:
            raise ValueError(f"shard_size={g} does not divide the {self.engine.world_size} ranks: use a divisor of the "
                             "world size (usually the GPUs per node)")
        return g

    def buckets(self, config) -> list[list[int]]:
        """Stages 0-2: which parameters share a bucket (:func:`zerodp.plan.units.plan_buckets`,
        the planner's rule); the buckets of the groups read whole (the optimizer plan's
        ``whole_groups``) sized to the shard group."""
        plan = self.engine.optimizer_plan
        return plan_buckets([p.numel() for _, p in self.engine.named_params], list(plan.group_of),
                            self.engine.dtypes.param.itemsize, config.sync, config.bucket_mb, config.first_bucket_mb,
                            whole_groups=plan.whole_groups, shard_size=self.engine.shard_comm.world_size)

    def new_group(self, index: int, label: str, entries: list[tuple[str, nn.Parameter, int]]) -> FlatGroup:
        quant = self.engine.config.quant_block
        layout = None
        whole = self.engine.optimizer_plan.whole_groups
        if whole and self.engine.policy.whole_tensors == ALIGNED and any(g in whole for _, _, g in entries):
            # Tensor ownership: every tensor whole in its owner's slice, balanced across the groups
            # by elements and by the optimizer state each tensor costs.
            if self._owners is None:
                self._owners = OwnerLedger(self.engine.shard_comm.world_size)
            ledger = self._owners
            kinds = self.engine.optimizer_plan.state_kinds
            costs = [state_cost(kinds[g] if 0 <= g < len(kinds) else None, tuple(p.shape)) for _, p, g in entries]
            layout = FlatLayout.owned([(n, tuple(p.shape)) for n, p, _ in entries],
                                      self.engine.shard_comm.world_size, ledger,
                                      costs)
        e = self.engine
        group = FlatGroup(index, label, entries, e.policy, e.shard_comm, dtypes=e.dtypes, replicas=e.replica_comm,
                         quant_params=quant if self.engine.config.quantize_params else 0,
                         quant_grads=quant if self.engine.config.quantize_grads else 0, layout=layout)
        group.grads.pool = self.engine.machine.grad_pool
        return group

    def check_consistency(self, description: dict) -> None:
        """Start-up check: every rank must describe the same model and the same flat layout.

        Gathers each rank's description (names, shapes, dtypes, buckets, stage, world) and
        compares it with rank 0's on every rank, so that all ranks raise the same clear error
        instead of hanging in a mismatched collective or silently mixing gradients.
        """
        gathered: list = [None] * self.engine.world_size
        dist.all_gather_object(gathered, description, group=self.engine.group)
        for r, other in enumerate(gathered):
            diff = describe_difference(gathered[0], other)
            if diff:
                raise RuntimeError(
                    f"ranks disagree on the model or its layout (rank 0 vs rank {r}): {diff}. Every "
                    "rank must build the same model (same parameter names, shapes, dtypes, "
                    "requires_grad) with the same engine options before parallelize()"
                )

    @torch.no_grad()
    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """DDP's start: every replica begins with rank 0's values."""
        if self.engine.world_size == 1:
            return
        src = dist.get_global_rank(self.engine.group, 0) if self.engine.group is not None else 0
        control = getattr(self.engine, "control", None)  # built after the first broadcasts, at construction
        timeout_s = self.engine.comm.timeout_s
        for t in tensors:
            work = dist.broadcast(t, src=src, group=self.engine.group, async_op=True)
            if timeout_s is None:
                work.wait()
                continue
            began = time.monotonic()
            error = wait_serving(work, began, timeout_s, control, "broadcast 'buffers'")
            if error is not None:
                if control is not None:
                    control.failed("broadcast 'buffers'", error, time.monotonic() - began >= 0.9 * timeout_s)
                raise error

    @torch.no_grad()
    def init_groups(self, extra_broadcast: list[torch.Tensor] = (),
                    materialize: Callable[[FlatGroup], None] | None = None) -> None:
        """Fill every group from the module's values — rank 0's, broadcast as DDP does at
        construction — build its gradient buffers, and the optimizer over the master tensors."""
        for g in self.engine.groups:
            if self.engine.deferred and materialize is not None:
                materialize(g)  # a model built on the meta device: the stage gives values (§9.3)
            values = torch.zeros(g.layout.padded_numel, dtype=self.engine.dtypes.master, device=self.engine.device)
            for slot, p in zip(g.layout.slots, g.params):
                values[slot.offset:slot.stop].copy_(p.detach().reshape(-1))
            self.broadcast_from_rank0([values])
            g.init_values(values)
            g.grads.init(g.device)
            del values
        self.broadcast_from_rank0(list(extra_broadcast))
        self.build_optimizer()
        position = {n: i for i, (n, _) in enumerate(self.engine.named_params)}
        # Per group, per trainable parameter: its index in named_params (used-flags at step()).
        self.engine._used_index = [[position[g.names[i]] for i in g.trainable] for g in self.engine.groups]
        self.engine.machine.reset_used()

    def build_optimizer(self) -> None:
        """The optimizer part over every group's master, from the optimizer plan (guide §12.3;
        :func:`zerodp.engine.master.build_master`)."""
        e, plan = self.engine, self.engine.optimizer_plan
        e.optimizer_plan = dataclasses.replace(plan, built=None)  # the stand-in build is pointed at the master once
        per_param = e.policy.shard_params or e.config.find_unused_parameters or self._per_param_targets
        e.master = build_master(plan, e.groups, e.policy, e.shard_comm, e.dtypes.master, e.device,
                                per_param=per_param, declared_elementwise=e.config.elementwise_optimizer)

    def rebuild_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Adopt an optimizer the script built over the module's parameters after the wrap
        (:mod:`zerodp.engine.adopt`): its class, defaults and param groups over the master, one
        target per parameter (a bucket may mix its groups), the engine's optimizer from now on."""
        config, plan = self.engine.config, self.engine.optimizer_plan
        if choose_layout(optimizer, config.elementwise_optimizer, config.optimizer_layout) != FLAT \
                and plan.placement == FLAT:
            raise ValueError(f"{type(optimizer).__name__} steps whole tensors, and the engine laid its buffers out "
                             "for flat shards at parallelize: pass it there, parallelize(model, optimizer=[...]), "
                             "instead of building it after the wrap")
        factory, user_groups = from_built(optimizer, self.engine._module)
        new = plan.rebuilt(optimizer, factory, user_groups, self.engine.named_params, config.optimizer_layout)
        if new.placement == OWNER:  # the buckets were laid out for the optimizer given at parallelize
            group_of = new.group_by_name
            cut = [s.name for g in self.engine.groups
                   if not g.layout.aligned and self.engine.policy.whole_tensors == ALIGNED
                   for s in g.layout.slots if group_of.get(s.name, -1) in new.whole_groups]
            if cut:
                raise ValueError(f"{type(optimizer).__name__} reads {cut[0]!r} whole, and the engine laid it out in a "
                                 "flat bucket for the optimizer given at parallelize: pass this one there, "
                                 "parallelize(model, optimizer=[...]), instead of building it after the wrap")
        self.engine.config = dataclasses.replace(config, param_groups=user_groups)
        self.engine.optimizer_plan = new
        self._per_param_targets = True
        self.build_optimizer()
        self.engine._facade = None

    def start_clock(self) -> None:
        """The end of construction (each stage calls it last): the optimizer given to parallelize
        becomes the engine's, with any state it loaded (:meth:`Adoption.take_given`), and trace time
        zero is aligned across ranks (right after a collective such as the check)."""
        self.engine.adoption.take_given(self.engine)
        self.engine.recorder.t0 = self.engine.recorder.clock()
        self.engine._last_step_end = None

    @torch.no_grad()
    def broadcast_buffers(self) -> None:
        """DDP's ``broadcast_buffers=True``: at each forward every rank takes rank 0's buffers
        (e.g. BatchNorm's running statistics), one flat broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, sub, local in self.engine.state_buffers:
            buf = getattr(sub, local)
            by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs]) if len(bufs) > 1 else bufs[0].reshape(-1).clone()
            self.broadcast_from_rank0([flat])
            offset = 0
            for b in bufs:
                new = flat[offset:offset + b.numel()].view_as(b)
                if not torch.equal(b, new):  # leave unchanged buffers alone: a graph may hold them
                    b.copy_(new)
                offset += b.numel()

    def check_requires_grad(self) -> None:
        """A parameter frozen or unfrozen after ``parallelize``: its flat group and the optimizer
        were planned without it (or with it), so refuse in one line rather than train it wrong."""
        for name, p in self.engine._module.named_parameters():
            planned = name in self.engine.optimizer_plan.group_by_name
            if p.requires_grad != planned:
                raise RuntimeError(
                    f"parameter {name!r} was {'trainable' if planned else 'frozen'} when parallelize built the engine "
                    f"and is {'trainable' if p.requires_grad else 'frozen'} now: the engine's buckets and optimizer "
                    "are planned at parallelize. Set requires_grad before parallelize (a parameter to train later "
                    "can stay trainable in a param group with lr=0 until then), or save a checkpoint and build a new "
                    "engine over a fresh model with the new requires_grad")
