"""The optimizer plan: what the user's optimizer is and where it runs, decided once (guide §12.3).

Before any flat buffer is laid out the engine must know how the optimizer reads its tensors: an
*elementwise* one (Adam, AdamW, SGD, ...) runs on flat 1/N slices, bit for bit the whole-tensor
update; a *per-tensor* one (Muon, Adafactor, or one declared with ``optimizer_layout="owner"``)
steps whole tensors on one owner each; one that reads *across* tensors (a global norm inside its
step) runs at stage 0 only. :func:`plan_optimizer` learns this by building the user's optimizer
once over one-element stand-ins (:func:`probe_factory`) — that build is then pointed at the
master (:class:`~zerodp.engine.master.MasterOptimizer`), so the optimizer is constructed once —
and returns a frozen :class:`OptimizerPlan`: the factory, each param group's options, the group of
each parameter by name, the placement (flat or owner), the groups read whole and the state kinds
the owners balance. The engine's parts read the plan; an optimizer adopted after the wrap gets a
new plan (:meth:`OptimizerPlan.adopted`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from zerodp.engine.config import ALIGNED
from zerodp.plan.ownership import state_numel

# Optimizers whose update of element i reads only element i of the parameter, its gradient and
# its states (plus scalars shared by the whole tensor, such as the step count — and ASGD's eta and
# mu, which depend on the step count alone; Rprop's step sizes are per element).
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop",
                 "ASGD")
    if hasattr(torch.optim, name)
)

# Optimizers whose update of a tensor reads that whole tensor (and its gradient and states) but
# no other tensor: exact on the tensor-ownership path, where each rank steps whole tensors.
PER_TENSOR_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Adafactor", "Muon") if hasattr(torch.optim, name))

# Optimizers no data-parallel layout runs, and why (one line each).
REFUSED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "LBFGS is refused: its step() re-evaluates the loss through a closure and line-searches over all "
             "parameters at once (closure-based and global), which no sharded layout runs exactly; use a first-order "
             "optimizer (AdamW, SGD, Adafactor, Muon)",
    "SparseAdam": "SparseAdam is refused: it needs sparse gradients (nn.Embedding(sparse=True)), and the engine's "
                  "gradients are dense flat buffers; use Adam or AdamW",
}

#: ``optimizer_layout`` values (EngineConfig): "auto" picks "flat" for an elementwise optimizer,
#: "owner" (tensor ownership) for a per-tensor one.
OPTIMIZER_LAYOUTS = ("auto", "flat", "owner")
FLAT, OWNER = "flat", "owner"

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]

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
            several = ("" if len(built) > 1 else
                       "; a script with one optimizer per part (o1 over some parameters, o2 over the rest) builds "
                       "them before the wrap and passes them together, parallelize(model, optimizer=[o1, o2]), then "
                       "steps model.optimizer once per step")
            raise ValueError(
                f"parameter {name!r} requires grad but is in none of the given {held}'s param groups, so nothing "
                f"would train it: add it to an optimizer, or set requires_grad=False before parallelize{several}")
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


def resolve_param_groups(named_params: list[tuple[str, nn.Parameter]],
                         rule: Callable[[str, nn.Parameter], dict] | None) -> tuple[list[dict], list[int]]:
    """Map each parameter to an optimizer param group (e.g. no weight decay on norms and biases).

    ``rule(name, param)`` returns the group's options; parameters with equal options share a
    group, and each group gets its own flat buffers (a bucket never mixes groups). Returns the
    option dicts and, per parameter, its group index. The groups of an optimizer the user built
    (:class:`UserGroups`) are kept as they were, in their order.
    """
    if isinstance(rule, UserGroups):
        return [dict(o) for o in rule.options], [rule.group_of[id(p)] for _, p in named_params]
    options: list[dict] = []
    index: list[int] = []
    for name, p in named_params:
        opts = {} if rule is None else rule(name, p)
        if not isinstance(opts, dict):
            raise ValueError(
                f"param_groups({name!r}, param) returned {type(opts).__name__}; it must return a dict "
                "of optimizer options such as {'weight_decay': 0.0} (or {} for the defaults)"
            )
        if "params" in opts:
            raise ValueError(f"param_groups({name!r}, param) must not return 'params': the engine fills it")
        if opts not in options:
            options.append(dict(opts))
        index.append(options.index(opts))
    return options, index


def check_refused(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, in one line, the optimizers no layout runs (:data:`REFUSED_OPTIMIZERS`), their
    subclasses included (each member of an :class:`OptimizerSet`)."""
    for member in members(optimizer):
        for cls in type(member).__mro__:
            if cls.__module__.startswith("torch.optim") and cls.__name__ in REFUSED_OPTIMIZERS:
                why = REFUSED_OPTIMIZERS[cls.__name__]
                raise ValueError(why if cls is type(member) else f"{type(member).__name__} subclasses {why}")


