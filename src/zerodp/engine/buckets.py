"""Gradient buckets: which parameters travel together, and the flat buffers they live in.

Guide §4: one collective per parameter pays the fixed latency α hundreds of times, so gradients
are packed into *buckets* of about ``bucket_mb`` MB (PyTorch DDP's default is 25 MB) and each
bucket is reduced with one collective as soon as all its gradients are final. Buckets are filled
in **reverse registration order**, because backward produces the last layers' gradients first
(guide §3); the first bucket is small (``first_bucket_mb``) so that communication starts early.
A bucket never mixes optimizer param groups or dtypes.

The three sync modes of the guide map onto bucket plans (:func:`zerodp.plan.units.plan_buckets`,
torch-free, so that the planner forms the same buckets):

- ``naive``    (§2.5): one bucket per param group, reduced after backward ends;
- ``overlap``  (§3):   one bucket per parameter, reduced from its gradient hook;
- ``bucketed`` (§4):   buckets of ``bucket_mb``, reduced as each one fills.

Each bucket becomes a :class:`~zerodp.engine.group.FlatGroup` (guide §12.1): a flat parameter
buffer padded to a multiple of N, every parameter a view into it, so collectives and the
optimizer run on a few large contiguous tensors with no copies.
"""

from __future__ import annotations

import torch
import torch.nn as nn




def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Mixed precision: floating-point module buffers follow the compute dtype (guide §1)."""
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(sub, name, buf.to(dtype))
