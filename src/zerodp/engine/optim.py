"""``engine.optimizer``: torch's optimizer API, whose calls are the engine's (docs/porting.md).

A training script written for DDP calls its optimizer: ``optimizer.step()``, ``scaler.step(
optimizer)``, ``optimizer.zero_grad()``, ``optimizer.param_groups[i]["lr"] = lr``, an LR
scheduler, ``optimizer.state_dict()`` in its checkpoint code. Under zerodp the stock optimizer
runs over the engine's fp32 master shards (guide §9.1, §12.3), so calling it directly would step
the master on no gradients. :class:`EngineOptimizer` is a ``torch.optim.Optimizer`` whose

- ``step()`` is ``engine.step()`` (finish gradient sync → master step → publish parameters),
- ``zero_grad(set_to_none)`` is ``engine.zero_grad(set_to_none)``,
- ``param_groups`` and ``defaults`` are the stock optimizer's own (an LR set there is used),
- ``state_dict()`` is torch's format — ``{"state": {index: {...full tensors...}}, "param_groups":
  [{..., "params": [indices]}]}``, indices in the order of the parameters the user's optimizer
  listed (or the engine's param groups) — so it loads into a plain torch optimizer over the plain
  model, and ``load_state_dict`` takes that format (from a DDP or single-process run) or the
  engine's name-keyed one. Both are collective at stages 1-3: every rank calls them (rank 0 then
  saves), as with FSDP2's ``get_optimizer_state_dict``.

An optimizer the user built before the wrap becomes the engine's factory in
:mod:`zerodp.engine.optimizer_plan` (:func:`~zerodp.engine.optimizer_plan.from_built`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

#: Keys of a param group that are its parameters, not its options.
_PARAMS = "params"


class EngineOptimizer(torch.optim.Optimizer):
    """torch's optimizer API over an engine (module docstring). Not built by the user."""

    #: ``torch.amp.GradScaler.step`` hands an enabled scaler's scale to an optimizer that says it
    #: handles scaling (as ``grad_scale``/``found_inf``) instead of unscaling ``param_groups``'
    #: ``.grad`` — which are not where the engine's gradients are. ``step()`` refuses it in one
    #: line: the engine needs no loss scaling (fp32, or bf16 with an fp32 master; fp16 is refused).
    _step_supports_amp_scaling = True

    def __init__(self, engine):  # noqa: D107 - torch.optim.Optimizer.__init__ would register params
        self._engine = engine
        self._stock = engine.master.optimizer

    # ---- what torch's helpers (schedulers, GradScaler) read -------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The optimizer the engine took over's own groups when there is one (the script's, over the
        module's parameters: :mod:`zerodp.engine.adopt`), else the master's: one place an LR is set."""
        taken = self._engine.adoption.adopted
        return self._stock.param_groups if taken is None else taken.param_groups

    @property
    def defaults(self) -> dict:
        return self._stock.defaults

    @property
    def state(self):
        """The stock optimizer's state, keyed by the master tensors (this rank's shard)."""
        return self._stock.state

    def __getstate__(self):
        raise TypeError("engine.optimizer cannot be pickled: save engine.optimizer.state_dict() instead")

    def __repr__(self) -> str:
        return f"EngineOptimizer(stage {self._engine.stage}) over {self._stock!r}"

    # ---- the calls a training script makes ---------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None):
        """``engine.step()``; with a closure, as torch: evaluate it (with grad) first, return its loss."""
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:  # an enabled GradScaler's step
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError(
                "an enabled torch.amp.GradScaler stepped engine.optimizer: zerodp trains in fp32 or in bf16 with an "
                "fp32 master, which need no loss scaling (fp16 is refused), and the scaler cannot reach the engine's "
                "gradients to unscale them; build it with GradScaler(enabled=False), as a DDP script does under "
                "bf16 or fp32, or drop it")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError(
            "engine.optimizer.add_param_group: the engine's param groups are fixed when parallelize builds its flat "
            "buffers; to train more parameters (staged fine-tuning), set requires_grad on them before parallelize "
            "and keep them frozen with lr=0 in a group of their own until they should train")

    def register_step_pre_hook(self, hook):
        return self._stock.register_step_pre_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    def register_step_post_hook(self, hook):
        return self._stock.register_step_post_hook(lambda opt, args, kwargs: hook(self, args, kwargs))

    # ---- torch's state-dict format ------------------------------------------------------------
    def index_names(self) -> list[str]:
        """Parameter names in torch's index order: the user's optimizer's order when one was given
        to ``parallelize``, else the engine's param groups in order, named_parameters within each."""
        return self._engine.checkpoint.optimizer_index_names()

    def state_dict(self) -> dict:
        """Collective: torch's format with full tensors (module docstring)."""
        named = self._engine.optimizer_state_dict()
        index = {n: i for i, n in enumerate(self.index_names())}
        return {"state": {index[n]: entry for n, entry in named["state"].items()},
                "param_groups": [{**g, _PARAMS: [index[n] for n in g[_PARAMS]]} for g in named["param_groups"]]}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Collective: torch's format (index-keyed, as this ``state_dict()`` or a plain torch
        optimizer over the plain model writes it) or the engine's name-keyed one."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if not isinstance(groups, (list, tuple)) or not isinstance(state_dict.get("state"), Mapping):
            raise ValueError("load_state_dict expects {'state': {...}, 'param_groups': [...]}, as "
                             "torch.optim.Optimizer.state_dict() returns")
        listed = [p for g in groups if isinstance(g, Mapping) for p in g.get(_PARAMS, [])]
        if listed and all(isinstance(p, int) and not isinstance(p, bool) for p in listed):
            names = self.index_names()
            if sorted(listed) != list(range(len(names))):
                raise ValueError(
                    f"the optimizer state lists {len(listed)} parameters by index, this engine trains {len(names)}: "
                    "load a state saved for the same model and param groups")
            state_dict = {"state": {names[i]: v for i, v in state_dict["state"].items()},
                          "param_groups": [{**g, _PARAMS: [names[i] for i in g[_PARAMS]]} for g in groups]}
        self._engine.load_optimizer_state_dict(state_dict)
