"""When each contender of ``zerodp bench`` steps: the contenders alive at once (:func:`stage_groups`)
and, within a group, the alternated turns (:func:`schedule`; the reasons are in
:mod:`zerodp.bench.compare`'s docstring, "step time")."""

from __future__ import annotations

import random
from typing import Callable

from zerodp.bench.contenders import COMPARISONS, CONTENDERS, MUON_PEER

def timed_rounds(steps: int, turn: int) -> int:
    """Rounds of :func:`schedule` that time at least ``steps`` steps of each contender (a turn of
    ``turn`` > 1 steps times all but its first)."""
    return -(-steps // max(1, turn - 1))


def schedule(names: list[str], warmup: int, rounds: int, turn: int, seed: int):
    """The bench's order of steps after each contender's first: yields
    ``(round, name, timed)``. Rounds ``1 .. warmup - 1`` are one untimed step per contender; each
    later round gives every contender a turn of ``turn`` consecutive steps, the first untimed
    when ``turn`` > 1; the order of the turns is shuffled per round, seeded, so every rank walks
    the same schedule."""
    for i in range(1, rounds + 1):
        order = list(names)
        random.Random(seed * 1_000_003 + i).shuffle(order)
        for name in order:
            if i < warmup:
                yield i, name, False
                continue
            for j in range(turn):
                yield i, name, turn == 1 or j > 0


def steps_per_contender(warmup: int, rounds: int, turn: int) -> int:
    """Steps each contender runs in :func:`schedule`, its first (build) step included."""
    return 1 + sum(1 if i < warmup else turn for i in range(1, rounds + 1))



def stage_groups(names: list[str], fits: Callable[[list[str]], bool] | None = None) -> list[list[str]]:
    """The contenders alive at the same time: the floor with each stage's own (ours + peers + the
    auto row). Stages run one after the other, so the memory needed is the largest group's, not
    the sum over every contender (a 124M-parameter model at four stages would not fit otherwise).

    ``fits``: whether a group fits the machine's memory. A stage group that does not is split:
    ours with its reference peer alone (the comparison stays alternated step by step), then the
    floor and the stage's other contenders in as few groups as fit; the floor's times are pooled
    over the groups it runs in.

    Under ``--optimizer muon`` one peer, DDP + Muon, is the reference of every stage: every
    contender then lives in one group, alternated with all the others, where that fits; where it
    does not, the peer runs in stage 0's group and the other stages compare with it across groups."""
    if MUON_PEER in names:
        whole = ["floor", *(n for n in names if n != "floor")]
        if fits is None or fits(whole):
            return [whole]
    by_stage: dict[int, list[str]] = {}
    for name in names:
        stage = CONTENDERS[name][0]
        if stage is not None:
            by_stage.setdefault(stage, []).append(name)
    out = []
    for stage, group in sorted(by_stage.items()):
        whole = ["floor", *group]
        if fits is None or fits(whole):
            out.append(whole)
            continue
        ours, peers = COMPARISONS[stage]
        reference = next((n for n in group if CONTENDERS[n][1] == "peer"), peers[0])  # the first peer listed
        pair = [n for n in (ours, reference) if n in group]
        out.append(pair)
        current: list[str] = []
        for name in ["floor", *(n for n in group if n not in pair)]:
            if current and not fits(current + [name]):
                out.append(current)
                current = []
            current.append(name)
        out.append(current)
    return out or [["floor"]]

