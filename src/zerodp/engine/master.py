"""fp32 master shards and the stock ``torch.optim`` optimizer that updates them: the optimizer part.

Guide §1, §9.1: with bf16 mixed precision each parameter carries an fp32 master copy plus the
optimizer's states (Adam: m and v), k = 12 bytes per parameter. ZeRO shards exactly this part:
rank r keeps the master values and optimizer states of its 1/N slice of every flat buffer, and
updates only that slice. Because the update of Adam, AdamW, SGD and friends is *elementwise*,
running the stock optimizer on a 1-D slice gives bit-for-bit the same numbers as running it on
the whole tensor — which is why sharding is exact (the *flat* path, the default for them).
Optimizers that read whole tensors (Muon's Newton–Schulz orthogonalisation of a matrix,
Adafactor's factored row/column moments, or any optimizer declared with
``optimizer_layout="owner"``) take the *tensor-ownership* path instead: the flat buffers are
laid out owner-aligned (:meth:`zerodp.engine.layout.FlatLayout.owned`), so slice r holds whole
tensors, and rank r steps them with their real shapes; the tensors of an elementwise optimizer
beside it (AdamW in ``[Muon(matrices), AdamW(the rest)]``) stay flat at stages 1-2. Stage 3
keeps its units flat and steps such tensors as *proxies*: whole tensors that the owner exchange
(:mod:`zerodp.engine.exchange`) fills on their owner for the step, the optimizer's state living
on them. Which path, which groups are read whole, and what is refused is the optimizer plan's
(:mod:`zerodp.engine.optimizer_plan`), decided once before any buffer exists.

Each :class:`Target` is one fp32 tensor the optimizer updates: elements
``[flat_start, flat_start + numel)`` of a flat buffer (its full extent for stage 0, the rank's
shard for stages 1-3) — 1-D on the flat path, one whole parameter with its shape on the
ownership path. Targets of one parameter group go to one optimizer param group.

Checkpoints see this state as :class:`Piece` s — "elements [start, stop) of parameter NAME, of
kind KIND" — which is independent of stage and world size, so a checkpoint saved at one layout
loads at any other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from zerodp.engine.config import ALIGNED, EXCHANGE, Policy
from zerodp.engine.exchange import OwnerExchange
from zerodp.engine.layout import FlatLayout
from zerodp.engine.optimizer_plan import (FLAT, OWNER, OptimizerFactory, OptimizerPlan, check_elementwise, members,
                                          check_refused, state_cost)

#: On CPU the stock optimizer's per-tensor path makes ~8 passes over each tensor it updates; over
#: chunks of this many elements (512 KiB of fp32) those passes stay in cache, where over one flat
#: buffer of millions of elements each pass goes to memory (AdamW on 11M elements: ~2-3x faster).
CPU_OPTIMIZER_CHUNK = 1 << 17

PARAM = "param"

#: the most fp32 gradient bytes cast at once for the optimizer step (:meth:`MasterOptimizer.step_on`)
STEP_BATCH_BYTES = 16 * 1024 * 1024

#: Separator of a whole-tensor state's piece name: ``"fc.weight::row_var"`` (Adafactor's factors,
#: shaped unlike their parameter, are saved whole by the parameter's owner).
WHOLE_SEP = "::"

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


def build_master(plan: OptimizerPlan, groups: list, policy: Policy, shard_comm, master_dtype: torch.dtype,
                 device: torch.device, per_param: bool = False,
                 declared_elementwise: bool = False) -> "MasterOptimizer":
    """The optimizer part over every flat group's master (guide §12.3): its targets — the held
    range of each group's master, by :func:`group_targets` — the slice of each group's gradient
    each target reads, and at stage 3 the owner exchange of the tensors read whole."""
    targets, slices = [], []
    for g in groups:
        for t in group_targets(plan, policy, g.master, g.layout, g.master_start, device, per_param):
            lo = t.flat_start - g.master_start
            targets.append(t)
            slices.append((g, lo, lo + t.tensor.numel()))
    master = MasterOptimizer(plan.factory, targets, list(plan.group_options), declared_elementwise,
                             placement=plan.placement, exchange=owner_exchange(plan, policy, groups, shard_comm,
                                                                                 master_dtype, device),
                             built=plan.built)
    master.target_slices = slices
    master.plan = replace(plan, built=None)
    return master


def owner_exchange(plan: OptimizerPlan, policy: Policy, groups: list, shard_comm, master_dtype: torch.dtype,
                   device: torch.device) -> OwnerExchange | None:
    """Stage 3 on the ownership path: the owner exchange of the tensors read whole, their
    owners balanced by the optimizer state each costs (:mod:`zerodp.engine.exchange`)."""
    whole = plan.whole_groups
    if policy.whole_tensors != EXCHANGE or not whole:
        return None
    group_of, kinds = plan.group_by_name, plan.state_kinds

    def exchanged(name: str) -> int | None:
        g = group_of.get(name, -1)
        return g if g in whole else None

    def cost(name: str, shape: tuple[int, ...]) -> int:
        g = group_of.get(name, -1)  # (frozen: no state)
        return 0 if g < 0 else state_cost(kinds[g] if g < len(kinds) else None, shape)

    return OwnerExchange(groups, exchanged, cost, shard_comm, master_dtype, device)


def group_targets(plan: OptimizerPlan, policy: Policy, tensor: torch.Tensor, layout: FlatLayout, flat_start: int,
                  device: torch.device, per_param: bool) -> list[Target]:
    """Optimizer targets over a held range of a flat buffer, in cache-sized chunks on CPU (see
    :func:`param_targets`): per parameter where a parameter may go unused in a step
    (``per_param``: stage 3, ``find_unused_parameters=True``, an adopted optimizer), so that the
    optimizer can skip it whole; otherwise across parameters, fewer tensors for the optimizer's
    per-tensor work. On the ownership path each parameter this rank holds is one target, whole,
    with its shape — in an owner-aligned layout or a full replica (stage 0) — and a flat bucket of
    an elementwise optimizer beside it (the plan's ``whole_groups``) gives per-parameter pieces."""
    by_name = plan.group_by_name

    def group_of(name: str) -> int:
        return by_name.get(name, -1)

    if plan.placement == OWNER and (layout.aligned or not policy.shard_master):
        return whole_targets(tensor, layout, flat_start, group_of)
    if plan.placement == OWNER and policy.whole_tensors == ALIGNED \
            and any(group_of(s.name) in plan.whole_groups for s in layout.slots):
        raise ValueError("a tensor of a per-tensor optimizer lies in a flat bucket, cut across ranks (zerodp "
                         "internal error: please report it)")
    chunk = CPU_OPTIMIZER_CHUNK if device.type == "cpu" else None
    return param_targets(tensor, layout, flat_start, group_of, chunk, per_param=per_param or plan.placement == OWNER)


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
        self.target_slices: list[tuple] = []  # (group, lo, hi): the gradient each target reads (build_master)
        self.plan: OptimizerPlan | None = None  # what it was built from (build_master)
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
