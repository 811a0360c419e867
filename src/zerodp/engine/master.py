"""fp32 master shards and the stock ``torch.optim`` optimizer that updates them.

Guide §1, §9.1: with bf16 mixed precision each parameter carries an fp32 master copy plus the
optimizer's states (Adam: m and v), k = 12 bytes per parameter. ZeRO shards exactly this part:
rank r keeps the master values and optimizer states of its 1/N slice of every flat buffer, and
updates only that slice. Because the update of Adam, AdamW, SGD and friends is *elementwise*,
running the stock optimizer on a 1-D slice gives bit-for-bit the same numbers as running it on
the whole tensor — which is why sharding is exact (the *flat* path, the default for them).
Optimizers that read whole tensors (Muon's Newton–Schulz orthogonalisation of a matrix,
Adafactor's factored row/column moments; :data:`PER_TENSOR_OPTIMIZERS`, or any optimizer declared
with ``optimizer_layout="owner"``) take the *tensor-ownership* path instead: the flat buffers are
laid out owner-aligned (:meth:`zerodp.engine.layout.FlatLayout.owned`), so slice r holds whole
tensors, and rank r steps them with their real shapes; the tensors of an elementwise optimizer
beside it (AdamW in ``[Muon(matrices), AdamW(the rest)]``) stay flat at stages 1-2
(:func:`whole_groups`). Stage 3 keeps its units flat and steps such tensors as *proxies*: whole
tensors that the owner exchange (:mod:`zerodp.engine.exchange`) fills on their owner for the
step, the optimizer's state living on them. LBFGS (closure-based, global) and
SparseAdam (sparse gradients) are refused (:data:`REFUSED_OPTIMIZERS`).

Each :class:`Target` is one fp32 tensor the optimizer updates: elements
``[flat_start, flat_start + numel)`` of a flat buffer (its full extent for stage 0, the rank's
shard for stages 1-3) — 1-D on the flat path, one whole parameter with its shape on the
ownership path. Targets of one parameter group go to one optimizer param group.

Checkpoints see this state as :class:`Piece` s — "elements [start, stop) of parameter NAME, of
kind KIND" — which is independent of stage and world size, so a checkpoint saved at one layout
loads at any other.
"""

from __future__ import annotations

import copy

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from zerodp.engine.layout import FlatLayout
from zerodp.engine.optim import RebuildError, members
from zerodp.plan.ownership import state_numel

PARAM = "param"

# Optimizers whose update of element i reads only element i of the parameter, its gradient and
# its states (plus scalars shared by the whole tensor, such as the step count).
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta")
    if hasattr(torch.optim, name)
)

# Optimizers whose update of a tensor reads that whole tensor (and its gradient and states) but
# no other tensor: exact on the tensor-ownership path, where each rank steps whole tensors.
PER_TENSOR_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Adafactor", "Muon", "Rprop", "ASGD") if hasattr(torch.optim, name))

#: the most fp32 gradient bytes cast at once for the optimizer step (:meth:`MasterOptimizer.step_on`)
STEP_BATCH_BYTES = 16 * 1024 * 1024

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
#: Separator of a whole-tensor state's piece name: ``"fc.weight::row_var"`` (Adafactor's factors,
#: shaped unlike their parameter, are saved whole by the parameter's owner).
WHOLE_SEP = "::"

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


def whole_name(name: str, kind: str) -> str:
    """The piece name of parameter ``name``'s whole-tensor state ``kind``."""
    return f"{name}{WHOLE_SEP}{kind}"


@dataclass(frozen=True)
class Target:
    """One fp32 tensor the optimizer updates: elements ``[flat_start, flat_start + numel)`` of
    ``layout``, all of one parameter ``name`` (so that a parameter no rank used this step can be
    skipped as a whole, as torch's optimizers skip a parameter whose ``.grad`` is None). 1-D on
    the flat path; on the ownership path the whole parameter, viewed with its shape (a 0-d
    parameter as one element)."""

    tensor: torch.Tensor  # fp32, the values the optimizer updates (a view of the master)
    layout: FlatLayout
    flat_start: int
    group: int
    name: str | None = None  # the parameter these elements belong to

    @property
    def flat(self) -> torch.Tensor:
        """The target's elements as a 1-D view."""
        return self.tensor.view(-1)


