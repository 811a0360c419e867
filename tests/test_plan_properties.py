"""Properties of the planner over generated inputs (hypothesis).

``make test`` runs the "ci" profile (seeded, 25 examples each); ``make fuzz`` the "fuzz" profile
(2,000 each). Each property is a law of the cost models, not a figure copied from them:
ZeRO-3 memory never grows with N; the stages are ordered 0 ≥ 1 ≥ 2 ≥ 3; a collective takes at
least its latency term; the MoE threshold is the dense one times E/k; every figure is finite;
a shape's parameter count grows with every dimension.
"""

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zerodp import plan
from zerodp.plan.memory import PRECISIONS

pytestmark = pytest.mark.fuzz

HARDWARE = plan.hardware_names()
SHAPED = [n for n in plan.model_names() if plan.get_model(n).layers]

params = st.floats(min_value=1e3, max_value=1e15, allow_nan=False, allow_infinity=False)
gpus = st.integers(min_value=1, max_value=1_000_000)
precision = st.sampled_from(list(PRECISIONS))
k_bytes = st.one_of(st.none(), st.floats(min_value=0, max_value=64, allow_nan=False))


def _numbers(obj):
    """Every number in a to_dict() tree."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


@given(psi=params, n1=gpus, n2=gpus, prec=precision, k=k_bytes, acc=st.booleans(),
       hw=st.sampled_from(HARDWARE))
def test_zero3_memory_never_grows_with_n(psi, n1, n2, prec, k, acc, hw):
    assume(not (acc and prec == "fp32"))
    lo, hi = sorted((n1, n2))
    model = plan.custom_model(params=psi)
    a = plan.memory_plan(model, lo, hw, prec, k, acc).stages[3]
    b = plan.memory_plan(model, hi, hw, prec, k, acc).stages[3]
    assert b["total_bytes"] <= a["total_bytes"] * (1 + 1e-12)
    assert b["model_state_bytes"] <= a["model_state_bytes"] * (1 + 1e-12)


@given(name=st.sampled_from(plan.model_names()), n=gpus, prec=precision, k=k_bytes,
       acc=st.booleans(), seq=st.one_of(st.none(), st.integers(1, 1_000_000)),
       mbs=st.integers(1, 64), recompute=st.sampled_from(["none", "selective", "full"]))
def test_stages_are_ordered_and_every_figure_is_finite(name, n, prec, k, acc, seq, mbs, recompute):
    assume(not (acc and prec == "fp32"))
    m = plan.get_model(name)
    if seq is None:
        mbs, recompute = 1, "none"
    elif not m.heads:
        seq = None
        mbs, recompute = 1, "none"
    mp = plan.memory_plan(m, n, "H100", prec, k, acc, seq, mbs, recompute)
    states = [s["model_state_bytes"] for s in mp.stages]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(states, states[1:])), states
    d = mp.to_dict()
    assert all(math.isfinite(x) for x in _numbers(d))
    for s in mp.stages:  # the total is what fits compares, and it adds up
        parts = (s["param_bytes"] + s["grad_bytes"] + s["optimizer_bytes"] + s["grad_acc_bytes"]
                 + s["gathered_unit_bytes"] + s["activation_bytes"])
        assert s["total_bytes"] == pytest.approx(parts, rel=1e-12)
        # the documented rule: fits at most 90% of HBM (10% headroom), tight up to HBM, else no
        want = "fits" if s["total_bytes"] <= 0.9 * mp.hbm_bytes else (
            "tight" if s["total_bytes"] <= mp.hbm_bytes else "no")
        assert (s["verdict"], s["fits"]) == (want, want == "fits")


@given(kind=st.sampled_from(list(plan.KINDS)), nbytes=st.floats(0, 1e15, allow_nan=False),
       n=st.integers(1, 1_000_000), hw=st.sampled_from(HARDWARE))
def test_a_collective_takes_at_least_its_latency_term(kind, nbytes, n, hw):
    hardware = plan.get_hardware(hw)
    try:
        r = plan.collective_time(kind, nbytes, n, hardware)
    except ValueError as exc:  # n beyond what this hardware's network can join: said so
        assert "network" in str(exc) or "devices" in str(exc), exc
        return
    assert math.isfinite(r.time_s) and r.time_s >= r.latency_s >= 0
    assert r.time_s >= r.bandwidth_s >= 0


@given(alpha=st.floats(0, 1e-2), bw=st.floats(1e3, 1e15), n=st.integers(1, 100_000),
       kind=st.sampled_from(list(plan.KINDS)), nbytes=st.floats(0, 1e15))
def test_a_flat_ring_takes_at_least_its_latency_term(alpha, bw, n, kind, nbytes):
    cost = plan.RingCost(alpha, bw, n)
    r = cost.collective(kind, nbytes)
    assert r.time_s >= r.latency_s * (1 - 1e-12) and math.isfinite(r.time_s)
    assert cost.time(kind, nbytes) >= cost.time(kind, 0.0)


@given(hw=st.sampled_from(HARDWARE), experts=st.integers(1, 4096), data=st.data(),
       at_scale=st.booleans())
def test_the_moe_threshold_is_the_dense_one_times_e_over_k(hw, experts, data, at_scale):
    k = data.draw(st.integers(1, experts))
    hardware = plan.get_hardware(hw)
    n = None if at_scale else data.draw(st.integers(1, hardware.devices_per_node))
    dense = plan.threshold(hardware, n)
    moe = plan.threshold(hardware, n, experts=experts, experts_per_token=k)
    assert moe.threshold_tokens == pytest.approx(dense.threshold_tokens * experts / k, rel=1e-12)
    assert math.isfinite(moe.threshold_tokens) and moe.threshold_tokens >= 0


@given(layers=st.integers(1, 200), hidden=st.integers(1, 512).map(lambda x: 64 * x),
       heads=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), kv_div=st.sampled_from([1, 2, 4, 8]),
       ffn_mult=st.floats(1, 8), vocab=st.integers(1, 300_000), experts=st.integers(1, 64),
       data=st.data(), grow=st.sampled_from(["layers", "hidden", "ffn", "vocab", "experts"]))
def test_a_shapes_count_grows_with_every_dimension(layers, hidden, heads, kv_div, ffn_mult, vocab,
                                                   experts, data, grow):
    k = data.draw(st.integers(1, experts))
    shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=max(1, heads // kv_div),
                 ffn=max(1, int(hidden * ffn_mult)), vocab=vocab, experts=experts,
                 experts_per_token=k)
    m = plan.custom_model(**shape)
    bigger = dict(shape)
    bigger[grow] = shape[grow] + (64 if grow == "hidden" else 1)
    assert plan.custom_model(**bigger).params > m.params
    assert m.active <= m.params and all(math.isfinite(x) for x in _numbers(m.to_dict()))
    # a config.json of the same shape counts the same
    cfg = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": shape["kv_heads"],
           "intermediate_size": shape["ffn"], "vocab_size": vocab,
           "num_local_experts": experts, "num_experts_per_tok": k}
    if hidden % heads:
        cfg["head_dim"] = hidden // heads
    assert plan.model_from_config(cfg).params == m.params


@given(name=st.sampled_from(SHAPED), bucket=st.floats(1e3, 1e13), tokens=st.floats(1, 1e6),
       n=st.integers(2, 64))
def test_a_simulation_is_finite_or_refused_in_one_sentence(name, bucket, tokens, n):
    layers = plan.model_layers(name, "H100", tokens)
    cost = plan.network_cost(plan.get_hardware("H100"), n)
    try:
        run = plan.simulate_backward(layers, cost, bucket)
    except ValueError as exc:
        assert "buckets" in str(exc) and "\n" not in str(exc)
        return
    assert run.num_buckets <= plan.timeline.MAX_BUCKETS
    assert run.exposed_comm_s >= 0 and run.comm_s >= run.latency_s * (1 - 1e-9)
    assert all(math.isfinite(x) for x in _numbers(run.to_dict()))
