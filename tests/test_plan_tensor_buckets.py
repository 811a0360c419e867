"""Buckets for per-tensor optimizers at ZeRO-1/2 (guide §12.3), as the planner prices them; torch-free.

A bucket of tensors that Muon or Adafactor steps closes once it holds the shard group's size times
its largest tensor and its tensors pack whole into N slices (largest first, each to the lightest
slice) with padding at most ``MAX_WHOLE_PADDING`` of its elements; AdamW's tensors beside Muon stay
in flat buckets, sharded evenly. On the presets of Llama 3 8B, Qwen2-7B (Qwen2.5-7B has the same
shape) and Mixtral 8x7B (experts as 3-D tensors) over 8 ranks this keeps each rank's slice within
1.11x of Ψ/N, a step's collectives within 2.2Ψ, the fullest rank's optimizer state within 1.1x of
the Ψ/N share (owners balance the state too: OwnerLedger.assign) and every bucket's padding
within 11%. At ZeRO-3 the units stay flat and the owner exchange brings each such tensor whole
to its owner for the step: slices within 1.2x of Ψ/N, collectives within 3.5Ψ, state within 1.1x.
The engine forms the same buckets and exchange (tests/test_plan_ownership.py measures them on
gloo ranks).
"""

from __future__ import annotations

import pytest

from zerodp.plan.models import get_model
from zerodp.plan.ownership import group_layouts, model_tensors, ownership
from zerodp.plan.units import lpt_slice, plan_buckets, whole_padding

MODELS = ("llama3-8b", "qwen2-7b", "mixtral-8x7b")
OPTIMIZERS = ("muon", "adafactor")
N = 8


@pytest.fixture(scope="module")
def tensors():
    return {(m, o): model_tensors(get_model(m), o) for m in MODELS for o in OPTIMIZERS}


@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", MODELS)
def test_slices_and_collectives_stay_near_the_even_share(tensors, model, optimizer, stage):
    o = ownership(tensors[model, optimizer], N, stage, optimizer)
    case = f"{model}, {optimizer}, ZeRO-{stage}"
    assert o.shard_numel <= 1.11 * o.params / N, case
    assert o.comm_elements_per_step <= 2.2 * o.params, case
    assert o.imbalance <= 1.1, case  # the fullest rank's optimizer state over the Ψ/N share
    assert o.padded_numel - o.params == o.padding >= 0, case


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", MODELS)
def test_stage3_keeps_flat_units_and_exchanges_whole_tensors(tensors, model, optimizer):
    """ZeRO-3: flat units (padding under N elements each), the owner exchange on top of the
    units' 3Ψ — within 3.5Ψ — and owners balanced by state to within 1.1x of the Ψ/N share."""
    o = ownership(tensors[model, optimizer], N, 3, optimizer)
    case = f"{model}, {optimizer}, ZeRO-3"
    assert o.shard_numel <= 1.2 * o.params / N and o.padding < N * o.groups, case
    assert 3 * o.params < o.comm_elements_per_step <= 3.5 * o.params, case
    assert o.imbalance <= 1.1, case
    # the exchange: each rank sends its pieces of the whole-stepped tensors twice, its own once
    assert o.comm_elements_per_step - 3 * o.padded_numel == o.max_exchange_elements == max(o.exchange_elements)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", MODELS)
def test_every_bucket_pads_at_most_eleven_percent(tensors, model, optimizer):
    ts = tensors[model, optimizer]
    layouts = group_layouts(ts, N, 1, optimizer)
    assert sum(len(g.members) for g in layouts) == len(ts)
    for g in layouts:
        assert g.padding <= 0.11 * g.numel, (model, optimizer, [ts[i].name for i in g.members][:3])
        if g.owners is not None:  # each tensor whole on one rank, the slice the largest owned set
            owned = [0] * N
            for i, r in zip(g.members, g.owners):
                owned[r] += ts[i].numel
            assert max(owned) == g.slice_numel