def whole_targets(tensor: torch.Tensor, layout: FlatLayout, flat_start: int,
                  group_of: Callable[[str], int]) -> list[Target]:
    """The ownership path's targets: every trainable parameter inside the held range ``tensor``
    (elements ``[flat_start, flat_start + numel)`` of ``layout``) as one view with its shape."""
    out = []
    for sp in layout.spans(flat_start, flat_start + tensor.numel()):
        g = group_of(sp.slot.name)
        if g < 0:
            continue
        if sp.param_start != 0 or sp.param_stop != sp.slot.numel:
            raise ValueError(f"{sp.slot.name} is cut by this rank's slice [{flat_start}, "
                             f"{flat_start + tensor.numel()}): the ownership path needs an owner-aligned layout "
                             "(zerodp internal error: please report it)")
        lo = sp.flat_start - flat_start
        view = tensor[lo:lo + sp.numel].view(sp.slot.shape or (1,))
        out.append(Target(view, layout, sp.flat_start, g, sp.slot.name))
    return out


def param_targets(tensor: torch.Tensor, layout: FlatLayout, flat_start: int, group_of: Callable[[str], int],
                  chunk: int | None, per_param: bool = True) -> list[Target]:
    """A held range of a flat buffer as optimizer targets (views, no copies).

    ``tensor`` holds elements ``[flat_start, flat_start + numel)`` of ``layout``. With
    ``per_param``, each parameter's run inside that range becomes its own targets, so that a
    parameter no rank used can be skipped as a whole (step count included); without it — when
    every parameter is used in every step, and the range holds one param group — the range is cut
    regardless of parameter boundaries, fewer and larger tensors for the optimizer. Either way
    the pieces hold at most ``chunk`` elements (cache-sized on CPU) and padding gets no target.
    ``group_of(name)`` gives the parameter's optimizer group index (negative: frozen, no target).
    """
    spans = [(sp, group_of(sp.slot.name)) for sp in layout.spans(flat_start, flat_start + tensor.numel())]
    spans = [(sp, g) for sp, g in spans if g >= 0]
    if not per_param and spans and len({g for _, g in spans}) == 1 and all(
            a.flat_start + a.numel == b.flat_start for (a, _), (b, _) in zip(spans, spans[1:])):
        start, stop = spans[0][0].flat_start, spans[-1][0].flat_start + spans[-1][0].numel
        runs = [(start, stop, spans[0][1], None)]
    else:
        runs = [(sp.flat_start, sp.flat_start + sp.numel, g, sp.slot.name) for sp, g in spans]
    out = []
    for start, stop, g, name in runs:
        lo, n = start - flat_start, stop - start
        step = n if not chunk else chunk
        for a in range(0, n, step):
            b = min(a + step, n)
            out.append(Target(tensor[lo + a:lo + b], layout, start + a, g, name))
    return out


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened parameter ``name``, of state ``kind``."""

    name: str
    kind: str
    start: int
    stop: int
    shape: tuple[int, ...]
    tensor: torch.Tensor  # 1-D view of stop - start elements


def check_refused(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, in one line, the optimizers no layout runs (:data:`REFUSED_OPTIMIZERS`), their
    subclasses included (each member of an :class:`~zerodp.engine.optim.OptimizerSet`)."""
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


def _repoint(optimizer: torch.optim.Optimizer, param_groups: list[dict]) -> bool:
    """Point an optimizer built over stand-ins (one group per param group, each stand-in of its
    parameter's number of dimensions, no state) at the real groups' tensors; False when its groups
    do not line up one to one or it holds state (then the factory builds it anew)."""
    groups = optimizer.param_groups
    if len(groups) != len(param_groups) or optimizer.state:
        return False
    for g, p in zip(groups, param_groups):
        g["params"] = list(p["params"])
    return True


