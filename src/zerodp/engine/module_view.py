"""What a stage-3 module refuses to be copied as (guide §12.9).

At stage 3 each rank keeps 1/N of every parameter; at rest the module's parameters are
placeholders (their shapes over one element). ``copy.deepcopy(model)`` — and
``torch.optim.swa_utils.AveragedModel(model)``, an EMA, which deep-copies it — would copy those
placeholders and average nothing. So the module's
class is swapped for a subclass of the same name, as FSDP2 does, whose ``__deepcopy__`` refuses in
one line, naming what gives the full values; the class is restored when the engine is collected.
"""

from __future__ import annotations

import torch.nn as nn


def _refuse_deepcopy(self, memo):
    raise RuntimeError(
        f"copy.deepcopy of a stage-3 {type(self).__name__}: its parameters are this rank's shards (placeholders "
        "at rest), so the copy would hold nothing; build a fresh model and load "
        "engine.state_dict() into it (every rank calls it), e.g. ema = build(); "
        "ema.load_state_dict(engine.state_dict())")


def shard_view_class(module: nn.Module) -> type:
    """Swap ``module``'s class for a same-named subclass that refuses ``deepcopy``; return the original."""
    cls = type(module)
    view = type(cls.__name__, (cls,), {"__deepcopy__": _refuse_deepcopy, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "_zerodp_original_class": cls})
    module.__class__ = view
    return cls


def restore_class(module: nn.Module, cls: type) -> None:
    """The engine is gone: the module is of its own class again."""
    if type(module).__dict__.get("_zerodp_original_class") is cls:
        module.__class__ = cls
