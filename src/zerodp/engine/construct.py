"""What a stage engine does once, at ``parallelize``: its shard groups and flat groups.

:class:`Construction` is the part of :class:`~zerodp.engine.base.StageEngine` that builds
``self.groups`` from the module (guide §12.1): the shard-group size (hybrid sharding, guide §14),
the buckets of stages 0-2, one :class:`~zerodp.engine.group.FlatGroup` per bucket or unit, the
start-up consistency check across ranks, rank 0's values broadcast into every group — and, after
construction, the checks that what it planned still holds (buffers broadcast by DDP's rule,
``requires_grad`` unchanged). The dtypes are the engine's (:meth:`~zerodp.engine.config.Dtypes.of`),
the optimizer part over the groups the engine's too (:func:`zerodp.engine.master.build_master`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.comm import wait_serving
from zerodp.engine.config import ALIGNED, Dtypes
from zerodp.engine.group import FlatGroup
from zerodp.engine.layout import FlatLayout
from zerodp.engine.optimizer_plan import OptimizerPlan, state_cost
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


def shard_group_size(asked: int | None, policy, world_size: int) -> int:
    """Ranks per shard group (guide §14): ``shard_size=`` as asked, else one node (torchrun's
    ``LOCAL_WORLD_SIZE``) when it divides the world, else every rank. Stage 0 shards nothing."""
    g = asked
    if not policy.shard_master:
        return world_size
    if g is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        g = int(local) if local.isdigit() and int(local) > 0 and world_size % int(local) == 0 else world_size
    if world_size % g:
        raise ValueError(f"shard_size={g} does not divide the {world_size} ranks: use a divisor of the "
                         "world size (usually the GPUs per node)")
    return g


class Construction:
    """Building the flat groups (module docstring): one part of every stage engine
    (``engine.construction``), built from what it builds with — the module and its trainable
    parameters, the options, the stage's policy, the collectives, the pool the groups' gradient
    buffers return to — which the stage calls in its ``__init__``; each step returns what it
    built. It keeps the owners' ledger across groups, and serves the checks after construction."""

    def __init__(self, module: nn.Module, named_params: list[tuple[str, nn.Parameter]], config, policy, *,
                 group, device: torch.device, deferred: bool, comm, shard_comm, replica_comm, control, grad_pool,
                 state_buffers: list):
        self.module = module
        self.named_params = named_params
        self.trainable = {n for n, _ in named_params}
        self.config = config
        self.policy = policy
        self.group = group
        self.world_size = comm.world_size
        self.device = device
        self.deferred = deferred
        self.comm, self.shard_comm, self.replica_comm, self.control = comm, shard_comm, replica_comm, control
        self.grad_pool = grad_pool
        self.state_buffers = state_buffers
        self._owners: OwnerLedger | None = None  # tensor ownership: owners balanced across groups

    def buckets(self, config, plan: OptimizerPlan, param_dtype: torch.dtype) -> list[list[int]]:
        """Stages 0-2: which parameters share a bucket (:func:`zerodp.plan.units.plan_buckets`,
        the planner's rule); the buckets of the groups read whole (the optimizer plan's
        ``whole_groups``) sized to the shard group."""
        return plan_buckets([p.numel() for _, p in self.named_params], list(plan.group_of), param_dtype.itemsize,
                            config.sync, config.bucket_mb, config.first_bucket_mb, whole_groups=plan.whole_groups,
                            shard_size=self.shard_comm.world_size)

    def new_group(self, index: int, label: str, entries: list[tuple[str, nn.Parameter, int]], plan: OptimizerPlan,
                  dtypes: Dtypes) -> FlatGroup:
        """One bucket or unit over ``entries`` (name, parameter, param group)."""
        layout = None
        if plan.whole_groups and self.policy.whole_tensors == ALIGNED and any(g in plan.whole_groups
                                                                              for _, _, g in entries):
            # Tensor ownership: every tensor whole in its owner's slice, balanced across the groups
            # by elements and by the optimizer state each tensor costs.
            if self._owners is None:
                self._owners = OwnerLedger(self.shard_comm.world_size)
            kinds = plan.state_kinds
            costs = [state_cost(kinds[g] if 0 <= g < len(kinds) else None, tuple(p.shape)) for _, p, g in entries]
            layout = FlatLayout.owned([(n, tuple(p.shape)) for n, p, _ in entries], self.shard_comm.world_size,
                                      self._owners, costs)
        quant = self.config.quant_block
        group = FlatGroup(index, label, entries, self.policy, self.shard_comm, dtypes=dtypes,
                          replicas=self.replica_comm, quant_params=quant if self.config.quantize_params else 0,
                          quant_grads=quant if self.config.quantize_grads else 0, layout=layout)
        group.grads.pool = self.grad_pool
        return group

    def check_consistency(self, description: dict) -> None:
        """Start-up check: every rank must describe the same model and the same flat layout.

        Gathers each rank's description (names, shapes, dtypes, buckets, stage, world) and
        compares it with rank 0's on every rank, so that all ranks raise the same clear error
        instead of hanging in a mismatched collective or silently mixing gradients.
        """
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, description, group=self.group)
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
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        control, timeout_s = self.control, self.comm.timeout_s
        for t in tensors:
            work = dist.broadcast(t, src=src, group=self.group, async_op=True)
            if timeout_s is None:
                work.wait()
                continue
            began = time.monotonic()
            error = wait_serving(work, began, timeout_s, control, "broadcast 'buffers'")
            if error is not None:
                control.failed("broadcast 'buffers'", error, time.monotonic() - began >= 0.9 * timeout_s)
                raise error

    @torch.no_grad()
    def init_groups(self, groups: list[FlatGroup], master_dtype: torch.dtype, extra_broadcast: list[torch.Tensor] = (),
                    materialize: Callable[[FlatGroup], None] | None = None) -> None:
        """Fill every group from the module's values — rank 0's, broadcast as DDP does at
        construction — and build its gradient buffers."""
        for g in groups:
            if self.deferred and materialize is not None:
                materialize(g)  # a model built on the meta device: the stage gives values (§9.3)
            values = torch.zeros(g.layout.padded_numel, dtype=master_dtype, device=self.device)
            for slot, p in zip(g.layout.slots, g.params):
                values[slot.offset:slot.stop].copy_(p.detach().reshape(-1))
            self.broadcast_from_rank0([values])
            g.init_values(values)
            g.grads.init(g.device)
            del values
        self.broadcast_from_rank0(list(extra_broadcast))

    @torch.no_grad()
    def broadcast_buffers(self) -> None:
        """DDP's ``broadcast_buffers=True``: at each forward every rank takes rank 0's buffers
        (e.g. BatchNorm's running statistics), one flat broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, sub, local in self.state_buffers:
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
        for name, p in self.module.named_parameters():
            planned = name in self.trainable
            if p.requires_grad != planned:
                raise RuntimeError(
                    f"parameter {name!r} was {'trainable' if planned else 'frozen'} when parallelize built the engine "
                    f"and is {'trainable' if p.requires_grad else 'frozen'} now: the engine's buckets and optimizer "
                    "are planned at parallelize. Set requires_grad before parallelize (a parameter to train later "
                    "can stay trainable in a param group with lr=0 until then), or save a checkpoint and build a new "
                    "engine over a fresh model with the new requires_grad")
