"""Names and units every part of zerodp shares, defined once (torch-free).

``MIB``: a mebibyte (DDP's ``bucket_cap_mb`` and the engine's ``bucket_mb`` count these);
``AUTO``: the value that asks for a chosen bucket size (``bucket_mb="auto"``, guide §4);
``STAGE_NAMES``: what stage 0-3 are called (guide §9); :func:`fmt_mib`: bytes in binary units,
as memory is measured. (The planner's tables use decimal units: ``zerodp.plan._common.fmt_bytes``.)
:func:`plan_buckets`: which parameters share a gradient bucket (guide §4), the one plan the engine
(``zerodp.engine.reducer``) and the planner (``zerodp.plan.ownership``) both use.
"""

from __future__ import annotations

import math

MIB = 1 << 20
AUTO = "auto"
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def fmt_mib(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``3.40 MiB``, ``1.25 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plan_buckets(sizes: list[int], groups: list[int], element_size: int, sync: str,
                 bucket_mb: float, first_bucket_mb: float) -> list[list[int]]:
    """Split parameter indices (registration order) into buckets, in launch order.

    Walks parameters in reverse; each param group fills its own open bucket, which closes once it
    holds at least its cap (``min(first_bucket_mb, bucket_mb)`` for the very first bucket, then
    ``bucket_mb``).
    Buckets are ordered by the position of their first parameter in the reverse walk, i.e. by
    when backward starts filling them.
    """
    if sync == "overlap":
        return [[i] for i in reversed(range(len(sizes)))]
    # The first bucket is small so that communication starts early; never larger than the rest
    # (a first bucket above bucket_mb would also size the largest transient gradient buffer).
    first = min(first_bucket_mb, bucket_mb)
    caps = (math.inf, math.inf) if sync == "naive" else (first * MIB, bucket_mb * MIB)
    closed: list[list[int]] = []
    open_: dict[int, list[int]] = {}
    open_bytes: dict[int, int] = {}
    for i in reversed(range(len(sizes))):
        g = groups[i]
        open_.setdefault(g, []).append(i)
        open_bytes[g] = open_bytes.get(g, 0) + sizes[i] * element_size
        cap = caps[0] if not closed else caps[1]
        if open_bytes[g] >= cap:
            closed.append(open_.pop(g))
            open_bytes.pop(g)
    buckets = closed + list(open_.values())
    order = {i: pos for pos, i in enumerate(reversed(range(len(sizes))))}
    return sorted(buckets, key=lambda b: order[b[0]])