def check_elementwise(optimizer: torch.optim.Optimizer, declared: bool = False,
                      per_tensor_ok: bool = False) -> None:
    """Refuse optimizers not known to be elementwise on the flat path: their sharded update would be wrong.

    Known means one of the stock classes themselves (``type(optimizer) in ELEMENTWISE_OPTIMIZERS``):
    a subclass may couple elements (LARS over SGD scales by a per-tensor trust ratio, and a target
    here spans several parameters), so it is trusted only when declared with
    ``parallelize(..., elementwise_optimizer=True)``; one that reads whole tensors can be declared
    per-tensor instead, with ``optimizer_layout="owner"``. Each member of a set is checked; on
    the ownership path (``per_tensor_ok``) the stock per-tensor classes pass too."""
    known_ok = ELEMENTWISE_OPTIMIZERS + (PER_TENSOR_OPTIMIZERS if per_tensor_ok else ())
    for member in members(optimizer):
        if not (declared or type(member) in known_ok):
            _refuse_not_elementwise(member)


def check_reads_alone(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, in one line, an optimizer whose update of one tensor reads another tensor's gradient
    (a global gradient-norm clip inside ``step()``, a trust ratio over all parameters: LAMB's and
    LARS's global forms). At stages 1-3 each rank steps only its shards or owned tensors (guide
    §9.1, §12.3), so such a step would see a partial norm and be quietly wrong.

    Learned, not guessed, for every member that is not one of torch's own classes: the optimizer
    built over the stand-ins (:func:`probe_factory`) is stepped twice from the same state, the
    first tensor's gradient the same both times and every other gradient 10⁶ times larger the
    second time; an update that reads each tensor alone moves the first tensor identically."""
    for member in members(optimizer):
        if type(member).__module__.startswith("torch.optim"):
            continue
        params = [p for g in member.param_groups for p in g["params"]]
        if len(params) < 2:
            continue
        saved, first = copy.deepcopy(member.state_dict()), []
        for other in (1e-3, 1e3):
            with torch.no_grad():
                for i, p in enumerate(params):
                    p.fill_(0.5 + 0.25 * (i == 0))
                    p.grad = torch.full_like(p, 0.1 if i == 0 else other)
            member.step()
            first.append(params[0].detach().clone())
            member.load_state_dict(saved)
        for p in params:
            p.grad = None
        if not torch.equal(first[0], first[1]):
            raise ValueError(
                f"{type(member).__name__}'s step() reads across tensors (its update of one tensor changes with another "
                "tensor's gradient: a global gradient-norm clip or a trust ratio over all parameters), which stages "
                "1-3 cannot give it exactly — each rank steps only its shard of the model: use stage=0, or the "
                "optimizer's per-tensor form with engine.clip_grad_norm_(max_norm) for the global clip (e.g. timm's "
                "Lamb(max_grad_norm=None))")


def _refuse_not_elementwise(optimizer: torch.optim.Optimizer) -> None:
    known = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
    base = next((c.__name__ for c in ELEMENTWISE_OPTIMIZERS if isinstance(optimizer, c)), None)
    what = (f"{type(optimizer).__name__} subclasses {base}, and a subclass may read whole tensors"
            if base else f"{type(optimizer).__name__} is not known to be elementwise")
    raise ValueError(
        f"{what}: ZeRO runs the optimizer on 1/N slices of flattened parameters, which is exact only when each "
        f"element's update depends on that element alone (factored or matrix-wise optimizers such as Adafactor, "
        f"Muon or LARS read whole rows, tensors or matrices). Use one of: {known}; if its update is elementwise, "
        f"declare it with parallelize(..., elementwise_optimizer=True); if it reads each tensor whole but no "
        f"other tensor, declare it with parallelize(..., optimizer_layout='owner') (each rank steps whole tensors).")


def choose_layout(optimizer: torch.optim.Optimizer, declared_elementwise: bool = False,
                  requested: str = "auto") -> str:
    """``"flat"`` or ``"owner"``: the path ``optimizer`` runs on, for ``optimizer_layout=requested``.

    ``"auto"``: flat for an elementwise optimizer (the stock list, or ``elementwise_optimizer=True``),
    owner for a stock per-tensor one (:data:`PER_TENSOR_OPTIMIZERS`: Muon, Adafactor, ...); any
    other is refused with what to declare. ``"owner"`` declares the optimizer per-tensor (exact for
    elementwise ones too); ``"flat"`` insists on flat shards (refused unless elementwise).
    LBFGS and SparseAdam are refused whatever is asked."""
    if requested not in OPTIMIZER_LAYOUTS:
        raise ValueError(f"optimizer_layout={requested!r}: use one of {', '.join(OPTIMIZER_LAYOUTS)}")
    check_refused(optimizer)
    if requested == OWNER:
        return OWNER
    if requested == "auto" and not declared_elementwise \
            and any(type(m) in PER_TENSOR_OPTIMIZERS for m in members(optimizer)):
        check_elementwise(optimizer, per_tensor_ok=True)  # the others: stock elementwise or per-tensor
        return OWNER
    check_elementwise(optimizer, declared_elementwise)
    return FLAT


def whole_groups(optimizer: torch.optim.Optimizer, placement: str, requested: str = "auto") -> frozenset[int]:
    """The param groups (indices into ``optimizer.param_groups``) whose tensors the optimizer
    reads whole, on ``placement`` (:func:`choose_layout`): none on the flat path; every group when
    declared per-tensor (``requested="owner"``); otherwise those of the members that are not
    elementwise — under ``[Muon(matrices), AdamW(the rest)]`` Muon's, while AdamW's tensors stay
    in flat buckets sharded evenly (guide §12.3)."""
    if placement != OWNER:
        return frozenset()
    if requested == OWNER:
        return frozenset(range(len(optimizer.param_groups)))
    out, first = set(), 0
    for member in members(optimizer):
        count = len(member.param_groups)
        if type(member) not in ELEMENTWISE_OPTIMIZERS:
            out.update(range(first, first + count))
        first += count
    return frozenset(out)


#: The stock classes whose optimizer state the planner counts (zerodp.plan.ownership.state_numel),
#: by the planner's name: what owners balance (:func:`state_cost`).
PRICED_OPTIMIZERS: dict[type, str] = {getattr(torch.optim, name): priced for name, priced in (
    ("Adafactor", "adafactor"), ("Muon", "muon"), ("AdamW", "adamw"), ("Adam", "adam"), ("SGD", "sgd"))
    if hasattr(torch.optim, name)}


def group_state_kinds(optimizer: torch.optim.Optimizer) -> list[str | None]:
    """Per param group, the planner's name of the class that steps it (None: one it does not
    price), for :func:`state_cost`."""
    return [PRICED_OPTIMIZERS.get(type(member)) for member in members(optimizer) for _ in member.param_groups]


def state_cost(kind: str | None, shape: tuple[int, ...]) -> int:
    """Elements + step scalars of a tensor's optimizer state (the planner's count), or its
    elements for a class the planner does not price: what the owners of whole tensors balance
    (:meth:`zerodp.plan.units.OwnerLedger.assign`)."""
    if kind is None:
        return math.prod(shape)
    return sum(state_numel(kind, shape))


def probe_factory(factory: OptimizerFactory, group_options: list[dict],
                  params: list[tuple[str, tuple[int, ...], int]], device: torch.device) -> torch.optim.Optimizer:
    """Build the user's optimizer once over stand-ins — one element per parameter, of the
    parameter's number of dimensions — to learn its class before the flat buffers are laid out.

    ``params``: (name, shape, param-group index) of the trainable parameters. When the optimizer
    refuses them (Muon takes 2-D parameters only), the parameter it refuses is named, found by
    building it over that one parameter's stand-in."""
    def build(chosen):
        groups = [{"params": [torch.zeros((1,) * len(shape), device=device) for _, shape, g2 in chosen if g2 == g],
                   **opts} for g, opts in enumerate(group_options)]
        return factory(groups)

    try:
        return build(params)
    except RebuildError:
        raise  # the class itself cannot be rebuilt: no parameter to name
    except (ValueError, RuntimeError, TypeError) as e:
        for name, shape, g in params:
            try:
                build([(name, shape, g)])
            except (ValueError, RuntimeError, TypeError) as one:
                hint = ""
                if "2D" in str(one) or "2-D" in str(one):
                    hint = (" — Muon steps 2-D matrices only: give the rest to another optimizer, "
                            "optimizer=[Muon(matrices), AdamW(the rest)], or freeze it (requires_grad=False)")
                raise ValueError(f"the optimizer refuses parameter {name!r} of shape {tuple(shape)}: {one}{hint}") \
                    from None
        raise e


