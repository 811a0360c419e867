"""Layout and master-optimizer bookkeeping, single process: sharded elementwise updates are exact."""

import pytest
import torch

from zerodp.engine.layout import FlatLayout
from zerodp.engine.master import MasterOptimizer, Target, check_elementwise


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
