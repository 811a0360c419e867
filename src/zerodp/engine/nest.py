"""Tensors inside the nests that modules take and return (guide §12.9).

A forward may return a tensor, a tuple, a dict, a NamedTuple, a Hugging Face ``ModelOutput``, a
plain ``@dataclass``, or any object that keeps its tensors as attributes (a ``SimpleNamespace``, an
instance of the script's own class). The engine must reach every tensor in it: stage 3 hooks each
output that needs a gradient, so that a unit is gathered again before its backward (guide §9.3),
and mixed precision casts every floating-point input (guide §1). ``torch.utils._pytree`` walks
tuples, lists, dicts and NamedTuples; a dataclass or another object it does not know is one opaque
leaf to it, so :func:`tensors` opens dataclasses field by field and other objects through their
``__dict__`` (never a module, a class or a function; each object once, a few levels deep).
:func:`map_tensors` rebuilds only what it can rebuild faithfully: pytree containers and dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


#: how deep :func:`tensors` follows objects' attributes (an output object inside an output object)
OPEN_DEPTH = 4
_CLOSED = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _fields(leaf: Any, objects: bool) -> list | None:
    """The values inside an object pytree sees as one leaf, or None for a leaf with nothing to open."""
    if _is_dataclass_instance(leaf):
        return [getattr(leaf, f.name) for f in dataclasses.fields(leaf)]
    if not objects or isinstance(leaf, _CLOSED) or not hasattr(leaf, "__dict__"):
        return None
    try:
        return list(vars(leaf).values())
    except TypeError:
        return None


def tensors(x: Any, objects: bool = False, _seen: set[int] | None = None, _depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in ``x``, in pytree order, dataclass fields included; with ``objects``, other
    objects' attributes too (what a forward returns: nothing rebuilds it, the hooks only read it).
    Without, exactly the tensors :func:`replace` can swap (a unit's inputs)."""
    seen = set() if _seen is None else _seen
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(x):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif _depth < OPEN_DEPTH and id(leaf) not in seen and (inner := _fields(leaf, objects)) is not None:
            seen.add(id(leaf))
            out.extend(tensors(inner, objects, seen, _depth + 1))
    return out


def grad_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output ``x`` that require grad (the outputs backward will reach)."""
    return [t for t in tensors(x, objects=True) if t.requires_grad]


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
