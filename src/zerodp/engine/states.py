"""The lifecycle of a training step as enums with checked transitions (guide §12.9).

Four objects move through a step, each with one state value: the engine (:class:`StepState`),
each flat group's gradient buffers (:class:`GradState`), its parameters (:class:`ParamState`), and
each group within one backward pass (:class:`Phase`, held with what the backward has counted in
:class:`BackwardState`). A state changes only through :func:`moved`,
which refuses a transition that its table does not list — a broken call sequence then fails at
once with words, instead of leaving a flag set or a counter below zero for a later step to trip
over; counts (gradients still to come, units gathered) are derived from these states.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


def transitions(kind: type[enum.Enum], diagram: str) -> dict:
    """The table :func:`moved` checks, read from ``diagram``: one line per state of ``kind``,
    ``state -> next next ...`` by value. Every state has its line."""
    table = {}
    for line in diagram.strip().splitlines():
        state, _, nexts = line.partition("->")
        table[kind(state.strip())] = frozenset(kind(value) for value in nexts.split())
    if set(table) != set(kind):
        raise ValueError(f"{kind.__name__}: no line for {sorted(s.value for s in set(kind) - set(table))}")
    return table


def moved(table: dict, state: enum.Enum, to: enum.Enum, what: str) -> enum.Enum:
    """``to`` if ``table[state]`` lists it, else one line naming ``what`` and the transition."""
    if to not in table[state]:
        raise RuntimeError(f"{what}: {state.value} -> {to.value} is not a step of the training loop "
                           "(zerodp internal error: please report it)")
    return to


class StepState(enum.Enum):
    """Where the engine is in a training step (docs/porting.md; guide §12.9). One value per engine;
    every change goes through :func:`moved`, which refuses what ``STEP_MOVES`` does not list.

    ``IDLE``: no gradient since construction or ``zero_grad``. ``BACKWARD``: a backward pass is
    running through the engine's hooks; found at the start of any other call, it means that pass
    raised before its end (the next call then says so, and ``zero_grad`` recovers). ``ACCUMULATED``:
    backward passes finished, gradients held. ``STEPPED``: ``step`` applied them; they stay until
    ``zero_grad``, so a second ``step`` applies them again, as torch's optimizers do."""

    IDLE = "idle"
    BACKWARD = "backward"
    ACCUMULATED = "accumulated"
    STEPPED = "stepped"


STEP_MOVES = transitions(StepState, """
    idle        -> idle backward stepped
    backward    -> accumulated idle
    accumulated -> idle backward stepped
    stepped     -> idle backward stepped
""")


class GradState(enum.Enum):
    """What a group's gradient buffers hold (guide §12.5). One value per group; every change goes
    through :func:`moved`, which refuses a transition not in ``GRAD_MOVES``.

    ``NONE``: no gradient since ``zero_grad(set_to_none=True)`` (the master reads None, as torch
    reads ``.grad is None``). ``ZEROS``: ``zero_grad(set_to_none=False)`` zeroed them: the master
    reads zeros, which torch's optimizers still apply (momentum, weight decay). ``LOCAL``: local
    gradients of ``no_sync`` backwards, not reduced. ``REDUCED``: the mean over ranks is where the
    master reads it. ``REDUCED_LOCAL``: that, plus local gradients of later ``no_sync`` backwards
    waiting in ``grad_full`` for the next reduction, which adds them."""

    NONE = "none"
    ZEROS = "zeros"
    LOCAL = "local"
    REDUCED = "reduced"
    REDUCED_LOCAL = "reduced+local"


GRAD_MOVES = transitions(GradState, """
    none          -> none        local   reduced
    zeros         -> none zeros  local   reduced
    local         -> none zeros  local   reduced
    reduced       -> none zeros  reduced reduced+local
    reduced+local -> none zeros  reduced reduced+local
""")
#: the states in which ``grad_full`` holds gradients not yet reduced
HOLDS_LOCAL = frozenset({GradState.LOCAL, GradState.REDUCED_LOCAL})


class ParamState(enum.Enum):
    """Where a group's parameters are (guide §9.3, §12.1): ``SHARDED`` — only this rank's slice
    exists, the module's parameters are placeholders (stage 3 at rest); ``GATHERING`` — an
    AllGather into the full buffer is in flight (stage 3's prefetch, stages 1-2 after the step);
    ``GATHERED`` — the full buffer holds every rank's slice and the parameters view it (always, at
    stages 0-2, between those AllGathers)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


PARAM_MOVES = transitions(ParamState, """
    sharded   -> gathering gathered
    gathering -> gathered
    gathered  -> gathering gathered sharded
""")


class Phase(enum.Enum):
    """Where one group is in the current backward: no gradient yet, running (a gradient arrived
    or, stage 3, the unit's pre-backward hook ran), done (its reduction launched, or kept local)."""

    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


PHASE_MOVES = transitions(Phase, """
    waiting -> waiting running
    running -> waiting done
    done    -> waiting
""")


@dataclass
class BackwardState:
    """Where one group is in the current backward.

    ``fired[i]``: trainable parameter i got its gradient in this backward; ``remaining`` (derived):
    how many have not. A unit (stage 3) is also over only when the gradient w.r.t. its inputs was computed
    for every live graph that fed it inputs needing one (``pending_inputs`` is empty): a frozen
    parameter can still be needed after the last trainable one. ``pending_inputs`` holds one token
    per forward call whose graph is alive and not yet backwarded through the unit; a graph that is
    dropped (a validation loss under grad, a GAN's ``G(z).detach()``) takes its token with it."""

    fired: list[bool] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    pending_inputs: set[int] = field(default_factory=set)
    fwd_event: object = None  # the trace's open "forward <unit>" span
    bwd_event: object = None

    @property
    def remaining(self) -> int:
        return self.fired.count(False)

    def over(self) -> bool:
        return self.remaining == 0 and not self.pending_inputs

    def reset(self, trainable: int) -> None:
        self.fired = [False] * trainable
        self.move(Phase.WAITING)

    def move(self, to: Phase) -> None:
        self.phase = moved(PHASE_MOVES, self.phase, to, "backward phase")

    def fire(self, j: int) -> None:
        """Trainable parameter ``j`` got its gradient (once per backward; a second is an error)."""
        if self.fired[j]:
            raise RuntimeError("a parameter received two gradients in one backward pass through its group: "
                               "a parameter used twice must be reached by one autograd path per backward")
        self.fired[j] = True
