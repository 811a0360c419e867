"""The timeline simulator: hand-computed toy timelines, then the guide §4 bucket demo's four states."""

import pytest

import zerodp.plan as plan
from zerodp.plan import Layer, RingCost


def _toy():
    # 3 layers of 100 bytes, 1 s of backward each; n = 2, α = 0, W = 100 B/s:
    # AllReduce of V takes 2·(1/2)·V/W = V/100 s.
    return [Layer(f"l{i}", 100, 1.0, 0.5) for i in range(3)], RingCost(0.0, 100.0, 2)


def test_toy_buckets_by_hand():
    layers, cost = _toy()
    r = plan.simulate_backward(layers, cost, bucket_bytes=100)
    got = [(b.ready_s, b.start_s, b.end_s) for b in r.buckets()]
    assert got == [(1, 1, 2), (2, 2, 3), (3, 3, 4)]
    assert (r.backward_s, r.exposed_comm_s, r.forward_s, r.step_s) == (3, 1, 1.5, 5.5)
    # 150-byte buckets straddle layers: [l2 + half l1] ready at 2, [half l1 + l0] ready at 3
    r = plan.simulate_backward(layers, cost, bucket_bytes=150)
    assert [(b.nbytes, b.ready_s, b.start_s, b.end_s) for b in r.buckets()] == [
        (150, 2, 2, 3.5), (150, 3, 3.5, 5)]
    assert r.exposed_comm_s == 2
    # whole layers (DDP-like): a bucket closes at the first layer boundary past 150 bytes
    r = plan.simulate_backward(layers, cost, bucket_bytes=150, split_layers=False)
    assert [(b.nbytes, b.ready_s) for b in r.buckets()] == [(200, 2), (100, 3)]


def test_toy_latency_term_and_serialized_stream():
    layers = [Layer("a", 10, 0.0), Layer("b", 10, 0.0)]
    cost = RingCost(alpha=0.25, bandwidth=10.0, n=2)  # AllReduce: 2·α + V/W
    r = plan.simulate_backward(layers, cost, bucket_bytes=5)  # 4 buckets, all ready at t = 0
    assert r.num_buckets == 4
    assert r.latency_s == pytest.approx(4 * 0.5) and r.bandwidth_s == pytest.approx(2.0)
    assert [b.end_s for b in r.buckets()] == pytest.approx([1, 2, 3, 4])
    assert r.exposed_comm_s == pytest.approx(4)


def test_fsdp_toy_by_hand():
    # 2 units of 100 bytes, forward 1 s, backward 2 s; AllGather/ReduceScatter 1 s each (n=2, W=50)
    units = [Layer("u0", 100, 2.0, 1.0), Layer("u1", 100, 2.0, 1.0)]
    cost = RingCost(0.0, 50.0, 2)
    f = plan.simulate_fsdp(units, cost)
    assert [(op.kind, op.unit, op.start_s, op.end_s) for op in f.comm] == [
        ("all_gather", "u0", 0, 1), ("all_gather", "u1", 1, 2),       # forward, u1 prefetched
        ("all_gather", "u0", 3, 4),                                    # backward prefetch (u1 kept)
        ("reduce_scatter", "u1", 5, 6), ("reduce_scatter", "u0", 7, 8)]
    assert (f.step_s, f.compute_s, f.exposed_comm_s) == (8, 6, 2)
    assert (f.num_allgathers, f.num_reduce_scatters) == (3, 2)  # 2L − 1 AllGathers
    g = plan.simulate_fsdp(units, cost, prefetch=False)
    assert g.step_s == 11  # gathers wait for the previous unit; backward's waits behind RS(u1)


def test_fsdp_counts_on_a_real_shape():
    layers = plan.model_layers("llama3-8b", "H100", 4096)
    f = plan.simulate_fsdp(layers, plan.network_cost("H100", 8))
    assert f.num_allgathers == 2 * len(layers) - 1
    assert f.exposed_comm_s < 0.1 * f.compute_s  # prefetch hides it at 4096 tokens/GPU (guide §10.2)


# --- the guide §4 demo: 8B model, 8xH100, α′ = 16 µs, NVLink 450 GB/s -------------------------------
@pytest.fixture(scope="module")
def demo():
    hw = plan.get_hardware("H100")
    assert hw.small_message_latency == pytest.approx(16e-6) and hw.intra_bw == 450e9
    return plan.network_cost(hw, 8), plan.model_layers("llama3-8b", hw, 4096)


def test_tiny_buckets_latency_dominates(demo):
    cost, layers = demo
    r = plan.simulate_backward(layers, cost, 50e3)
    assert r.num_buckets > 1000
    assert r.comm_s > 10 * r.bandwidth_s
    assert r.exposed_comm_s > r.backward_s


def test_huge_buckets_last_fully_exposed(demo):
    cost, layers = demo
    for size in (10e9, 16e9, 20e9):
        r = plan.simulate_backward(layers, cost, size)
        assert r.num_buckets in (1, 2)
        last = r.last_bucket
        assert last.ready_s == pytest.approx(r.backward_s)  # fills only when backward ends
        assert r.exposed_comm_s >= (last.end_s - last.start_s) * (1 - 1e-9)


def test_sweet_spot_small_tail(demo):
    cost, layers = demo
    sweep = plan.sweep_buckets(layers, cost)
    good = [p for p in sweep.points if p.exposed_fraction < 0.1]
    assert len(good) >= 5  # a wide range of sizes
    assert 1e6 < sweep.best_bucket_bytes < 2e9
    r = plan.simulate_backward(layers, cost, 25e6)
    assert r.exposed_comm_s < 0.1 * r.backward_s


def test_few_tokens_exposed_at_every_size():
    cost = plan.network_cost("H100", 8)
    layers = plan.model_layers("llama3-8b", "H100", 256)
    sweep = plan.sweep_buckets(layers, cost)
    bandwidth = cost.time("all_reduce", sum(l.param_bytes for l in layers))
    for p in sweep.points:
        assert p.exposed_comm_s > bandwidth - sweep.backward_s
        assert p.exposed_comm_s > 5 * sweep.backward_s


def test_sweep_json_and_runs():
    layers, cost = _toy()
    d = plan.sweep_buckets(layers, cost, sizes=[50, 100, 300]).to_dict()
    assert [p["num_buckets"] for p in d["points"]] == [6, 3, 1]
    t = plan.simulate_backward(layers, cost, 50).to_dict()
    assert len(t["buckets"]) == 6 and t["buckets_truncated"] is False
    assert sum(run["count"] for run in t["runs"]) == 6
