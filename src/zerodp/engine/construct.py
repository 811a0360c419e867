"""What a stage engine does once, at ``parallelize``: its dtypes, shard groups and flat groups.

:class:`Construction` is the part of :class:`~zerodp.engine.base.StageEngine` that builds
``self.groups`` from the module (guide §12.1): the compute, reduce and accumulation dtypes, the
shard-group size (hybrid sharding, guide §14), one :class:`~zerodp.engine.group.FlatGroup` per
bucket or unit, the start-up consistency check across ranks, rank 0's values broadcast into
every group, the master tensors and the stock optimizer over them (guide §12.3) — and, after
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
from zerodp.engine.config import ALIGNED, EXCHANGE, Dtypes, parse_dtype
from zerodp.engine.group import FlatGroup
from zerodp.engine.exchange import OwnerExchange
from zerodp.engine.layout import FlatLayout
from zerodp.engine.optim import UserGroups, from_built
from zerodp.engine.master import (FLAT, OWNER, MasterOptimizer, Target, choose_layout, group_state_kinds, param_targets,
                                  check_reads_alone, probe_factory, state_cost, whole_groups, whole_targets)
from zerodp.plan.units import OwnerLedger, plan_buckets

#: On CPU the stock optimizer's per-tensor path makes ~8 passes over each tensor it updates; over
#: chunks of this many elements (512 KiB of fp32) those passes stay in cache, where over one flat
#: buffer of millions of elements each pass goes to memory (AdamW on 11M elements: ~2-3x faster).
CPU_OPTIMIZER_CHUNK = 1 << 17


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


def resolve_param_groups(named_params: list[tuple[str, nn.Parameter]],
                         rule: Callable[[str, nn.Parameter], dict] | None) -> tuple[list[dict], list[int]]:
    """Map each parameter to an optimizer param group (e.g. no weight decay on norms and biases).

    ``rule(name, param)`` returns the group's options; parameters with equal options share a
    group, and each group gets its own flat buffers (a bucket never mixes groups). Returns the
    option dicts and, per parameter, its group index. The groups of an optimizer the user built
    (:class:`~zerodp.engine.optim.UserGroups`) are kept as they were, in their order.
    """
    if isinstance(rule, UserGroups):
        return [dict(o) for o in rule.options], [rule.group_of[id(p)] for _, p in named_params]
    options: list[dict] = []
    index: list[int] = []
    for name, p in named_params:
        opts = {} if rule is None else rule(name, p)
        if not isinstance(opts, dict):
            raise ValueError(
                f"param_groups({name!r}, param) returned {type(opts).__name__}; it must return a dict "
                "of optimizer options such as {'weight_decay': 0.0} (or {} for the defaults)"
            )
        if "params" in opts:
            raise ValueError(f"param_groups({name!r}, param) must not return 'params': the engine fills it")
        if opts not in options:
            options.append(dict(opts))
        index.append(options.index(opts))
    return options, index


class Construction:
    """Building the flat groups (module docstring): one part of every stage engine
    (``engine.construction``), which the stage calls in its ``__init__`` and which keeps what the
    building decided (the optimizer's placement, the owners' ledger) for the checks after it."""

    def __init__(self, engine):
        self.engine = engine
        self._placement: str | None = None  # chosen at the first group laid out (placement)
        self._whole_groups: frozenset[int] = frozenset()
        self._state_kinds: list = []
        self._probe: torch.optim.Optimizer | None = None  # the factory's one build, for build_master
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

    @property
    def placement(self) -> str:
        """Where the optimizer runs (guide §12.3): ``"flat"`` (1/N slices of flattened parameters)
        or ``"owner"`` (tensor ownership: whole tensors with their shapes, on owner-aligned
        layouts). Chosen once, before the first group is laid out, from the optimizer's class
        (:func:`zerodp.engine.master.choose_layout`, ``config.optimizer_layout``): the factory is
        built once over one-element stand-ins to learn it."""
        got = self._placement
        if got is None:
            params = [(n, tuple(p.shape), g) for (n, p), g in zip(self.engine.named_params, self.engine.param_group_of)]
            probe = probe_factory(self.engine._factory, self.engine.group_options, params, self.engine.device)
            got, whole, kinds = FLAT, frozenset(), []  # a factory that returns no optimizer: MasterOptimizer says so
            if isinstance(probe, torch.optim.Optimizer):
                config = self.engine.config
                got = choose_layout(probe, config.elementwise_optimizer, config.optimizer_layout)
                if self.engine.policy.shard_master:
                    check_reads_alone(probe)
                whole = whole_groups(probe, got, self.engine.config.optimizer_layout)
                kinds = group_state_kinds(probe)
                self._probe = probe
            self._placement, self._whole_groups, self._state_kinds = got, whole, kinds
        return got

    @property
    def whole_groups(self) -> frozenset[int]:
        """The param groups whose tensors the optimizer reads whole
        (:func:`zerodp.engine.master.whole_groups`): at stages 1-2 they lie in owner-aligned
        buckets; at stage 3 the units stay flat and the owner exchange brings each of their
        tensors whole to one rank for the step (:mod:`zerodp.engine.exchange`)."""
        if self.placement != OWNER or not self.engine.policy.shard_master:
            return frozenset()
        return self._whole_groups

    def buckets(self, config) -> list[list[int]]:
        """Stages 0-2: which parameters share a bucket (:func:`zerodp.plan.units.plan_buckets`,
        the planner's rule); the buckets of :attr:`whole_groups` sized to the shard group."""
        return plan_buckets([p.numel() for _, p in self.engine.named_params], self.engine.param_group_of,
                            self.engine.dtypes.param.itemsize, config.sync, config.bucket_mb, config.first_bucket_mb,
                            whole_groups=self.whole_groups, shard_size=self.engine.shard_comm.world_size)

    def new_group(self, index: int, label: str, entries: list[tuple[str, nn.Parameter, int]]) -> FlatGroup:
        quant = self.engine.config.quant_block
        layout = None
        whole = self.whole_groups
        if whole and self.engine.policy.whole_tensors == ALIGNED and any(g in whole for _, _, g in entries):
            # Tensor ownership: every tensor whole in its owner's slice, balanced across the groups
            # by elements and by the optimizer state each tensor costs.
            if self._owners is None:
                self._owners = OwnerLedger(self.engine.shard_comm.world_size)
            ledger = self._owners
            kinds = self._state_kinds
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
        """The master optimizer over targets of every group's master (guide §12.3)."""
        targets: list[Target] = []
        self.engine._target_slices: list[tuple[FlatGroup, int, int]] = []  # the gradient each target reads
        for g in self.engine.groups:
            for t in self.targets(g.master, g.layout, g.master_start):
                lo = t.flat_start - g.master_start
                targets.append(t)
                self.engine._target_slices.append((g, lo, lo + t.tensor.numel()))
        self.engine.master = self.build_master(targets, self.exchange())

    def rebuild_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Adopt an optimizer the script built over the module's parameters after the wrap
        (:mod:`zerodp.engine.adopt`): its class, defaults and param groups over the master, one
        target per parameter (a bucket may mix its groups), the engine's optimizer from now on."""
        config = self.engine.config
        if choose_layout(optimizer, config.elementwise_optimizer, config.optimizer_layout) != FLAT \
                and self.placement == FLAT:
            raise ValueError(f"{type(optimizer).__name__} steps whole tensors, and the engine laid its buffers out "
                             "for flat shards at parallelize: pass it there, parallelize(model, optimizer=[...]), "
                             "instead of building it after the wrap")
        factory, user_groups = from_built(optimizer, self.engine._module)
        self.engine.config = dataclasses.replace(self.engine.config, param_groups=user_groups)
        options, group_of = resolve_param_groups(self.engine.named_params, user_groups)
        self.engine.group_options, self.engine.param_group_of = options, group_of
        self.engine._group_by_name = {n: g for (n, _), g in zip(self.engine.named_params, self.engine.param_group_of)}
        if self.placement == OWNER:  # the buckets were laid out for the optimizer given at parallelize
            self._whole_groups = whole_groups(optimizer, OWNER, self.engine.config.optimizer_layout)
            cut = [s.name for g in self.engine.groups
                   if not g.layout.aligned and self.engine.policy.whole_tensors == ALIGNED
                   for s in g.layout.slots if self.engine._group_by_name.get(s.name, -1) in self._whole_groups]
            if cut:
                raise ValueError(f"{type(optimizer).__name__} reads {cut[0]!r} whole, and the engine laid it out in a "
                                 "flat bucket for the optimizer given at parallelize: pass this one there, "
                                 "parallelize(model, optimizer=[...]), instead of building it after the wrap")
        self.engine._factory = factory
        self._per_param_targets = True
        self.build_optimizer()
        self.engine._facade = None

    def build_master(self, targets: list[Target], exchange: OwnerExchange | None = None) -> MasterOptimizer:
        e = self.engine
        built, self._probe = self._probe, None  # the optimizer that learned the placement, used once
        return MasterOptimizer(e._factory, targets, e.group_options, e.config.elementwise_optimizer,
                               placement=self.placement, exchange=exchange, built=built)

    def exchange(self) -> OwnerExchange | None:
        """Stage 3 on the ownership path: the owner exchange of the tensors read whole, their
        owners balanced by the optimizer state each costs (:mod:`zerodp.engine.exchange`)."""
        whole = self.whole_groups
        if self.engine.policy.whole_tensors != EXCHANGE or not whole:
            return None
        group_of, kinds = self.engine._group_by_name, self._state_kinds

        def exchanged(name: str) -> int | None:
            g = group_of.get(name, -1)
            return g if g in whole else None

        def cost(name: str, shape: tuple[int, ...]) -> int:
            g = group_of.get(name, -1)  # (frozen: no state)
            return 0 if g < 0 else state_cost(kinds[g] if g < len(kinds) else None, shape)

        e = self.engine
        return OwnerExchange(e.groups, exchanged, cost, e.shard_comm, e.dtypes.master, e.device)

    def targets(self, tensor: torch.Tensor, layout: FlatLayout, flat_start: int) -> list[Target]:
        """Optimizer targets over a held range of a flat buffer, in cache-sized chunks on CPU (see
        :func:`zerodp.engine.master.param_targets`): per parameter where a parameter may go unused
        in a step (stage 3, or ``find_unused_parameters=True``), so that the optimizer can skip it
        whole; otherwise across parameters, fewer tensors for the optimizer's per-tensor work. On the
        ownership path each parameter this rank holds is one target, whole, with its shape — in an
        owner-aligned layout or a full replica (stage 0) — and a flat bucket of an elementwise
        optimizer beside it (:attr:`whole_groups`) gives per-parameter pieces."""
        def group_of(name: str) -> int:
            return self.engine._group_by_name.get(name, -1)

        if self.placement == OWNER and (layout.aligned or not self.engine.policy.shard_master):
            return whole_targets(tensor, layout, flat_start, group_of)
        if self.placement == OWNER and self.engine.policy.whole_tensors == ALIGNED \
                and any(group_of(s.name) in self._whole_groups for s in layout.slots):
            raise ValueError("a tensor of a per-tensor optimizer lies in a flat bucket, cut across ranks (zerodp "
                             "internal error: please report it)")
        chunk = CPU_OPTIMIZER_CHUNK if self.engine.device.type == "cpu" else None
        may_go_unused = self.engine.policy.shard_params or self.engine.config.find_unused_parameters  # units: always
        per_param = may_go_unused or self._per_param_targets \
            or self.placement == OWNER
        return param_targets(tensor, layout, flat_start, group_of, chunk, per_param=per_param)

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
            planned = name in self.engine._group_by_name
            if p.requires_grad != planned:
                raise RuntimeError(
                    f"parameter {name!r} was {'trainable' if planned else 'frozen'} when parallelize built the engine "
                    f"and is {'trainable' if p.requires_grad else 'frozen'} now: the engine's buckets and optimizer "
                    "are planned at parallelize. Set requires_grad before parallelize (a parameter to train later "
                    "can stay trainable in a param group with lr=0 until then), or save a checkpoint and build a new "
                    "engine over a fresh model with the new requires_grad")
