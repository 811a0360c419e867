"""Gradient buckets: which parameters travel together, and the flat buffers they live in.

Guide §4: one collective per parameter pays the fixed latency α hundreds of times, so gradients
are packed into *buckets* of about ``bucket_mb`` MB (PyTorch DDP's default is 25 MB) and each
bucket is reduced with one collective as soon as all its gradients are final. Buckets are filled
in **reverse registration order**, because backward produces the last layers' gradients first
(guide §3); the first bucket is small (``first_bucket_mb``) so that communication starts early.
A bucket never mixes optimizer param groups or dtypes.

The three sync modes of the guide map onto bucket plans:

- ``naive``    (§2.5): one bucket per param group, reduced after backward ends;
- ``overlap``  (§3):   one bucket per parameter, reduced from its gradient hook;
- ``bucketed`` (§4):   buckets of ``bucket_mb``, reduced as each one fills.

Each bucket becomes a :class:`~zerodp.engine.group.FlatGroup` (guide §12.1): a flat parameter
buffer padded to a multiple of N, every parameter a view into it, so collectives and the
optimizer run on a few large contiguous tensors with no copies.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from zerodp.plan.units import MIB

MB = MIB  # DDP's bucket_cap_mb counts mebibytes


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
    caps = (math.inf, math.inf) if sync == "naive" else (first * MB, bucket_mb * MB)
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


def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision: floating-point module buffers follow the compute dtype (guide §1)."""
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(sub, name, buf.to(dtype))
