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

It also turns an optimizer the user already built over ``model.parameters()`` into the engine's
factory (:func:`from_built`): same class, defaults and param groups, rebuilt over the master — or
several, over disjoint parameters (``optimizer=[Muon(matrices), AdamW(the rest)]``, the way Muon
is used), rebuilt as one :class:`OptimizerSet` that steps them together.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

#: Keys of a param group that are its parameters, not its options.
_PARAMS = "params"


@dataclass(frozen=True)
class UserGroups:
    """The param groups of an optimizer the user built before ``parallelize``: each group's
    options (what differs from the defaults is kept as torch keeps it: every key) and, per
    parameter, its group. Serves as the engine's ``param_groups`` rule
    (:func:`zerodp.engine.optimizer_plan.resolve_param_groups`) and gives ``state_dict()`` its
    index order."""

    options: tuple[dict, ...]
    group_of: Mapping[int, int]  # id(parameter) -> group index
    order: tuple[int, ...]  # id(parameter) in the order the optimizer lists them

    def __call__(self, name: str, p: nn.Parameter) -> dict:
        return dict(self.options[self.group_of[id(p)]])


def is_built(optimizer: Any) -> bool:
    """An optimizer the script built (``configure_optimizers()``), or a list of them."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return True
    return (isinstance(optimizer, Sequence) and not isinstance(optimizer, str) and len(optimizer) > 0
            and all(isinstance(o, torch.optim.Optimizer) for o in optimizer))


def from_built(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
               model: nn.Module, with_state: bool = False) -> tuple[Callable[[list[dict]], Any], UserGroups]:
    """A built optimizer (or several over disjoint parameters) → (factory, param-groups rule)
    that rebuild it over the master.

    The factory builds ``type(optimizer)(groups, **defaults)`` — for several, each class over its
    own groups, in one :class:`OptimizerSet`; the rule gives each parameter the options of the
    group it was in (groups numbered across the optimizers, in the order given). A trainable
    parameter no optimizer holds, one held twice, or one the model does not own is refused in one
    line: torch would leave the first untrained, step the second twice, and the third is not this
    model's. ``with_state``: state the optimizer loaded before the wrap (a resume) is the caller's
    to carry over (:meth:`zerodp.engine.adopt.Adoption.take_given`); else it is refused."""
    built = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    owned = {id(p) for p in model.parameters()}
    options, group_of, order, spans = [], {}, [], []
    for opt in built:
        what = type(opt).__name__
        if opt.state and not with_state:
            raise ValueError(
                f"the {what} given to parallelize in a list holds state: zerodp rebuilds the list over its fp32 "
                "master as one optimizer, so pass them before their first step and load a saved state with "
                "engine.optimizer.load_state_dict(...) afterwards (a single optimizer given brings its state along)")
        first = len(options)
        for g, group in enumerate(opt.param_groups):
            options.append({k: v for k, v in group.items() if k != _PARAMS})
            for p in group[_PARAMS]:
                if id(p) not in owned:
                    raise ValueError(
                        f"param group {g} of the given {what} holds a tensor of shape {tuple(p.shape)} that is not "
                        "a parameter of this model: build the optimizer over model.parameters() of the model you "
                        "parallelize")
                if id(p) in group_of:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in two of the given optimizers' param groups "
                        "(torch would step it twice): give each parameter to one optimizer, e.g. the matrices to "
                        "Muon and the rest to AdamW")
                group_of[id(p)] = first + g
                order.append(id(p))
        spans.append((first, len(options)))
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in group_of:
            held = " or ".join(type(o).__name__ for o in built)
            raise ValueError(
                f"parameter {name!r} requires grad but is in none of the given {held}'s param groups, so nothing "
                "would train it: add it to an optimizer, or set requires_grad=False before parallelize")
    builders = [_rebuilder(opt) for opt in built]

    def factory(groups: list[dict]) -> torch.optim.Optimizer:
        if len(builders) == 1:
            return builders[0](groups)
        return OptimizerSet([b(groups[lo:hi]) for b, (lo, hi) in zip(builders, spans)])

    return factory, UserGroups(tuple(options), group_of, tuple(order))


class RebuildError(TypeError):
    """A built optimizer whose class cannot be called again over the master's param groups."""


def _rebuilder(optimizer: torch.optim.Optimizer) -> Callable[[list[dict]], torch.optim.Optimizer]:
    cls = type(optimizer)
    # The defaults the constructor takes (AdamW's defaults also hold Adam's decoupled_weight_decay,
    # which AdamW's constructor fixes itself); every group carries its full options anyway.
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}

    def rebuild(groups: list[dict]) -> torch.optim.Optimizer:
        try:
            return cls(groups, **defaults)
        except (TypeError, AttributeError, ValueError) as e:  # a wrapper of another optimizer (Lookahead, SAM)
            raise RebuildError(
                f"{cls.__name__} cannot be rebuilt over zerodp's fp32 master from its param groups and defaults "
                f"({cls.__name__}(groups, **defaults) raised {type(e).__name__}: {e}) — an optimizer that wraps "
                f"another, such as Lookahead or SAM, is built from its inner one: pass a factory that builds both, "
                f"optimizer=lambda groups: {cls.__name__}(torch.optim.AdamW(groups, lr=...), ...)") from None
    return rebuild


def members(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The stock optimizers an optimizer stands for: an :class:`OptimizerSet`'s, else itself."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerSet) else [optimizer]


class OptimizerSet(torch.optim.Optimizer):
    """Stock optimizers over disjoint parameters, stepped as one (Muon for the matrices and AdamW
    for the rest, as Muon is used): their param groups in the order given, one ``state`` mapping
    shared by all of them (its keys are tensors, each held by one member), and ``step()`` /
    ``zero_grad()`` of each in turn. The engine's master optimizer when ``parallelize`` is given a
    list of built optimizers (:func:`from_built`)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):  # noqa: D107 - groups are the members'
        self.optimizers = list(optimizers)
        self.state = defaultdict(dict)
        for opt in self.optimizers:
            self.state.update(opt.state)
            opt.state = self.state
        self.defaults = dict(self.optimizers[0].defaults)
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self, closure: Callable[[], Any] | None = None):
        if closure is not None:
            raise ValueError("an OptimizerSet steps its members without a closure")
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        for opt in self.optimizers:
            opt.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return "OptimizerSet(" + ", ".join(type(o).__name__ for o in self.optimizers) + ")"


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
