"""The engine under ``torch.compile`` (docs/engine.md, "torch.compile").

The engine's host-side bookkeeping (stage 3's unit hooks, the gradient hooks, the reducer's hooks,
the forward's entry and exit, the collectives and trace spans they reach) runs as plain Python,
outside any traced region: :func:`host_only` marks each entry point, the way FSDP2 marks its hooks
(``torch._dynamo.disable(..., recursive=True)``), so dynamo skips the call and everything under it
(storage resizing, ``time.perf_counter``, ``dist`` calls, ``autograd.Function`` bookkeeping) and
compiles the model's own code between them. Eagerly the mark costs a dictionary look-up and
dynamo's switch (about 2 µs a call); importing zerodp does not import dynamo.

:func:`unwrap_compiled` turns ``torch.compile(model)`` (an ``OptimizedModule``) into the in-place
form (``model.compile()`` with the same backend and options), so the engine's hooks sit on the
user's own modules and every name the engine stores, saves and loads is the model's own, without
``_orig_mod.``.

:func:`compile_in_place` is the one way zerodp's apps compile a model (``zerodp train --compile``,
``zerodp bench --compile``): ``model.compile()`` before ``parallelize``, inductor on CUDA,
aot_eager on the CPU.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import torch.nn as nn

from zerodp.compat import dynamo_disable

F = TypeVar("F", bound=Callable)

REASON = "zerodp engine bookkeeping runs eagerly (zerodp.engine.compiled)"


_MARKED: list[Callable] = []  # every host_only function, in definition order
_DISABLED: dict[Callable, Callable] = {}  # function -> its torch._dynamo.disable(recursive=True) form
_WRAPPER_CODE = None  # the code object of host_only's wrapper


def host_only(fn: F) -> F:
    """``fn`` never traced: once :func:`activate` ran (every engine's construction), a call runs
    ``torch._dynamo.disable(fn, recursive=True)``, so under ``torch.compile`` the call is a graph
    break and ``fn`` with every frame under it runs eagerly, as FSDP2's hooks; before, ``fn``
    itself (nothing can be compiling: zerodp's import does not import dynamo)."""
    _MARKED.append(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = _DISABLED.get(fn)
        if disabled is None:
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    global _WRAPPER_CODE
    _WRAPPER_CODE = call.__code__
    return call  # type: ignore[return-value]


def activate() -> None:
    """Build the disabled forms of every :func:`host_only` function (imports ``torch._dynamo``,
    which the first optimizer step imports anyway); called by every engine before its first hook."""
    if len(_DISABLED) == len(_MARKED):
        return
    import torch._dynamo

    for fn in _MARKED:
        if fn not in _DISABLED:
            _DISABLED[fn] = dynamo_disable(fn, REASON)
    # The wrappers' own frame (one code object for all): never compiled on its own when run
    # eagerly after the graph break at its call, where dynamo would otherwise trace and guard it
    # once per wrapped function (recompilations up to the limit).
    torch._dynamo.eval_frame.skip_code(_WRAPPER_CODE)


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """``torch.compile(m)`` -> ``m`` compiled in place by the same compile context; else ``module``."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None or not isinstance(module, dynamo.OptimizedModule):
        return module
    inner = module._orig_mod
    inner._compiled_call_impl = module.dynamo_ctx(inner._call_impl)  # what nn.Module.compile does
    return inner


def compile_in_place(model: nn.Module) -> nn.Module:
    """``model.compile(backend=...)`` in place (before ``parallelize`` or a peer's wrapper):
    inductor where the model's parameters are on CUDA, aot_eager elsewhere; returns ``model``."""
    param = next(model.parameters(), None)
    on_cuda = param is not None and param.device.type == "cuda"
    model.compile(backend="inductor" if on_cuda else "aot_eager")
    return model
