"""Layout and master-optimizer bookkeeping, single process: sharded elementwise updates are exact."""

import pytest
import torch

from zerodp.engine.layout import FlatLayout
from zerodp.engine.master import MasterOptimizer, Target, whole_targets
from zerodp.engine.optimizer_plan import (ELEMENTWISE_OPTIMIZERS, PER_TENSOR_OPTIMIZERS, check_elementwise,
                                          choose_layout, probe_factory)
from zerodp.plan.units import OwnerLedger


def _params():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g), "c": torch.randn(2, 2, generator=g)}


def test_layout_pads_to_world_and_spans_cover_every_element_once():
    layout = FlatLayout.pack([(n, t.shape) for n, t in _params().items()], world_size=4)
    assert layout.numel == 15 + 7 + 4 and layout.padded_numel == 28 and layout.shard_numel == 7
    seen = {}
    for r in range(4):
        for s in layout.spans(*layout.shard_range(r)):
            seen.setdefault(s.slot.name, []).append((s.param_start, s.param_stop))
    for name, t in _params().items():
        runs = sorted(seen[name])
        assert runs[0][0] == 0 and runs[-1][1] == t.numel()
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_sharded_adamw_equals_per_parameter_adamw(world):
    params = _params()
    grads = {n: torch.randn_like(t) for n, t in params.items()}
    # Reference: stock AdamW per parameter tensor.
    ref = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    opt = torch.optim.AdamW(ref.values(), lr=0.1, weight_decay=0.1)
    for _ in range(3):
        for n, p in ref.items():
            p.grad = grads[n].clone()
        opt.step()
    # Sharded: flat buffer split into `world` shards, one optimizer per shard, as ZeRO ranks would.
    layout = FlatLayout.pack([(n, t.shape) for n, t in params.items()], world_size=world)
    flat = torch.zeros(layout.padded_numel)
    flat_grad = torch.zeros(layout.padded_numel)
    for s in layout.slots:
        flat[s.offset:s.stop] = params[s.name].flatten()
        flat_grad[s.offset:s.stop] = grads[s.name].flatten()
    out = torch.zeros_like(flat)
    for r in range(world):
        lo, hi = layout.shard_range(r)
        t = Target(flat[lo:hi].clone(), layout, lo, 0)
        m = MasterOptimizer(lambda g: torch.optim.AdamW(g, lr=0.1, weight_decay=0.1), [t], [{}])
        for _ in range(3):
            t.tensor.grad = flat_grad[lo:hi].clone()
            m.step()
        out[lo:hi] = t.tensor
        kinds = {p.kind for p in m.pieces()}
        assert kinds == {"param", "exp_avg", "exp_avg_sq"}
        for p in m.pieces():
            if p.kind == "exp_avg":
                want = opt.state[ref[p.name]]["exp_avg"].flatten()[p.start:p.stop]
                assert torch.equal(p.tensor, want)
    for s in layout.slots:
        assert torch.equal(out[s.offset:s.stop].view(s.shape), ref[s.name].detach())


def test_state_round_trips_through_pieces_and_scalars():
    layout = FlatLayout.pack([("w", (10,))], world_size=1)
    t = Target(torch.randn(10), layout, 0, 0)
    m = MasterOptimizer(lambda g: torch.optim.Adam(g, lr=0.01), [t], [{}])
    t.tensor.grad = torch.randn(10)
    m.step()
    saved = {(p.name, p.kind): p.tensor.clone() for p in m.pieces()}
    scalars = m.scalar_state()
    assert scalars["groups"][0]["step"] == 1.0
    t2 = Target(torch.zeros(10), layout, 0, 0)
    m2 = MasterOptimizer(lambda g: torch.optim.Adam(g, lr=0.01), [t2], [{}])
    m2.load_scalar_state(scalars)
    m2.load_pieces(lambda name, kind, a, b: saved[(name, kind)][a:b])
    g = torch.randn(10)
    t.tensor.grad, t2.tensor.grad = g.clone(), g.clone()
    m.step()
    m2.step()
    assert torch.equal(t.tensor, t2.tensor)


def test_non_elementwise_optimizer_is_refused_with_reason():
    p = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="not known to be elementwise"):
        check_elementwise(torch.optim.LBFGS([p]))


class _LARS(torch.optim.SGD):
    """A subclass of an elementwise class: not trusted as elementwise unless declared."""


class _AdafactorPlus(torch.optim.Adafactor):
    """A subclass of a per-tensor class: not trusted as per-tensor unless declared."""


def _opt(cls, **kw):
    return cls([torch.zeros(4, 4, requires_grad=True)], **kw)


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS)
def test_every_elementwise_class_takes_the_flat_path(cls):
    assert choose_layout(_opt(cls, lr=0.1) if cls is torch.optim.SGD else _opt(cls)) == "flat"
    assert choose_layout(_opt(cls, lr=0.1) if cls is torch.optim.SGD else _opt(cls), requested="owner") == "owner"


@pytest.mark.parametrize("cls", PER_TENSOR_OPTIMIZERS)
def test_every_per_tensor_class_takes_the_owner_path_and_is_refused_flat(cls):
    assert choose_layout(_opt(cls)) == "owner"
    with pytest.raises(ValueError, match="optimizer_layout='owner'"):
        choose_layout(_opt(cls), requested="flat")


