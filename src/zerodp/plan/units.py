"""Names and units every part of zerodp shares, defined once (torch-free).

``MIB``: a mebibyte (DDP's ``bucket_cap_mb`` and the engine's ``bucket_mb`` count these);
``AUTO``: the value that asks for a chosen bucket size (``bucket_mb="auto"``, guide §4);
``STAGE_NAMES``: what stage 0-3 are called (guide §9); :func:`fmt_mib`: bytes in binary units,
as memory is measured. (The planner's tables use decimal units: ``zerodp.plan._common.fmt_bytes``.)
:func:`plan_buckets`: which parameters share a gradient bucket (guide §4), the one plan the engine
(``zerodp.engine.reducer``) and the planner (``zerodp.plan.ownership``) both use, and
:func:`lpt_slice`: the slice a bucket of whole tensors needs when they are packed into N slices.
"""

from __future__ import annotations

import heapq
import math

MIB = 1 << 20
AUTO = "auto"
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
#: A bucket of whole tensors (tensor ownership, guide §12.3) closes only once its tensors pack
#: into N slices with at most this much padding, as a share of its parameter elements.
MAX_WHOLE_PADDING = 0.10


def fmt_mib(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``3.40 MiB``, ``1.25 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def lpt_slice(sizes: list[int], n: int) -> int:
    """The largest of ``n`` slices after longest-processing-time packing: ``sizes`` largest first,
    each to the slice holding the fewest elements so far. Ties do not change it, so this is the
    padded slice of :meth:`zerodp.engine.layout.FlatLayout.owned` whatever its tie rule."""
    slices = [0] * n
    for size in sorted(sizes, reverse=True):
        heapq.heapreplace(slices, slices[0] + size)
    return max(slices)


def whole_padding(sizes: list[int], n: int) -> float:
    """Padding of ``sizes`` packed whole into ``n`` slices (:func:`lpt_slice`), as a share of
    their elements."""
    total = sum(sizes)
    return (n * lpt_slice(sizes, n) - total) / total if total else 0.0


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
    at most :data:`MAX_WHOLE_PADDING` of its elements. A last bucket of such a group that the
    walk leaves above that padding takes in the group's previous buckets, latest first, until
    its padding is within the bound (or none is left).
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
        closed.append(bucket)
    buckets = closed + list(open_.values())
    order = {i: pos for pos, i in enumerate(reversed(range(len(sizes))))}
    return sorted(buckets, key=lambda b: order[b[0]])