def _one_call(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the step must be one ``optimizer.step()`` call (:meth:`MasterOptimizer.step_on`):
    step hooks, or a member whose class is not torch's own (its per-group counters would run ahead)."""
    foreign = any(not type(o).__module__.startswith("torch.optim") for o in members(optimizer))
    return foreign or _has_step_hooks(optimizer)


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs hooks (its own or torch's global ones)."""
    from torch.optim import optimizer as torch_optimizer

    from zerodp.engine.adopt import is_adoption_hook

    hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or any(not is_adoption_hook(h) for h in hooks))


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class MasterOptimizer:
    """The stock optimizer over fp32 targets, with state exposed as pieces and scalars.

    Every rank's optimizer has every param group, in the user's order, even a group none of
    whose elements fall in this rank's shard (its ``params`` list is then empty): schedulers,
    index-based LR changes and checkpoints see the same groups on every rank.
    """

    def __init__(self, factory: OptimizerFactory, targets: list[Target], group_options: list[dict],
                 declared_elementwise: bool = False, placement: str = FLAT, exchange=None,
                 built: torch.optim.Optimizer | None = None):
        self.targets = targets
        self.placement = placement  # "flat" (1-D slices) or "owner" (whole tensors, their shapes)
        # Stage 3's owner exchange (zerodp.engine.exchange): the tensors it brings whole are stepped
        # as proxies on their owner; their pieces among the targets hold values only.
        self.exchange = exchange
        self.exchanged = frozenset() if exchange is None else frozenset(e.name for e in exchange.entries)
        self.proxies = [] if exchange is None else [
            Target(t, FlatLayout.pack([(e.name, e.shape)], 1), 0, e.group, e.name) for e, t in exchange.proxy_items()]
        stepped = [t for t in targets if t.name not in self.exchanged] + self.proxies
        param_groups = [{"params": [t.tensor for t in stepped if t.group == g], **opts}
                        for g, opts in enumerate(group_options)]
        # The user's optimizer is built once: the build over stand-ins that learned its class
        # (probe_factory) is pointed at the targets — its groups, options and (empty) state are
        # what the factory's build over them would hold — else the factory builds it now.
        self.optimizer = built if built is not None and _repoint(built, param_groups) else factory(param_groups)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                "optimizer must be a callable taking a list of param groups and returning a "
                f"torch.optim.Optimizer, e.g. lambda groups: torch.optim.AdamW(groups, lr=3e-4); "
                f"it returned {type(self.optimizer).__name__}"
            )
        if placement == OWNER:
            check_refused(self.optimizer)
        else:
            check_refused(self.optimizer)
            check_elementwise(self.optimizer, declared_elementwise)
        given = {id(p) for grp in self.optimizer.param_groups for p in grp["params"]}
        if given != {id(t.tensor) for t in stepped}:
            raise ValueError(
                "the optimizer factory must build its optimizer over exactly the param groups it is "
                "given (the engine's flat fp32 shards), not over model.parameters()"
            )

    def step(self) -> None:
        self.optimizer.step()

    def step_on(self, grads: list[torch.Tensor | None], unused: set[str], master_dtype: torch.dtype) -> None:
        """One engine step of the stock optimizer on ``grads`` (the reduced gradient each target
        reads, :attr:`targets` order; ``unused``: parameters no rank gave a gradient, left None).

        Gradients kept in bf16 are cast to fp32 for the optimizer: all at once that is 4 bytes per
        element of the whole shard alive during ``optimizer.step()`` (4Ψ/N at stage 3, more than
        the gradient shard itself). So the step runs over batches of targets of at most
        ``STEP_BATCH_BYTES`` of fp32 gradients, one ``optimizer.step()`` each: the update of an
        elementwise optimizer is per element, so this is bitwise the single step (targets without
        a gradient are skipped by each call). It is done in one call — ``optimizer.step()`` runs
        once per engine step, as torch's — whenever several calls could be seen: the optimizer has
        step hooks (which would run once per batch), or it is not one of torch's own classes (a
        class of the script's, or a library's, may count steps per param group: LAMB's bias
        correction, a warm-up). At stage 3 the tensors read whole are stepped on their owners by
        batches of units (:mod:`zerodp.engine.exchange`), or all at once in that one call."""
        exchange = self.exchange
        cast = any(g is not None and g.dtype != master_dtype for g in grads)
        one_call = (exchange is not None or cast) and _one_call(self.optimizer)
        if exchange is not None and not one_call:  # whole tensors stepped on their owners, by batch of units
            for units in exchange.batches():
                exchange.bring(unused, units)
                self.step()
                self.zero_grad()
                exchange.send_back()
        elif exchange is not None:  # one call: every unit's tensors at once
            exchange.bring(unused)
        batches = [range(len(grads))]
        if cast and not one_call:
            batches, start, size = [], 0, 0
            for i, g in enumerate(grads):
                size += 0 if g is None else 4 * g.numel()
                if size >= STEP_BATCH_BYTES:
                    batches.append(range(start, i + 1))
                    start, size = i + 1, 0
            batches.append(range(start, len(grads)))
        if exchange is not None and not one_call and not any(g is not None for g in grads):
            batches = []  # every tensor was stepped whole on its owner: no flat target to step
        for batch in batches:
            chosen = set(batch)
            self.attach_grads([g if i in chosen else None for i, g in enumerate(grads)], unused)
            self.step()
            self.zero_grad()
        if exchange is not None and one_call:
            exchange.send_back()

    def attach_grads(self, grads: list[torch.Tensor | None], unused: set[str] = frozenset()) -> None:
        """``target.tensor.grad`` ← the fp32 gradient of each target (None skips it this step).

        Targets of a parameter in ``unused`` (no rank computed a gradient for it this step) get
        None, so the stock optimizer leaves it untouched: no weight decay, no moment update, no
        step count, exactly as with DDP, where such a parameter's ``.grad`` stays None."""
        for t, g in zip(self.targets, grads):
            if t.name in self.exchanged:
                continue  # stepped whole on its owner (its proxy's .grad, OwnerExchange.bring)
            if g is None or (t.name in unused):
                t.tensor.grad = None
            else:
                g = g if g.dtype == t.tensor.dtype else g.to(t.tensor.dtype)
                t.tensor.grad = g if g.shape == t.tensor.shape else g.view(t.tensor.shape)

    def zero_grad(self) -> None:
        for t in self.targets + self.proxies:
            t.tensor.grad = None

    # ---- state as pieces --------------------------------------------------------------
    def state_kinds(self) -> list[str]:
        """Per-element state names (e.g. exp_avg, exp_avg_sq) present now: tensors shaped like
        their target (a 0-d scalar such as ``step`` is not one)."""
        kinds: set[str] = set()
        for t in self.targets + self.proxies:
            kinds.update(_elementwise_kinds(t, self.optimizer.state.get(t.tensor, {})))
        return sorted(kinds)

    def whole_states(self, t: Target) -> dict[str, torch.Tensor]:
        """``t``'s tensor states shaped unlike it (Adafactor's ``row_var``/``col_var``): kept whole
        by the owner of a whole target (the ownership path; the flat path has none)."""
        return _whole_states(t, self.optimizer.state.get(t.tensor, {}))

    def pieces(self, kinds: Iterable[str] | None = None,
               ranges: Callable[[Target], tuple[int, int]] | None = None) -> list[Piece]:
        """State as pieces. ``ranges(target)`` restricts each target to a flat range ``[lo, hi)``
        of its layout (stage 0 holds full replicas but each rank saves only its slice)."""
        whole = kinds is None  # all kinds: whole-tensor states too; a list: those per-element kinds
        kinds = self.state_kinds() if kinds is None else list(kinds)
        out = []
        for t in self.targets:
            state = self.optimizer.state.get(t.tensor, {})
            sources = [(PARAM, t.flat)] + [(k, state[k].view(-1)) for k in kinds
                                           if k in state and torch.is_tensor(state[k])
                                           and state[k].shape == t.tensor.shape]
            start, stop = t.flat_start, t.flat_start + t.tensor.numel()
            if ranges is not None:
                want = ranges(t)
                start, stop = max(start, want[0]), min(stop, want[1])
            for span in t.layout.spans(start, stop):
                lo = span.flat_start - t.flat_start
                for kind, tensor in sources:
                    out.append(Piece(span.slot.name, kind, span.param_start, span.param_stop,
                                     span.slot.shape, tensor[lo:lo + span.numel]))
            # Whole-tensor states go with the parameter's first element: saved by one rank.
            if whole and t.name is not None and start <= t.flat_start < stop:
                for kind, v in self.whole_states(t).items():
                    out.append(Piece(whole_name(t.name, kind), kind, 0, v.numel(), tuple(v.shape), v.view(-1)))
        for t in self.proxies:  # whole on the owner: states only (the values are the targets')
            if ranges is not None and ranges(t)[0] >= ranges(t)[1]:
                continue
            state = self.optimizer.state.get(t.tensor, {})
            for kind in kinds:
                v = state.get(kind)
                if torch.is_tensor(v) and v.shape == t.tensor.shape:
                    out.append(Piece(t.name, kind, 0, v.numel(), tuple(t.layout.slots[0].shape), v.view(-1)))
            if whole:
                for kind, v in self.whole_states(t).items():
                    out.append(Piece(whole_name(t.name, kind), kind, 0, v.numel(), tuple(v.shape), v.view(-1)))
        return out

    def owner_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every tensor state kept whole by one rank, by parameter name: the shape-unlike states
        of whole targets (Adafactor's factors), and every state of the exchange's proxies."""
        out = {t.name: self.whole_states(t) for t in self.targets if t.name is not None}
        for t in self.proxies:
            state = self.optimizer.state.get(t.tensor, {})
            out[t.name] = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1}
        return {n: s for n, s in out.items() if s}

    def scalar_state(self) -> dict:
        """Scalars (e.g. Adam's ``step``) per parameter name and per param group, and the
        per-element state kinds. Parameters skipped in some steps (unused by every rank) have
        their own step count, so the scalars are kept by parameter; ``groups`` holds, for each
        param group, the scalars of its first parameter held here (for older readers)."""
        params: dict[str, dict] = {}
        groups: list[dict] = [{} for _ in self.optimizer.param_groups]
        for t in self.targets + self.proxies:
            state = self.optimizer.state.get(t.tensor, {})
            scalars = {k: float(v) for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0}
            if state and t.name is not None:  # {} for a stepped parameter whose state has no scalars
                params.setdefault(t.name, scalars)
            if scalars and not groups[t.group]:
                groups[t.group] = scalars
        out = {"kinds": self.state_kinds(), "groups": groups}
        if all(t.name is not None for t in self.targets):  # per-parameter targets
            out["params"] = params
        if self.placement == OWNER:  # which states each parameter has, and the shapes of whole ones
            out["param_kinds"], out["whole"] = {}, {}
            for t in self.targets + self.proxies:
                state = self.optimizer.state.get(t.tensor, {})
                if state:
                    out["param_kinds"][t.name] = _elementwise_kinds(t, state)
                    out["whole"][t.name] = {k: list(v.shape) for k, v in _whole_states(t, state).items()}
        return out

    def load_scalar_state(self, scalars: dict) -> None:
        """Create the optimizer state (zeros + scalars) so that pieces can be loaded into it.

        Scalars go where ``torch.optim.Optimizer.load_state_dict`` puts them: on the parameter's
        device when the group is ``fused`` or ``capturable`` (CUDA kernels read ``step`` there),
        on the CPU otherwise."""
        groups = scalars.get("groups", [])
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"checkpoint has optimizer state for {len(groups)} param groups, this engine has "
                f"{len(self.optimizer.param_groups)}: build the engine with the same param groups"
            )
        by_param = scalars.get("params", {})
        param_kinds, whole = scalars.get("param_kinds", {}), scalars.get("whole", {})
        group_of = {id(p): g for g, grp in enumerate(self.optimizer.param_groups) for p in grp["params"]}
        name_of = {id(t.tensor): t.name for t in self.targets + self.proxies}
        for grp in self.optimizer.param_groups:
            on_device = bool(grp.get("fused") or grp.get("capturable"))
            for p in grp["params"]:
                # New checkpoints list scalars per parameter (one never stepped has none);
                # older ones per group.
                name = name_of.get(id(p))
                saved = (by_param.get(name) if "params" in scalars and name is not None
                         else groups[group_of[id(p)]])
                state = self.optimizer.state[p]
                state.clear()
                if saved is None:
                    continue
                # Per parameter where the checkpoint says which states it has (the ownership path:
                # Adafactor keeps `variance` for vectors, `row_var`/`col_var` for matrices).
                for kind in param_kinds.get(name, scalars.get("kinds", [])) if name is not None \
                        else scalars.get("kinds", []):
                    state[kind] = torch.zeros_like(p)
                for kind, shape in (whole.get(name, {}) if name is not None else {}).items():
                    state[kind] = torch.zeros(tuple(shape), dtype=p.dtype, device=p.device)
                for k, v in saved.items():
                    state[k] = torch.tensor(v, dtype=_scalar_dtype(),
                                            device=p.device if on_device else "cpu")

    def load_pieces(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Fill every piece this rank holds from ``read(name, kind, start, stop)``."""
        with torch.no_grad():
            for piece in self.pieces():
                src = read(piece.name, piece.kind, piece.start, piece.stop)
                if src.numel() != piece.tensor.numel():
                    raise ValueError(
                        f"checkpoint gave {src.numel()} elements for {piece.kind} of {piece.name}"
                        f"[{piece.start}:{piece.stop}], expected {piece.tensor.numel()}"
                    )
                piece.tensor.copy_(src.reshape(-1))


def _elementwise_kinds(t: Target, state: dict) -> list[str]:
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape == t.tensor.shape)


def _whole_states(t: Target, state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape != t.tensor.shape}