@dataclass(frozen=True)
class OptimizerPlan:
    """What the engine knows of the user's optimizer, decided once (module docstring)."""

    factory: OptimizerFactory
    group_options: tuple[dict, ...]  # per param group: its options (lr, weight decay, ...)
    names: tuple[str, ...]  # the trainable parameters, in named_parameters order
    group_of: tuple[int, ...]  # per trainable parameter: its param group
    placement: str  # FLAT (1/N slices of flat buffers) or OWNER (whole tensors on owners)
    whole_groups: frozenset[int]  # the param groups read whole at a sharded stage (owner placement)
    state_kinds: tuple[str | None, ...]  # per param group: the planner's name of its class (state_cost)
    sharded: bool  # stages 1-3: the master is sharded, whole tensors need owners
    built: torch.optim.Optimizer | None = field(default=None, compare=False, repr=False)  # the stand-in build
    #: the param-groups rule the groups came from (a built optimizer's :class:`UserGroups` gives
    #: ``state_dict()`` its index order)
    rule: object = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def group_by_name(self) -> Mapping[str, int]:
        """Each trainable parameter's param group, by name (read at every forward's check)."""
        return dict(zip(self.names, self.group_of))

    def adopted(self, optimizer: torch.optim.Optimizer, module: nn.Module, named_params: list[tuple[str, nn.Parameter]],
                groups: list, policy, config) -> "OptimizerPlan":
        """The plan of an optimizer the script built over the module's parameters after the wrap
        (:mod:`zerodp.engine.adopt`): its factory, groups and param-groups rule; the
        placement stays (the buffers are laid out) — except at stage 0, where a per-tensor
        optimizer steps whole tensors on the buffers as they are (every rank holds all of them) —
        and the groups read whole are the new optimizer's on the owner placement. One that needs
        another layout than the one ``groups`` were laid out for is refused in one line, naming
        ``parallelize(model, optimizer=...)``."""
        layout = choose_layout(optimizer, config.elementwise_optimizer, config.optimizer_layout)
        placement = self.placement
        if layout != FLAT and placement == FLAT and not self.sharded:
            placement = OWNER  # stage 0: whole tensors on the buffers as laid out, nothing to move
        if layout != FLAT and placement == FLAT:
            raise ValueError(f"{type(optimizer).__name__} steps whole tensors, and the engine laid its buffers out "
                             "for flat shards at parallelize (it got no optimizer, so it adopts the first that steps "
                             "the model, and at stages 1-3 only an elementwise one fits): pass it there, "
                             "parallelize(model, optimizer=[...])")
        factory, rule = from_built(optimizer, module)
        options, group_of = resolve_param_groups(named_params, rule)
        whole = whole_groups(optimizer, OWNER, config.optimizer_layout) if self.sharded else frozenset()
        new = replace(self, factory=factory, group_options=tuple(options), group_of=tuple(group_of),
                      whole_groups=whole, built=None, rule=rule, placement=placement)
        if new.placement == OWNER and policy.whole_tensors == ALIGNED:  # buckets laid out for the first optimizer
            by_name = new.group_by_name
            cut = [s.name for g in groups if not g.layout.aligned
                   for s in g.layout.slots if by_name.get(s.name, -1) in whole]
            if cut:
                raise ValueError(f"{type(optimizer).__name__} reads {cut[0]!r} whole, and the engine laid it out in a "
                                 "flat bucket for the optimizer given at parallelize: pass this one there, "
                                 "parallelize(model, optimizer=[...]), instead of stepping another one than "
                                 "parallelize got")
        return new


