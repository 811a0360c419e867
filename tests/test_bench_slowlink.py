"""The DiLoCo bench's simulated link and its crossover (``zerodp.bench.diloco``), without ranks.

* :class:`~zerodp.bench.diloco._Late` adds the link's time *after* the real collective's end (the
  simulated link in series with this machine's own): a collective whose real part takes r seconds
  and whose simulated part c lasts at least r + c — not max(r, c).
* :func:`~zerodp.bench.diloco.crossover` on step times generated from the additive model with
  this machine's link in series (hypothesis draws the parameter count, the outer work and the
  waits): the measured and the planned crossover agree on the whole link's scale,
  W_link = 2(R−1)/R·(b_h − b_d)·Ψ/g / K, and on the simulated scale through 1/W = 1/W_link − 1/W_own.
"""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zerodp
from zerodp.bench import diloco
from zerodp.plan.diloco import diloco_bytes


class _Work:
    """A collective whose real part takes ``real`` seconds from its construction."""

    def __init__(self, real: float):
        self.end = time.perf_counter() + real

    def wait(self, timeout=None):
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True

    def is_completed(self):
        return time.perf_counter() >= self.end


class _Link:
    slept = 0.0


@pytest.mark.parametrize("real, cost", [(0.04, 0.04), (0.06, 0.02), (0.0, 0.03)])
def test_the_simulated_time_follows_the_real_end(real, cost):
    began = time.perf_counter()
    late = diloco._Late(_Work(real), cost, _Link())
    late.wait()
    took = time.perf_counter() - began
    assert took >= real + cost, f"real {real} s + simulated {cost} s, but the collective took {took:.4f} s"
    assert late.is_completed()


def test_a_collective_is_not_complete_before_its_simulated_time_passed():
    late = diloco._Late(_Work(0.0), 0.05, _Link())
    assert not late.is_completed()  # real part done, simulated part not
    time.sleep(0.06)
    assert late.is_completed()


def _ranks(spec, numel, outer_s, wait_h, wait_d, compute_s):
    """Rank 0's record as :func:`diloco.run_rank` returns it, its step times from the additive model."""
    s = spec.outer.settings()
    frags = [numel]
    b = diloco_bytes(numel, spec.world_size, spec.shard_size, s, spec.stage, fragment_sizes=frags)
    sent = {"hybrid": b.hybrid_cross_bytes_per_step, "diloco": b.cross_bytes_per_step}

    def phases(name):
        out = []
        for w in (None, *spec.bandwidths):
            link = 0.0 if w is None else sent[name] / w
            step = compute_s + (wait_h if name == "hybrid" else wait_d + outer_s) + link
            out.append({"bandwidth": w, "step_s": [step] * spec.steps,
                        "outer_steps": [outer_s] * spec.steps if name == "diloco" else [],
                        "cross_wait_s": (wait_h if name == "hybrid" else wait_d) * spec.steps})
        return out

    return [{"hybrid": {"phases": phases("hybrid"), "cross_bytes": [sent["hybrid"]] * spec.steps},
             "diloco": {"phases": phases("diloco"), "cross_bytes": [sent["diloco"]] * spec.steps,
                        "fragment_numels": frags}}], sent


@settings(max_examples=25, deadline=None, derandomize=True)
@given(numel=st.integers(10_000, 5_000_000).map(lambda n: n - n % 512),
       outer_ms=st.floats(1.0, 20.0), wait_d_ms=st.floats(0.5, 10.0), own_mb=st.floats(100.0, 5_000.0))
def test_the_crossover_is_recovered_from_the_additive_model(numel, outer_ms, wait_d_ms, own_mb):
    spec = diloco.DiLoCoBenchSpec(model="tiny", world_size=4, shard_size=2, stage=3,
                                  outer=zerodp.DiLoCo(every=1, compress="int8"), steps=4, warmup=0,
                                  bandwidths=(50e6, 100e6, 200e6, 400e6, 800e6))
    outer_s, own = outer_ms / 1e3, own_mb * 1e6
    _, sent = _ranks(spec, numel, outer_s, 0.0, 0.0, 0.1)
    wait_d = wait_d_ms / 1e3
    wait_h = wait_d + (sent["hybrid"] - sent["diloco"]) / own  # this machine's link in series
    ranks, _ = _ranks(spec, numel, outer_s, wait_h, wait_d, 0.1)
    cross = diloco.crossover(spec, ranks)
    expected_link = (sent["hybrid"] - sent["diloco"]) / outer_s
    case = f"numel={numel} outer={outer_ms} ms wait_d={wait_d_ms} ms own={own_mb} MB/s"
    assert cross["own_link_bytes_per_s"] == pytest.approx(own, rel=1e-9), case
    assert cross["planned_link_bytes_per_s"] == pytest.approx(expected_link, rel=1e-6), case
    if expected_link < own:  # the simulated link can make the whole link that slow
        assert cross["measured_link_bytes_per_s"] == pytest.approx(expected_link, rel=1e-6), case
        assert cross["measured_bytes_per_s"] == pytest.approx(cross["planned_bytes_per_s"], rel=1e-6), case
    else:  # this machine's own link is already slower than the crossover: DiLoCo's step is the shorter
        assert cross["measured_bytes_per_s"] is None and cross["planned_bytes_per_s"] is None, case
    for (x, measured), (x2, planned) in zip(cross["points"], cross["planned_points"]):
        assert x == x2 and measured == pytest.approx(planned, rel=1e-6, abs=1e-12), case
