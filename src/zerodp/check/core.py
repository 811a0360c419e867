"""The differential core: the engine against a single-process reference, within tolerances derived
from the dtype and the magnitude (guide §2.2, §12.3).

Both ``zerodp check`` and the project's differential matrix (``tests/_matrix.py``) use these:

- :func:`tolerance`: rtol = 2·n·ε for a sum of n terms taken in another order (ε =
  ``torch.finfo(dtype).eps``). Data parallelism computes each rank's forward and backward exactly
  as one process does on that rank's rows; what differs is the order in which the ranks' and the
  micro-batches' gradients are summed, which moves a sum of n terms by at most about n·ε of the
  terms' magnitude. atol is rtol × the largest reference value (what cancellation may leave).
- :func:`fed_tolerance`: after k steps on the *same* gradients the stock optimizer and the
  engine's sharded one repeat the same arithmetic on the same tensors; at most one float32
  rounding of each element per step differs (how kernels group tensors), carried forward:
  rtol = 2·k·ε(float32).
- :func:`measure` (how far off, as a fraction of what is allowed, ``torch.testing.assert_close``
  semantics) and :func:`assert_within` (raise past it, with an extra per-element bound).
- :class:`Stepped`: several stock optimizers stepped as one (Muon + AdamW), the reference of a list.
- :func:`gather_state`: every rank's checkpoint pieces assembled into full flat tensors, the way a
  checkpoint saved at one stage and world size is loaded at another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def tolerance(dtype: torch.dtype, n_terms: int) -> float:
    """rtol for a sum of ``n_terms`` terms taken in another order (module docstring)."""
    return 2 * n_terms * torch.finfo(dtype).eps


def fed_tolerance(steps: int) -> float:
    """rtol (and atol over the largest element) after ``steps`` steps on the same gradients."""
    return tolerance(torch.float32, steps)


@dataclass(frozen=True)
class Closeness:
    """How far ``got`` is from ``want``: the largest |difference|, the allowed difference at that
    element (atol + rtol·|want|), and ``ratio``, the worst |difference| / allowed over all elements
    (≤ 1: within the tolerance)."""

    diff: float
    allowed: float
    ratio: float
    name: str = ""

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    def worse(self, other: "Closeness") -> "Closeness":
        return other if other.ratio > self.ratio else self


NONE = Closeness(0.0, 0.0, 0.0)


def measure(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, name: str = "",
            extra: torch.Tensor | float | None = None) -> Closeness:
    """|got − want| against atol + rtol·|want| (+ ``extra``, a documented per-element bound),
    element by element, in float64 (``torch.testing.assert_close`` semantics; NaN where the
    other has a number is infinitely off; a shape mismatch is infinitely off)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return Closeness(float("inf"), 0.0, float("inf"), name)
    if got.numel() == 0:
        return Closeness(0.0, 0.0, 0.0, name)
    err = (got - want).abs()
    err = torch.where(torch.isnan(got) & torch.isnan(want), torch.zeros_like(err), err)
    err = torch.nan_to_num(err, nan=float("inf"))
    allowed = atol + rtol * want.abs() + (0.0 if extra is None else extra)
    ratio = torch.where(err == 0, torch.zeros_like(err), err / allowed.clamp_min(1e-300))
    i = int(ratio.reshape(-1).argmax())
    return Closeness(float(err.reshape(-1)[i]), float(allowed.reshape(-1)[i]), float(ratio.reshape(-1)[i]), name)


def assert_within(got, want, rtol: float, atol: float, extra, msg: str) -> None:
    """|got − want| ≤ atol + rtol·|want| + extra, element by element; else one AssertionError
    naming how many elements are off and the worst one."""
    got, want = got.double().cpu(), want.double().cpu()
    err = (got - want).abs()
    allowed = atol + rtol * want.abs() + (0.0 if extra is None else extra)
    if not bool((err <= allowed).all()):
        i = int((err - allowed).reshape(-1).argmax())
        raise AssertionError(f"{msg}: {int((err > allowed).sum())} of {err.numel()} elements off; element {i}: "
                             f"got {got.reshape(-1)[i]:.6e}, expected {want.reshape(-1)[i]:.6e}, "
                             f"|diff| {err.reshape(-1)[i]:.3e} > allowed {allowed.reshape(-1)[i]:.3e}")


def compare_dicts(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float,
                  scale: float | None = None) -> Closeness:
    """The worst :func:`measure` over ``want``'s tensors by name; atol = rtol × ``scale`` (default:
    the largest |value| of all of ``want``, the magnitude that cancellation can leave behind).
    A name missing from ``got`` is infinitely off."""
    if scale is None:
        scale = max((float(t.detach().abs().max()) for t in want.values() if t.numel()), default=0.0)
    worst = NONE
    for name, w in want.items():
        if name not in got:
            return Closeness(float("inf"), 0.0, float("inf"), f"{name} (missing)")
        worst = worst.worse(measure(got[name], w, rtol, rtol * scale, name))
    return worst


class Stepped:
    """Several stock optimizers over disjoint parameters, stepped one after the other (the
    single-process reference of a list such as ``[Muon(matrices), AdamW(rest)]``; its
    ``state_dict()`` numbers parameters across them in the order given, as torch numbers one's)."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        state, groups, base = {}, [], 0
        for o in self.optimizers:
            sd = o.state_dict()
            n = sum(len(g["params"]) for g in sd["param_groups"])
            state.update({base + i: v for i, v in sd["state"].items()})
            groups += [{**g, "params": [base + i for i in g["params"]]} for g in sd["param_groups"]]
            base += n
        return {"state": state, "param_groups": groups}


def gather_state(engine, lead: int = 0):
    """Collective over the default group: every rank's checkpoint pieces (``engine.checkpoint.state_pieces()``,
    None where this rank holds no engine) and the optimizer's scalars, assembled into full flat
    tensors by (name, kind), NaN marking what no rank saved; the scalars are rank ``lead``'s."""
    pieces = [] if engine is None else [(p.name, p.kind, p.start, p.stop, p.shape, p.tensor.detach().cpu().clone())
                                        for p in engine.checkpoint.state_pieces()]
    scalars = None if engine is None else engine.checkpoint.scalar_state()
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (pieces, scalars))
    full: dict = {}
    for rank_pieces, _ in everything:
        for name, kind, start, stop, shape, t in rank_pieces:
            numel = 1
            for s in shape:
                numel *= s
            fill = float("nan") if t.is_floating_point() else 0
            buf = full.setdefault((name, kind), torch.full((numel,), fill, dtype=t.dtype))
            buf[start:stop] = t
    return full, everything[lead][1]
