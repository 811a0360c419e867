"""Tensors inside the nests that modules take and return (guide §12.4).

A forward may return a tensor, a tuple, a dict, a NamedTuple, a Hugging Face ``ModelOutput`` or a
plain ``@dataclass``. The engine must reach every tensor in it: stage 3 hooks each output that
needs a gradient, so that a unit is gathered again before its backward (guide §9.3), and mixed
precision casts every floating-point input (guide §1). ``torch.utils._pytree`` walks tuples,
lists, dicts and NamedTuples; a dataclass it does not know is one opaque leaf to it, so these
functions open dataclasses field by field as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def tensors(x: Any) -> list[torch.Tensor]:
    """Every tensor in ``x``, in pytree order, dataclass fields included."""
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(x):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif _is_dataclass_instance(leaf):
            out.extend(tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def grad_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` that require grad (the outputs backward will reach)."""
    return [t for t in tensors(x) if t.requires_grad]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """``x`` with every tensor replaced by ``fn(tensor)``; dataclasses are rebuilt with
    :func:`dataclasses.replace` (their ``init`` fields), other containers as pytree rebuilds them."""
    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if _is_dataclass_instance(leaf):
            fields = [f for f in dataclasses.fields(leaf) if f.init]
            new = {f.name: map_tensors(fn, getattr(leaf, f.name)) for f in fields}
            if all(new[f.name] is getattr(leaf, f.name) for f in fields):
                return leaf
            return dataclasses.replace(leaf, **new)
        return leaf
    return pytree.tree_map(one, x)


def cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in ``x`` cast to ``dtype`` (mixed precision's inputs, guide §1)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, x)


def replace(x: Any, swap: dict[int, torch.Tensor]) -> Any:
    """``x`` with each tensor whose ``id`` is in ``swap`` replaced by its value there."""
    return map_tensors(lambda t: swap.get(id(t), t), x)
