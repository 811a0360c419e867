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
    """Parameters packed back to back, padded so ``padded_numel`` is a multiple of ``world_size``."""

    slots: tuple[Slot, ...]
    world_size: int
    numel: int = field(init=False)
    padded_numel: int = field(init=False)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        total = self.slots[-1].stop if self.slots else 0
        object.__setattr__(self, "numel", total)
        object.__setattr__(self, "padded_numel", -(-total // self.world_size) * self.world_size)

    @classmethod
    def pack(cls, named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> "FlatLayout":
        """Lay parameters out in the given order with no gaps between them."""
        slots, offset = [], 0
        for name, shape in named_shapes:
            slot = Slot(name, tuple(int(s) for s in shape), offset)
            slots.append(slot)
            offset = slot.stop
        return cls(tuple(slots), world_size)

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

    def spans(self, start: int, stop: int) -> list[Span]:
        """Every parameter run that lies inside flat range ``[start, stop)`` (padding excluded)."""
        out = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(stop, slot.stop)
            if lo < hi:
                out.append(Span(slot, lo - slot.offset, hi - slot.offset, lo))
        return out

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "shard_numel": self.shard_numel,
            "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.slots],
        }
