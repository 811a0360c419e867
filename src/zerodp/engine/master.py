"""fp32 master shards and the stock ``torch.optim`` optimizer that updates them.

Guide §1, §9.1: with bf16 mixed precision each parameter carries an fp32 master copy plus the
optimizer's states (Adam: m and v), k = 12 bytes per parameter. ZeRO shards exactly this part:
rank r keeps the master values and optimizer states of its 1/N slice of every flat buffer, and
updates only that slice. Because the update of Adam, AdamW, SGD and friends is *elementwise*,
running the stock optimizer on a 1-D slice gives bit-for-bit the same numbers as running it on
the whole tensor — which is why sharding is exact. Optimizers that couple elements (Adafactor's
factored row/column moments, LBFGS, Muon) are refused.

Each :class:`Target` is one 1-D fp32 tensor the optimizer updates: elements
``[flat_start, flat_start + numel)`` of a flat buffer (its full extent for stage 0, the rank's
shard for stages 1-3). Targets of one parameter group go to one optimizer param group.

Checkpoints see this state as :class:`Piece` s — "elements [start, stop) of parameter NAME, of
kind KIND" — which is independent of stage and world size, so a checkpoint saved at one layout
loads at any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from zerodp.engine.layout import FlatLayout

PARAM = "param"

# Optimizers whose update of element i reads only element i of the parameter, its gradient and
# its states (plus scalars shared by the whole tensor, such as the step count).
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta")
    if hasattr(torch.optim, name)
)

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Target:
    """One 1-D fp32 tensor the optimizer updates: elements ``[flat_start, flat_start + numel)``
    of ``layout``, all of one parameter ``name`` (so that a parameter no rank used this step can
    be skipped as a whole, as torch's optimizers skip a parameter whose ``.grad`` is None)."""

    tensor: torch.Tensor  # 1-D fp32, the values the optimizer updates
    layout: FlatLayout
    flat_start: int
    group: int
    name: str | None = None  # the parameter these elements belong to


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


def check_elementwise(optimizer: torch.optim.Optimizer, declared: bool = False) -> None:
    """Refuse optimizers not known to be elementwise: their sharded update would be wrong.

    Known means one of the stock classes themselves (``type(optimizer) in ELEMENTWISE_OPTIMIZERS``):
    a subclass may couple elements (LARS over SGD scales by a per-tensor trust ratio, and a target
    here spans several parameters), so it is trusted only when declared with
    ``parallelize(..., elementwise_optimizer=True)``."""
    if declared or type(optimizer) in ELEMENTWISE_OPTIMIZERS:
        return
    known = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
    base = next((c.__name__ for c in ELEMENTWISE_OPTIMIZERS if isinstance(optimizer, c)), None)
    what = (f"{type(optimizer).__name__} subclasses {base}, and a subclass may read whole tensors"
            if base else f"{type(optimizer).__name__} is not known to be elementwise")
    raise ValueError(
        f"{what}: ZeRO runs the optimizer on 1/N slices of flattened parameters, which is exact only when each "
        f"element's update depends on that element alone (factored or matrix-wise optimizers such as Adafactor, "
        f"Muon, LARS or LBFGS read whole rows, tensors or matrices). Use one of: {known}; or, if its update is "
        f"elementwise, declare it with parallelize(..., elementwise_optimizer=True).")


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class MasterOptimizer:
    """The stock optimizer over fp32 targets, with state exposed as pieces and scalars.

    Every rank's optimizer has every param group, in the user's order, even a group none of
    whose elements fall in this rank's shard (its ``params`` list is then empty): schedulers,
    index-based LR changes and checkpoints see the same groups on every rank.
    """

    def __init__(self, factory: OptimizerFactory, targets: list[Target], group_options: list[dict],
                 declared_elementwise: bool = False):
        self.targets = targets
        param_groups = [{"params": [t.tensor for t in targets if t.group == g], **opts}
                        for g, opts in enumerate(group_options)]
        self.optimizer = factory(param_groups)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(
                "optimizer must be a callable taking a list of param groups and returning a "
                f"torch.optim.Optimizer, e.g. lambda groups: torch.optim.AdamW(groups, lr=3e-4); "
                f"it returned {type(self.optimizer).__name__}"
            )
        check_elementwise(self.optimizer, declared_elementwise)
        given = {id(p) for grp in self.optimizer.param_groups for p in grp["params"]}
        if given != {id(t.tensor) for t in targets}:
            raise ValueError(
                "the optimizer factory must build its optimizer over exactly the param groups it is "
                "given (the engine's flat fp32 shards), not over model.parameters()"
            )

    def step(self) -> None:
        self.optimizer.step()

    def attach_grads(self, grads: list[torch.Tensor | None], unused: set[str] = frozenset()) -> None:
        """``target.tensor.grad`` ← the fp32 gradient of each target (None skips it this step).

        Targets of a parameter in ``unused`` (no rank computed a gradient for it this step) get
        None, so the stock optimizer leaves it untouched: no weight decay, no moment update, no
        step count, exactly as with DDP, where such a parameter's ``.grad`` stays None."""
        for t, g in zip(self.targets, grads):
            if g is None or (t.name in unused):
                t.tensor.grad = None
            else:
                t.tensor.grad = g if g.dtype == torch.float32 else g.float()

    def zero_grad(self) -> None:
        for t in self.targets:
            t.tensor.grad = None

    # ---- state as pieces --------------------------------------------------------------
    def state_kinds(self) -> list[str]:
        """Per-element state names (e.g. exp_avg, exp_avg_sq) present now."""
        kinds: set[str] = set()
        for t in self.targets:
            for k, v in self.optimizer.state.get(t.tensor, {}).items():
                if torch.is_tensor(v) and v.shape == t.tensor.shape and v.dim() == 1:
                    kinds.add(k)
        return sorted(kinds)

    def pieces(self, kinds: Iterable[str] | None = None,
               ranges: Callable[[Target], tuple[int, int]] | None = None) -> list[Piece]:
        """State as pieces. ``ranges(target)`` restricts each target to a flat range ``[lo, hi)``
        of its layout (stage 0 holds full replicas but each rank saves only its slice)."""
        kinds = self.state_kinds() if kinds is None else list(kinds)
        out = []
        for t in self.targets:
            state = self.optimizer.state.get(t.tensor, {})
            sources = [(PARAM, t.tensor)] + [(k, state[k]) for k in kinds if k in state]
            start, stop = t.flat_start, t.flat_start + t.tensor.numel()
            if ranges is not None:
                want = ranges(t)
                start, stop = max(start, want[0]), min(stop, want[1])
            for span in t.layout.spans(start, stop):
                lo = span.flat_start - t.flat_start
                for kind, tensor in sources:
                    out.append(Piece(span.slot.name, kind, span.param_start, span.param_stop,
                                     span.slot.shape, tensor[lo:lo + span.numel]))
        return out

    def scalar_state(self) -> dict:
        """Scalars (e.g. Adam's ``step``) per parameter name and per param group, and the
        per-element state kinds. Parameters skipped in some steps (unused by every rank) have
        their own step count, so the scalars are kept by parameter; ``groups`` holds, for each
        param group, the scalars of its first parameter held here (for older readers)."""
        params: dict[str, dict] = {}
        groups: list[dict] = [{} for _ in self.optimizer.param_groups]
        for t in self.targets:
            state = self.optimizer.state.get(t.tensor, {})
            scalars = {k: float(v) for k, v in state.items() if not torch.is_tensor(v) or v.dim() == 0}
            if state and t.name is not None:  # {} for a stepped parameter whose state has no scalars
                params.setdefault(t.name, scalars)
            if scalars and not groups[t.group]:
                groups[t.group] = scalars
        out = {"kinds": self.state_kinds(), "groups": groups}
        if all(t.name is not None for t in self.targets):  # per-parameter targets
            out["params"] = params
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
        group_of = {id(p): g for g, grp in enumerate(self.optimizer.param_groups) for p in grp["params"]}
        name_of = {id(t.tensor): t.name for t in self.targets}
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
                for kind in scalars.get("kinds", []):
                    state[kind] = torch.zeros_like(p)
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