@pytest.mark.parametrize("cls", [_LARS, _AdafactorPlus])
def test_subclasses_are_refused_until_declared(cls):
    opt = _opt(cls, lr=0.1) if cls is _LARS else _opt(cls)
    with pytest.raises(ValueError, match="elementwise_optimizer=True.*optimizer_layout='owner'"):
        choose_layout(opt)
    assert choose_layout(opt, requested="owner") == "owner"
    assert choose_layout(opt, declared_elementwise=True) == "flat"


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam"])
def test_lbfgs_and_sparse_adam_are_refused_at_every_layout_in_one_line(name):
    cls = getattr(torch.optim, name)
    for requested in ("auto", "flat", "owner"):
        with pytest.raises(ValueError, match=f"^{name} is refused: [^\n]*$"):
            choose_layout(_opt(cls), requested=requested)

    class Sub(cls):
        pass
    with pytest.raises(ValueError, match=f"Sub subclasses {name} is refused"):
        choose_layout(_opt(Sub), requested="owner")


def test_muon_refusing_a_vector_names_the_parameter():
    params = [("w", (4, 3), 0), ("b", (4,), 0)]
    with pytest.raises(ValueError, match="parameter 'b' of shape \\(4,\\).*2D"):
        probe_factory(lambda g: torch.optim.Muon(g), [{}], params, torch.device("cpu"))
    assert isinstance(probe_factory(lambda g: torch.optim.Muon(g), [{}], params[:1], torch.device("cpu")),
                      torch.optim.Muon)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_owner_layout_puts_every_tensor_whole_in_its_owners_slice(world):
    shapes = [("a", (3, 5)), ("b", (7,)), ("c", (2, 2)), ("d", (6, 6)), ("e", ()), ("f", (1, 9))]
    ledger = OwnerLedger(world)
    layout = FlatLayout.owned(shapes, world, ledger)
    loads = ledger.owned()
    assert layout.aligned and layout.padded_numel == world * layout.shard_numel
    assert sum(loads) == layout.numel == 15 + 7 + 4 + 36 + 1 + 9
    for slot, r in zip(layout.slots, layout.owners):
        lo, hi = layout.shard_range(r)
        assert lo <= slot.offset <= slot.stop <= hi and layout.owners_of(slot) == [r]
    # padding ranges and slots tile the buffer exactly
    cover = sorted([(s.offset, s.stop) for s in layout.slots if s.numel] + layout.padding_ranges())
    assert cover[0][0] == 0 and cover[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(cover, cover[1:]))
    assert sum(b - a for a, b in layout.padding_ranges()) == layout.padding
    # greedy largest-first: the largest slice is at most the mean plus the largest tensor
    assert layout.shard_numel <= layout.numel / world + 36
    cost = layout.cost(2)
    assert cost["padding_bytes"] == 2 * layout.padding and cost["owned_numel"] == loads


def test_owner_layout_balances_across_groups():
    ledger = OwnerLedger(2)
    first = FlatLayout.owned([("a", (10,))], 2, ledger)
    second = FlatLayout.owned([("b", (10,))], 2, ledger)
    assert first.owners == (0,) and second.owners == (1,) and ledger.owned() == [10, 10]


def test_owner_layout_balances_the_optimizer_state_within_the_slice():
    """Equal sizes, unequal state (a vector's Adafactor state is its size, a matrix's its rows
    and columns): largest first alone gives both vectors to rank 0; balancing the state gives
    each rank a vector and a matrix, in the same slices."""
    shapes = [("v1", (16,)), ("m1", (4, 4)), ("v2", (16,)), ("m2", (4, 4))]
    costs = [16, 8, 16, 8]
    assert OwnerLedger(2).assign([16] * 4) == [0, 1, 0, 1]
    ledger = OwnerLedger(2)
    layout = FlatLayout.owned(shapes, 2, ledger, costs)
    assert layout.owners == (0, 1, 1, 0) and layout.padding == 0 and ledger.cost == {0: 24, 1: 24}


def test_whole_targets_have_the_parameters_shapes_and_step_like_the_whole_tensor():
    params = _params()
    layout = FlatLayout.owned([(n, t.shape) for n, t in params.items()], 2)
    flat = torch.zeros(layout.padded_numel)
    for slot in layout.slots:
        flat[slot.offset:slot.stop] = params[slot.name].reshape(-1)
    grads = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) for n, t in params.items()}
    for r in range(2):
        lo, hi = layout.shard_range(r)
        targets = whole_targets(flat[lo:hi], layout, lo, lambda name: 0)
        assert {t.name for t in targets} == {s.name for s, o in zip(layout.slots, layout.owners) if o == r}
        m = MasterOptimizer(lambda g: torch.optim.Adafactor(g, lr=0.1), targets, [{}], placement="owner")
        m.attach_grads([grads[t.name].reshape(-1) for t in targets])
        m.step()
        for t in targets:
            assert t.tensor.shape == params[t.name].shape
            ref = params[t.name].clone().requires_grad_(True)
            ref.grad = grads[t.name].clone()
            torch.optim.Adafactor([ref], lr=0.1).step()
            assert torch.equal(t.tensor, ref.detach())
            assert torch.equal(flat[t.flat_start:t.flat_start + t.tensor.numel()], ref.detach().reshape(-1))
