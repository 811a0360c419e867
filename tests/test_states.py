"""The engine's transition tables (engine/states.py): read from their diagrams, checked by moved."""

import enum
import re

import pytest

from zerodp.engine.outer import OUTER_MOVES, OuterState
from zerodp.engine.states import (GRAD_MOVES, PARAM_MOVES, PHASE_MOVES, STEP_MOVES, GradState, ParamState,
                                  Phase, StepState, moved, transitions)


class Door(enum.Enum):
    OPEN = "open"
    SHUT = "shut"


def test_a_diagram_reads_as_its_table():
    assert transitions(Door, "open -> shut\n  shut -> open shut") == {
        Door.OPEN: frozenset({Door.SHUT}), Door.SHUT: frozenset({Door.OPEN, Door.SHUT})}


def test_a_diagram_without_a_state_or_with_a_stranger_is_refused():
    with pytest.raises(ValueError, match=r"Door: no line for \['shut'\]"):
        transitions(Door, "open -> shut")
    with pytest.raises(ValueError, match="ajar"):
        transitions(Door, "open -> ajar\nshut -> open")


@pytest.mark.parametrize("kind,table", [(StepState, STEP_MOVES), (GradState, GRAD_MOVES),
                                        (ParamState, PARAM_MOVES), (Phase, PHASE_MOVES),
                                        (OuterState, OUTER_MOVES)])
def test_every_state_has_a_way_on_and_moved_refuses_what_is_not_listed(kind, table):
    assert set(table) == set(kind) and all(table[s] for s in kind)
    for state in kind:
        for to in kind:
            if to in table[state]:
                assert moved(table, state, to, "x") is to
            else:
                with pytest.raises(RuntimeError, match=re.escape(f"x: {state.value} -> {to.value} is not a step")):
                    moved(table, state, to, "x")


def test_the_step_diagram_says_what_the_loop_allows():
    # a backward interrupted by an exception goes back to idle through zero_grad; step twice is allowed
    assert StepState.IDLE in STEP_MOVES[StepState.BACKWARD]
    assert StepState.STEPPED in STEP_MOVES[StepState.STEPPED]
    assert StepState.STEPPED not in STEP_MOVES[StepState.BACKWARD]
    assert GradState.REDUCED_LOCAL not in GRAD_MOVES[GradState.LOCAL]