@pytest.mark.parametrize("model", MODELS)
def test_muon_leaves_adamws_tensors_flat(tensors, model):
    ts = tensors[model, "muon"]
    for g in group_layouts(ts, N, 2, "muon"):
        groups = {ts[i].group for i in g.members}
        assert len(groups) == 1  # a bucket never mixes param groups
        assert (g.owners is None) == (groups == {1}), model  # AdamW (group 1) flat, Muon whole
        if g.owners is None:
            assert g.slice_numel == -(-g.numel // N)  # sharded evenly


@pytest.mark.parametrize("model", MODELS)
def test_the_embeddings_moments_are_spread(tensors, model):
    """Muon + AdamW: the fullest rank's optimizer state is within 1.1x of the Ψ/N share."""
    for stage in (1, 2):
        o = ownership(tensors[model, "muon"], N, stage, "muon")
        assert o.imbalance <= 1.1, (model, stage, o.imbalance)


def test_lpt_slice_is_the_largest_of_the_greedy_slices():
    assert lpt_slice([3, 3, 5, 4, 3], 2) == 10  # 5+3 | 4+3+3: largest first, not the optimum 5+4 | 3+3+3
    assert lpt_slice([7, 7, 7, 7], 4) == 7 and whole_padding([7, 7, 7, 7], 4) == 0
    assert lpt_slice([10, 1, 1], 2) == 10 and whole_padding([10, 1, 1], 2) == pytest.approx(8 / 12)


def test_a_whole_bucket_closes_at_n_times_its_largest_and_bounded_padding():
    # 8 ranks, one param group stepped whole, 1-byte elements, caps far below the tensors
    sizes = [100] * 64 + [800] + [100] * 64
    buckets = plan_buckets(sizes, [0] * len(sizes), 1, "bucketed", 1e-9, 1e-9, whole_groups=frozenset({0}),
                           shard_size=8)
    assert [len(b) for b in buckets] == [8] * 8 + [57, 8]  # 8 x 100; 800 + 56 x 100 (8 x 800); the rest
    for b in buckets:
        assert whole_padding([sizes[i] for i in b], 8) == 0
    # the same sizes in a group stepped elementwise: one bucket per tensor at these caps
    assert len(plan_buckets(sizes, [0] * len(sizes), 1, "bucketed", 1e-9, 1e-9)) == len(sizes)


def test_a_last_bucket_too_small_for_its_largest_tensor_takes_in_the_previous_ones():
    sizes = [800] + [100] * 80  # the walk ends at the 800: 10 buckets of 8 x 100 before it
    buckets = plan_buckets(sizes, [0] * len(sizes), 1, "bucketed", 1e-9, 1e-9, whole_groups=frozenset({0}),
                           shard_size=8)
    assert [len(b) for b in buckets] == [8, 8, 8, 57]  # 800 + 7 x 8 x 100 packs into 8 slices of 800
    assert whole_padding([sizes[i] for i in buckets[-1]], 8) == 0


def test_the_memory_plan_names_a_bucket_whose_gradient_outweighs_the_shard():
    """At ZeRO-2 a bucket holds its full gradient until its ReduceScatter: Adafactor's buckets of
    8 x Llama 3 8B's 525 M-element head do (8.47 GB), Muon's of 8 MLP matrices do not."""
    from zerodp.plan.memory import memory_plan

    notes = {o: [w for w in memory_plan("llama3-8b", N, "H100", optimizer=o).warnings if "full gradient" in w]
             for o in OPTIMIZERS}
    assert notes["muon"] == [] and len(notes["adafactor"]) == 1 and "8.47 GB" in notes["adafactor"][0]
    assert ownership(model_tensors(get_model("llama3-8b"), "adafactor"), N, 2, "adafactor").largest_group_numel \
        == 4_236_804_096


def test_a_last_bucket_and_the_ones_before_it_may_cut_anew():
    """The walk ends with 800 + 8 x 100 after buckets of 8 x 100: it takes in seven of them, and
    the run cuts into 8 x 100 and 800 + 56 x 100 (each packing into 8 slices without padding)
    rather than stay one bucket of 65 tensors."""
    sizes = [100] * 8 + [800] + [100] * 120
    buckets = plan_buckets(sizes, [0] * len(sizes), 1, "bucketed", 1e-9, 1e-9, whole_groups=frozenset({0}),
                           shard_size=8)
    assert [sorted(sizes[i] for i in b) for b in buckets][-2:] == [[100] * 8, [100] * 56 + [800]]
    assert len(buckets) == 10 and sorted(i for b in buckets for i in b) == list(range(len(sizes)))
