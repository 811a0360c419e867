"""The differential matrix (tests/_matrix.py): every stage 0-3 × world sizes 1-4 × mesh (flat,
hybrid) × compression (none, bf16 reduction, int8 qwZ + qgZ) × optimizer (SGD, Adafactor, Muon +
AdamW, LARS declared per-tensor) × model features × usage, against a
single-process reference with dtype-derived tolerances, widened in compressed cases by each
option's documented bound (guide §15), computed per element from every rank's own gradient; and
DiLoCo over hybrid ZeRO (guide §16: stage × H × fragments × delay × outer optimizer × usage —
no_sync, accumulation, clipping, bf16) against a reference written from its update rule.

``make test`` runs a pairwise covering table (every value of every dimension meets every value
of every other dimension at least once), seeded so that it is the same list on every machine;
``make fuzz`` (``ZERODP_MATRIX_RANDOM=N``, 520 there) adds N uniformly random cases. A
failure names each failing case as one line, which ``python tests/_matrix.py "<line>"`` reruns.
"""

from __future__ import annotations

import os
import time

import pytest

from _engine_common import ALL_WORLDS, spawn_once
from _matrix import (COMPRESS, DILOCO_OUTERS, DILOCO_USAGES, OPTIMIZERS, STAGES, USAGES, WORLDS, Case, DiLoCoCase,
                     diloco_cases, pairwise_cases, random_cases, random_diloco_cases, run_cases, run_cases_lr_off,
                     run_cases_miscaled, run_diloco_cases, valid)

pytestmark = pytest.mark.dist


def _run(cases: list[Case], runner=run_cases) -> tuple[list[str], int]:
    failures, ran = [], 0
    by_world: dict[int, list[Case]] = {}
    for c in cases:
        by_world.setdefault(c.ranks_needed, []).append(c)
    for world, group in sorted(by_world.items()):
        results = spawn_once(runner, world, group, timeout=120 + 20 * len(group))
        for i, case in enumerate(group):
            errors = {rank_results[i][1] for rank_results in results if rank_results[i][1]}
            ran += 1
            if errors:
                failures.append(f"{case}\n    rerun: python tests/_matrix.py \"{case}\"\n    "
                                + "\n    ".join(sorted(errors)))
    return failures, ran


def test_pairwise_table_covers_every_pair():
    cases = pairwise_cases()
    assert {c.stage for c in cases} == {0, 1, 2, 3} and {c.world for c in cases} == {1, 2, 3, 4}
    assert {(c.stage, c.compress) for c in cases} == {(s, k) for s in range(4) for k in COMPRESS if valid(s, k)}
    assert {(c.optimizer, c.stage) for c in cases} == {(o, s) for o in OPTIMIZERS for s in STAGES}
    assert {(c.optimizer, c.world) for c in cases} == {(o, w) for o in OPTIMIZERS for w in WORLDS}
    assert all(any(c.usage == u and c.stage == s for c in cases) for u in {c.usage for c in cases} for s in range(4))
    assert len(cases) <= 60, len(cases)
    assert Case.parse(str(cases[0])) == cases[0]


def test_matrix_pairwise():
    failures, ran = _run(pairwise_cases())
    assert not failures, f"{len(failures)} of {ran} matrix cases failed:\n" + "\n".join(failures)


#: hybrid sharding at 4 ranks as 2 shard groups × 2 replicas, stages 1-3 (guide §14), besides what
#: the pairwise table draws
HYBRID_2X2 = [Case.parse(f"stage={s} world=4 mesh=hybrid usage={u} features={f}") for s, u, f in
              ((1, "no_sync", "groups,tied"), (2, "multi_backward", "frozen,unused"), (3, "two_forwards", "buffer"))]


#: make test runs the pairwise table (which crosses every mesh and compression with every stage and
#: world); make fuzz (ZERODP_ALL_WORLDS=1) adds the hand-picked lists below
EXTRA = pytest.mark.skipif(not ALL_WORLDS,
                           reason="make fuzz (ZERODP_ALL_WORLDS=1) runs the extra hand-picked cases")


