"""Flat-buffer layout: which parameter lives at which offset, the padding, and who owns what.

guide §12: parameters are grouped into contiguous flat buffers (a *bucket* for stages 0-2, a
*unit* for stage 3), padded to a multiple of the world size N so that rank r owns the contiguous
slice r of every buffer — the slice a ReduceScatter leaves on rank r and an AllGather collects
from it (guide §9). Parameters and gradients are views into these buffers, so collectives run on
big contiguous tensors with no copies.

This module is pure bookkeeping (no torch): the layout is data, because checkpoints and
resharding need it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerodp.plan.units import OwnerLedger


@dataclass(frozen=True)
class Slot:
    """One parameter inside a flat buffer: elements ``[offset, offset + numel)``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Span:
    """The part of one parameter that falls inside a range of a flat buffer.

    ``param_start:param_stop`` indexes the parameter's flattened elements; ``flat_start`` is where
    that run begins in the flat buffer.
    """

    slot: Slot
    param_start: int
    param_stop: int
    flat_start: int

    @property
    def numel(self) -> int:
        return self.param_stop - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    """Parameters in a flat buffer of ``padded_numel`` elements, a multiple of ``world_size``.

    Two placements (guide §12.1):

    - *flat* (:meth:`pack`, ``owners`` None): back to back, padded at the end. Rank r owns the
      contiguous slice r, which cuts tensors at arbitrary element boundaries — exact for an
      elementwise optimizer, the default fast path.
    - *owner-aligned* (:meth:`owned`): each tensor whole in the slice of one rank, its *owner*
      (``owners[i]`` for ``slots[i]``); slice r holds its owner's tensors back to back and every
      slice is padded to the largest one, so padding lies between slices. The same
      ReduceScatter and AllGather then leave whole tensors on their owner, for optimizers that
      read whole tensors (Muon, Adafactor).
    """

    slots: tuple[Slot, ...]
    world_size: int
    owners: tuple[int, ...] | None = None  # owner-aligned: the rank of each slot, else None
    numel: int = field(init=False)  # elements of the parameters (padding excluded)
    padded_numel: int = field(init=False)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        total = sum(s.numel for s in self.slots)
        object.__setattr__(self, "numel", total)
        if self.owners is None:
            extent = self.slots[-1].stop if self.slots else 0
            object.__setattr__(self, "padded_numel", -(-extent // self.world_size) * self.world_size)
            return
        if len(self.owners) != len(self.slots):
            raise ValueError(f"{len(self.owners)} owners for {len(self.slots)} slots")
        loads = self.owned_numels()
        object.__setattr__(self, "padded_numel", max(loads, default=0) * self.world_size)
        for slot, r in zip(self.slots, self.owners):
            lo, hi = self.shard_range(r)
            if not lo <= slot.offset <= slot.stop <= hi:
                raise ValueError(f"{slot.name} at [{slot.offset}, {slot.stop}) lies outside the slice "
                                 f"[{lo}, {hi}) of its owner, rank {r}")

    @classmethod
    def pack(cls, named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> "FlatLayout":
        """Lay parameters out in the given order with no gaps between them."""
        slots, offset = [], 0
        for name, shape in named_shapes:
            slot = Slot(name, tuple(int(s) for s in shape), offset)
            slots.append(slot)
            offset = slot.stop
        return cls(tuple(slots), world_size)

    @classmethod
    def owned(cls, named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int,
              ledger: OwnerLedger | None = None, costs: list[int] | None = None) -> "FlatLayout":
        """Owner-aligned layout: each tensor whole on one rank (see the class docstring).

        Owners by :meth:`zerodp.plan.units.OwnerLedger.assign` — largest first to the rank with
        the fewest elements of this group (LPT), then, with more tensors than ranks, rebalanced
        by optimizer state (``costs``, default the sizes) within a slice of max(LPT's, 1.01 × the
        even share) — deterministic, the same on every rank. ``ledger`` carries what each rank
        owns across groups and records this one. Inside slice r the owner's tensors keep the
        given order (forward order, as in :meth:`pack`)."""
        shapes = [tuple(int(s) for s in shape) for _, shape in named_shapes]
        sizes = [math.prod(s) for s in shapes]
        ledger = ledger if ledger is not None else OwnerLedger(world_size)
        if ledger.n != world_size:
            raise ValueError(f"the owner ledger counts {ledger.n} ranks, the layout {world_size}")
        owners = ledger.assign(sizes, costs)
        mine = [0] * world_size
        for n, r in zip(sizes, owners):
            mine[r] += n
        shard = max(mine, default=0)
        fill = [r * shard for r in range(world_size)]
        slots = []
        for (name, _), shape, n, r in zip(named_shapes, shapes, sizes, owners):
            slots.append(Slot(name, shape, fill[r]))
            fill[r] += n
        return cls(tuple(slots), world_size, tuple(owners))

    @property
    def aligned(self) -> bool:
        """True for an owner-aligned layout (every tensor whole on one rank)."""
        return self.owners is not None

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns: padded_numel / N."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat range ``[start, stop)`` owned by ``rank`` (slice r of the buffer)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def owned_numels(self) -> list[int]:
        """Parameter elements in each rank's slice (padding excluded)."""
        if self.owners is not None:
            out = [0] * self.world_size
            for slot, r in zip(self.slots, self.owners):
                out[r] += slot.numel
            return out
        s = -(-(self.slots[-1].stop if self.slots else 0) // self.world_size)
        return [sum(sp.numel for sp in self.spans(r * s, (r + 1) * s)) for r in range(self.world_size)]

    def padding_ranges(self) -> list[tuple[int, int]]:
        """Every flat range ``[start, stop)`` that holds no parameter: the gaps between slots,
        between slices (owner-aligned) and at the end. Nothing writes gradients there."""
        cached = self.__dict__.get("_padding_ranges")
        if cached is not None:
            return list(cached)
        out, at = [], 0
        for slot in sorted(self.slots, key=lambda s: s.offset):
            if slot.offset > at:
                out.append((at, slot.offset))
            at = max(at, slot.stop)
        if at < self.padded_numel:
            out.append((at, self.padded_numel))
        object.__setattr__(self, "_padding_ranges", tuple(out))  # frozen: computed once
        return out

    def owners_of(self, slot: Slot) -> list[int]:
        """The ranks whose slice holds elements of ``slot`` (one when owner-aligned)."""
        if slot.numel == 0 and self.owners is None:
            return []
        s = self.shard_numel
        return list(range(slot.offset // s, (slot.stop - 1) // s + 1)) if slot.numel else []

    def spans(self, start: int, stop: int) -> list[Span]:
        """Every parameter run that lies inside flat range ``[start, stop)`` (padding excluded)."""
        out = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(stop, slot.stop)
            if lo < hi:
                out.append(Span(slot, lo - slot.offset, hi - slot.offset, lo))
        return out

    def cost(self, itemsize: int = 4) -> dict:
        """What the placement costs: padding elements and bytes (of ``itemsize`` per element, as
        each rank's buffers hold them), the elements each rank owns, and the imbalance — the
        largest slice over the mean, in elements and bytes per rank."""
        owned = self.owned_numels()
        mean = self.numel / self.world_size
        extra = self.shard_numel - mean
        return {"placement": "owner" if self.aligned else "flat", "padding": self.padding,
                "padding_bytes": self.padding * itemsize, "owned_numel": owned,
                "imbalance": round(extra, 3), "imbalance_bytes": round(extra * itemsize, 3),
                "imbalance_ratio": round(self.shard_numel / mean, 6) if mean else 1.0}

    def to_dict(self) -> dict:
        slots = [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.slots]
        if self.owners is not None:
            for d, r in zip(slots, self.owners):
                d["owner"] = r
        return {
            "world_size": self.world_size,
            "placement": "owner" if self.aligned else "flat",
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "shard_numel": self.shard_numel,
            "padding": self.padding,
            "slots": slots,
        }