def plan_optimizer(factory: OptimizerFactory, named_params: list[tuple[str, nn.Parameter]], rule,
                   device: torch.device, sharded: bool, declared_elementwise: bool = False,
                   requested: str = "auto") -> OptimizerPlan:
    """The plan of ``factory`` over the trainable ``named_params`` grouped by ``rule`` (a
    ``param_groups`` rule or :class:`UserGroups`): one build over stand-ins
    gives its class — the placement (:func:`choose_layout`), at a ``sharded`` stage (1-3) the check
    that it reads each tensor alone (:func:`check_reads_alone`) and the groups it reads whole."""
    options, group_of = resolve_param_groups(named_params, rule)
    stand_ins = [(n, tuple(p.shape), g) for (n, p), g in zip(named_params, group_of)]
    probe = probe_factory(factory, options, stand_ins, device)
    placement, whole, kinds, built = FLAT, frozenset(), (), None
    if isinstance(probe, torch.optim.Optimizer):  # else MasterOptimizer says what the factory returned
        placement = choose_layout(probe, declared_elementwise, requested)
        if sharded:
            check_reads_alone(probe)
            whole = whole_groups(probe, placement, requested)
        kinds, built = tuple(group_state_kinds(probe)), probe
    return OptimizerPlan(factory, tuple(options), tuple(n for n, _ in named_params), tuple(group_of),
                         placement, whole, kinds, sharded, built, rule)