@EXTRA
def test_matrix_hybrid_2x2_stages_1_to_3():
    failures, ran = _run(HYBRID_2X2)
    assert not failures, f"{len(failures)} of {ran} hybrid cases failed:\n" + "\n".join(failures)


#: each compression option on the 2 × 2 mesh and at world 3 (shards of uneven blocks), besides
#: what the pairwise table draws
COMPRESSED = [Case.parse(f"stage={s} world={w} mesh={m} compress={k} usage={u} features={f}") for s, w, m, k, u, f in
              ((3, 4, "hybrid", "int8", "no_sync", "frozen,twice"), (2, 4, "hybrid", "bf16", "clip", "groups"),
               (1, 3, "flat", "int8", "multi_backward", "unused"), (0, 4, "hybrid", "bf16", "two_forwards", "tied"))]


@EXTRA
def test_matrix_compressed_within_their_bounds():
    failures, ran = _run(COMPRESSED)
    assert not failures, f"{len(failures)} of {ran} compressed cases failed:\n" + "\n".join(failures)


@EXTRA
def test_compressed_checks_fail_on_a_codec_two_percent_off():
    """The bounds are tight enough to matter: with every dequantized value 2% too large, both the
    gradient check (stage 2, qgZ) and the used-parameter check (stage 3 hybrid, qwZ) fail."""
    cases = [Case.parse("stage=2 world=2 mesh=flat compress=int8 usage=no_sync features=-"),
             Case.parse("stage=3 world=4 mesh=hybrid compress=int8 usage=two_forwards features=buffer")]
    for case, what in zip(cases, ("within the compression bound", "as forward used it")):
        results = spawn_once(run_cases_miscaled, case.ranks_needed, [case], 1.02, timeout=180)
        errors = [err for rank_results in results for _, err in rank_results if err]
        assert errors and all(what in e for e in errors), (case, errors[:1])


#: every per-tensor optimizer at every stage and world size (the pairwise table meets each with
#: every stage and, separately, every world size), usage and features varying along the list
PER_TENSOR = [Case(s, w, USAGES[i % len(USAGES)], frozenset([("tied", "groups"), ("frozen", "unused"), ("buffer",),
                                                             ("twice", "reduce_once")][i % 4]), optimizer=o)
              for i, (o, s, w) in enumerate((o, s, w) for o in OPTIMIZERS[1:] for s in STAGES for w in WORLDS)]


#: bf16 mixed precision at every stage and world size, the optimizers in turn (the pairwise table
#: draws bf16 only a few times; torch 2.11 failed each of them: tests/test_compat.py)
_FEATURES = [("tied", "groups"), ("frozen", "unused"), ("buffer",), ("twice", "reduce_once")]
BF16 = [Case(s, w, "bf16", frozenset(_FEATURES[i % 4]), optimizer=OPTIMIZERS[i % len(OPTIMIZERS)])
        for i, (s, w) in enumerate((s, w) for s in STAGES for w in WORLDS)]


@EXTRA
def test_matrix_bf16_at_every_stage_and_world():
    failures, ran = _run(BF16)
    assert ran == 16
    assert not failures, f"{len(failures)} of {ran} bf16 cases failed:\n" + "\n".join(failures)


@EXTRA
def test_matrix_per_tensor_optimizers_at_every_stage_and_world():
    failures, ran = _run(PER_TENSOR)
    assert ran == 48
    assert not failures, f"{len(failures)} of {ran} per-tensor optimizer cases failed:\n" + "\n".join(failures)


def test_per_tensor_checks_fail_on_a_learning_rate_a_thousandth_off():
    """The bound of the per-tensor cases is tight enough to matter: with the engine's learning
    rates 0.1% too large (the reference's exact), each per-tensor optimizer's case fails."""
    cases = [Case.parse(f"stage={s} world=2 optimizer={o} usage=no_sync features=-")
             for s, o in ((1, "adafactor"), (2, "muon_adamw"), (3, "lars"))]
    results = spawn_once(run_cases_lr_off, 2, cases, 1.001, timeout=180)
    for i, case in enumerate(cases):
        errors = [rank_results[i][1] for rank_results in results if rank_results[i][1]]
        assert errors and all(str(case) in e for e in errors), (str(case), errors[:1])


