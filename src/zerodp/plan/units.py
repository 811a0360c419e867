"""Names every part of zerodp shares, defined once (torch-free; units are
``zerodp.plan._common``'s: ``MIB``, a mebibyte — DDP's ``bucket_cap_mb`` and the engine's
``bucket_mb`` count these — and ``fmt_mib``).

``AUTO``: the value that asks for a chosen bucket size (``bucket_mb="auto"``, guide §4);
``STAGE_NAMES``: what stage 0-3 are called (guide §9).
:func:`plan_buckets`: which parameters share a gradient bucket (guide §4), the one plan the engine
(``zerodp.engine.reducer``) and the planner (``zerodp.plan.ownership``) both use;
:func:`lpt_slice`: the slice a bucket of whole tensors needs when they are packed into N slices;
:class:`OwnerLedger`: which rank owns each whole tensor (guide §12.3), the one rule the engine's
``FlatLayout.owned`` and the planner both follow.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from zerodp.plan._common import MIB, fmt_mib  # noqa: F401 - fmt_mib: the engine's stats read it here

AUTO = "auto"
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
#: A bucket of whole tensors (tensor ownership, guide §12.3) closes only once its tensors pack
#: into N slices with at most this much padding, as a share of its parameter elements.
MAX_WHOLE_PADDING = 0.10
#: Owners balance optimizer state by filling a slice up to this much above the even share (or up
#: to the largest-first slice, when that is larger): :meth:`OwnerLedger.assign`.
OWNER_SLACK = 0.01


def lpt_slice(sizes: list[int], n: int) -> int:
    """The largest of ``n`` slices after longest-processing-time packing: ``sizes`` largest first,
    each to the slice holding the fewest elements so far (ties do not change it) — step 1 of
    :meth:`OwnerLedger.assign`, whose slice is at most the larger of this and
    ⌈(1 + OWNER_SLACK)·Σ sizes / n⌉."""
    slices = [0] * n
    for size in sorted(sizes, reverse=True):
        heapq.heapreplace(slices, slices[0] + size)
    return max(slices)


def step_owners(costs: list[int], n: int) -> list[int]:
    """The rank that steps each whole tensor at stage 3 (guide §12.3, the owner exchange): the
    units' slices stay flat and even, and each tensor of a per-tensor optimizer is brought whole
    to one rank for its step. Only the optimizer state then depends on the owners, so they
    balance it alone: tensors by ``costs`` (their state), largest first (ties: the earlier), each
    to the rank with the least cost so far (ties: the lower rank) — LPT over the whole model,
    deterministic, the same on every rank and in the planner."""
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    owners = [0] * len(costs)
    spent = [(0, r) for r in range(n)]  # (cost so far, rank): a heap, the least spent first
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        cost, r = spent[0]
        owners[i] = r
        heapq.heapreplace(spent, (cost + costs[i], r))
    return owners


#: stage 3's owner exchange steps consecutive units together up to this many elements brought
#: whole (fp32: 1 GiB over the shard group, about 6/N of it held by a rank at once), so that the
#: ranks wait for each other once per batch, not once per unit: :func:`exchange_batches`
EXCHANGE_BATCH_NUMEL = 1 << 28


def exchange_batches(sizes: list[int], limit: int = EXCHANGE_BATCH_NUMEL) -> list[list[int]]:
    """Consecutive indices of ``sizes`` (the elements each unit brings whole), grouped while a
    group's total stays within ``limit`` — a unit larger than it alone: one bring, step and send
    back per group (guide §12.3)."""
    out: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if out and total + size <= limit:
            out[-1].append(i)
            total += size
        else:
            out.append([i])
            total = size
    return out


def whole_padding(sizes: list[int], n: int) -> float:
    """Padding of ``sizes`` packed whole into ``n`` slices (:func:`lpt_slice`), as a share of
    their elements."""
    total = sum(sizes)
    return (n * lpt_slice(sizes, n) - total) / total if total else 0.0


@dataclass
class OwnerLedger:
    """What each rank of a shard group of ``n`` owns over the owner-aligned groups laid out so
    far — elements, and the optimizer state they cost — sparse (a rank that owns nothing is
    absent). :meth:`assign` gives one group's owners and records them; carried across the groups
    of an engine (or a plan), so that they balance across groups."""

    n: int
    elements: dict[int, int] = field(default_factory=dict)
    cost: dict[int, int] = field(default_factory=dict)

    def assign(self, sizes: list[int], costs: list[int] | None = None) -> list[int]:
        """The owner of each tensor of a group of ``sizes`` elements (``costs``: its optimizer
        state, default its size), deterministic, the same on every rank:

        1. largest first (ties: the earlier), each to the rank with the fewest elements of this
           group so far (ties: the fewest owned in earlier groups, then the lower rank) — LPT;
        2. with more tensors than ranks, the same order again, each to the rank with the least
           cost (earlier groups and this one so far; ties: the fewest elements of this group, the
           fewest earlier, the lower rank) among those it fits in without the slice passing
           max(LPT's largest, ⌈(1 + :data:`OWNER_SLACK`)·Σ sizes / n⌉); these owners stand when
           every tensor fits and they leave the costs better spread than LPT's
           (:meth:`_spread`), else LPT's do.
        """
        costs = list(sizes) if costs is None else list(costs)
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        owners, mine = self._largest_first(sizes, order)
        if len(sizes) > self.n:
            cap = max(max(mine.values(), default=0), math.ceil(sum(sizes) * (1 + OWNER_SLACK) / self.n))
            balanced = self._cheapest_fit(sizes, costs, order, cap)
            if balanced is not None and self._spread(balanced, costs) < self._spread(owners, costs):
                owners = balanced
        for i, r in enumerate(owners):
            if sizes[i]:
                self.elements[r] = self.elements.get(r, 0) + sizes[i]
            if costs[i]:
                self.cost[r] = self.cost.get(r, 0) + costs[i]
        return owners

    def _spread(self, owners: list[int], costs: list[int]) -> tuple[int, int]:
        """How unevenly the costs would lie with ``owners``: the most any rank would hold (earlier
        groups included), then the sum of squares of what the ranks hold."""
        spent = dict(self.cost)
        for r, c in zip(owners, costs):
            spent[r] = spent.get(r, 0) + c
        return max(spent.values(), default=0), sum(v * v for v in spent.values())

    def owned(self) -> list[int]:
        """Elements each rank owns over the groups so far (a list of n)."""
        return [self.elements.get(r, 0) for r in range(self.n)]

    def _largest_first(self, sizes: list[int], order: list[int]) -> tuple[list[int], dict[int, int]]:
        """Step 1 in O(group·log n + loaded ranks): while the group has no more tensors than
        ranks, each goes to a rank that owns nothing of the group yet — the next by (elements
        owned earlier, rank), the ranks that own nothing coming first, by number."""
        n, loads = self.n, self.elements
        owners, mine = [0] * len(sizes), {}
        if len(sizes) <= n:
            fresh = (r for r in range(n) if r not in loads)
            idle = len(loads) < n
            loaded = iter(sorted(loads, key=lambda r: (loads[r], r)))
            for i in order:
                r = next(fresh, None) if idle else None
                if r is None:
                    idle = False
                    r = next(loaded)
                owners[i], mine[r] = r, sizes[i]
            return owners, mine
        heap = [(0, loads.get(r, 0), r) for r in range(n)]
        heapq.heapify(heap)
        for i in order:
            held, load, r = heapq.heappop(heap)
            owners[i], mine[r] = r, held + sizes[i]
            heapq.heappush(heap, (held + sizes[i], load, r))
        return owners, mine

    def _cheapest_fit(self, sizes: list[int], costs: list[int], order: list[int], cap: int) -> list[int] | None:
        """Step 2: the owners, or None when a tensor fits in no slice of ``cap`` elements."""
        n = self.n
        held = [0] * n
        spent = [self.cost.get(r, 0) for r in range(n)]
        earlier = [self.elements.get(r, 0) for r in range(n)]
        owners = [0] * len(sizes)
        for i in order:
            fits = [r for r in range(n) if held[r] + sizes[i] <= cap]
            if not fits:
                return None
            r = min(fits, key=lambda r: (spent[r], held[r], earlier[r], r))
            owners[i] = r
            held[r] += sizes[i]
            spent[r] += costs[i]
        return owners


def plan_buckets(sizes: list[int], groups: list[int], element_size: int, sync: str,
                 bucket_mb: float, first_bucket_mb: float, whole_groups: frozenset[int] = frozenset(),
                 shard_size: int = 1) -> list[list[int]]:
    """Split parameter indices (registration order) into buckets, in launch order.

    Walks parameters in reverse; each param group fills its own open bucket, which closes once it
    holds at least its cap (``min(first_bucket_mb, bucket_mb)`` for the very first bucket, then
    ``bucket_mb``).
    Buckets are ordered by the position of their first parameter in the reverse walk, i.e. by
    when backward starts filling them.

    A param group in ``whole_groups`` is stepped by an optimizer that reads whole tensors (guide
    §12.3): each tensor of its buckets lies whole in one of the ``shard_size`` slices. Its bucket
    (``bucketed`` only) closes once it holds at least ``shard_size`` times its largest tensor as
    well as the cap, and once its tensors pack into the slices (:func:`lpt_slice`) with padding
    at most :data:`MAX_WHOLE_PADDING` of its elements (the owners' slices add at most
    :data:`OWNER_SLACK` of the even share to a bucket padded less than that). A last bucket of
    such a group that the walk leaves above that padding takes in the group's previous buckets,
    latest first, until its padding is within the bound (or none is left) — or until the joined
    run cuts into two buckets that both meet the rule (the cut leaving the larger part smallest).
    """
    if sync == "overlap":
        return [[i] for i in reversed(range(len(sizes)))]
    # The first bucket is small so that communication starts early; never larger than the rest
    # (a first bucket above bucket_mb would also size the largest transient gradient buffer).
    first = min(first_bucket_mb, bucket_mb)
    caps = (math.inf, math.inf) if sync == "naive" else (first * MIB, bucket_mb * MIB)
    whole = whole_groups if sync == "bucketed" and shard_size > 1 else frozenset()

    def full(bucket: list[int], nbytes: int, cap: float) -> bool:
        if nbytes < cap:
            return False
        if groups[bucket[0]] not in whole:
            return True
        held = [sizes[i] for i in bucket]
        return nbytes >= shard_size * max(held) * element_size and \
            whole_padding(held, shard_size) <= MAX_WHOLE_PADDING

    closed: list[list[int]] = []
    open_: dict[int, list[int]] = {}
    open_bytes: dict[int, int] = {}
    for i in reversed(range(len(sizes))):
        g = groups[i]
        open_.setdefault(g, []).append(i)
        open_bytes[g] = open_bytes.get(g, 0) + sizes[i] * element_size
        if full(open_[g], open_bytes[g], caps[0] if not closed else caps[1]):
            closed.append(open_.pop(g))
            open_bytes.pop(g)
    for g in [g for g in open_ if g in whole]:  # a last bucket too small for its largest tensor
        bucket = open_.pop(g)
        while whole_padding([sizes[i] for i in bucket], shard_size) > MAX_WHOLE_PADDING:
            previous = next((b for b in reversed(closed) if groups[b[0]] == g), None)
            if previous is None:
                break
            closed.remove(previous)
            bucket = previous + bucket
            cuts = [k for k in range(1, len(bucket))
                    if full(bucket[:k], sum(sizes[i] for i in bucket[:k]) * element_size, caps[1])
                    and whole_padding([sizes[i] for i in bucket[k:]], shard_size) <= MAX_WHOLE_PADDING]
            if cuts:
                k = min(cuts, key=lambda k: (max(k, len(bucket) - k), k))
                closed.append(bucket[:k])
                bucket = bucket[k:]
                break
        closed.append(bucket)
    buckets = closed + list(open_.values())
    order = {i: pos for pos, i in enumerate(reversed(range(len(sizes))))}
    return sorted(buckets, key=lambda b: order[b[0]])