@pytest.mark.fuzz
@pytest.mark.skipif("ZERODP_MATRIX_RANDOM" not in os.environ,
                    reason="make fuzz sets ZERODP_MATRIX_RANDOM (520 random cases); make test runs the pairwise table")
def test_matrix_random():
    """ZERODP_MATRIX_RANDOM=N (make fuzz: 520) random cases, besides the pairwise table."""
    n = int(os.environ["ZERODP_MATRIX_RANDOM"])
    seed = int(os.environ.get("ZERODP_MATRIX_SEED", "0"))
    t = time.perf_counter()
    failures, ran = _run(random_cases(n, seed))
    print(f"matrix: {ran} random cases (seed {seed}) in {time.perf_counter() - t:.0f} s")
    assert not failures, f"{len(failures)} of {ran} matrix cases failed:\n" + "\n".join(failures)


# ---- DiLoCo (guide §16) ----------------------------------------------------------------------------
def test_diloco_cases_cover_stages_usages_and_outers():
    cases = diloco_cases()
    assert {c.stage for c in cases} == set(STAGES) and {c.usage for c in cases} == set(DILOCO_USAGES)
    assert {c.outer for c in cases} == set(DILOCO_OUTERS)
    assert any(c.fragments > 1 for c in cases) and any(c.delay > 0 for c in cases)
    assert all(DiLoCoCase.parse(str(c)) == c for c in cases)


def test_matrix_diloco():
    """make test: seven cases on 2 groups of 2 ranks (the fuzzer's sequences take worlds 2 and 3)."""
    failures, ran = _run(diloco_cases(), run_diloco_cases)
    assert not failures, f"{len(failures)} of {ran} DiLoCo cases failed:\n" + "\n".join(failures)


@EXTRA
def test_diloco_checks_fail_on_an_outer_lr_a_hundredth_off():
    """The bound is tight enough to matter: with the engine's outer learning rate 1% off (the
    reference's exact), a case fails."""
    case = DiLoCoCase(1, 2, 2, 1, 0, "nesterov", "plain")
    results = spawn_once(_outer_lr_off, 2, [case], 1.01, timeout=180)
    errors = [rank_results[0][1] for rank_results in results if rank_results[0][1]]
    assert errors and all(str(case) in e for e in errors), (str(case), errors[:1])


def _outer_lr_off(rank: int, world: int, cases: list, factor: float):
    import _matrix

    real = _matrix.run_diloco

    def off(label, rank, **kw):
        import zerodp

        make = zerodp.DiLoCo

        def diloco(**options):  # the engine's outer lr off, the reference's exact
            return make(**{**options, "lr": options["lr"] * factor})
        zerodp.DiLoCo = diloco
        try:
            return real(label, rank, **kw)
        finally:
            zerodp.DiLoCo = make
    _matrix.run_diloco = off
    try:
        return run_diloco_cases(rank, world, cases)
    finally:
        _matrix.run_diloco = real


@pytest.mark.fuzz
@pytest.mark.skipif("ZERODP_MATRIX_RANDOM" not in os.environ,
                    reason="make fuzz sets ZERODP_MATRIX_RANDOM (a tenth of it as random DiLoCo cases)")
def test_matrix_diloco_random():
    """ZERODP_MATRIX_RANDOM // 10 (make fuzz: 52) random DiLoCo cases: any stage, world 2-4, H 1-5,
    F ≤ H, τ < H, outer optimizer and usage."""
    n = max(1, int(os.environ["ZERODP_MATRIX_RANDOM"]) // 10)
    seed = int(os.environ.get("ZERODP_MATRIX_SEED", "0"))
    t = time.perf_counter()
    failures, ran = _run(random_diloco_cases(n, seed), run_diloco_cases)
    print(f"matrix: {ran} random DiLoCo cases (seed {seed}) in {time.perf_counter() - t:.0f} s")
    assert not failures, f"{len(failures)} of {ran} DiLoCo cases failed:\n" + "\n".join(failures)
