"""``zerodp bench --regimes diloco`` (``zerodp.bench.diloco``): the bytes it reports are the engine's and
the planner's, and its simulated link holds each cross-group collective for bytes / bandwidth after
its real end.

4 gloo ranks, the nano GPT at stage 1 in 2 groups of 2, DiLoCo at H = 2 with int8, one phase on
this machine's link and one at 2 MB/s — slow enough that the throttle, not this machine's own link,
sets the time of every cross-group collective. Timings are not asserted (a loaded CI machine); the
throttle's own accounting is: each of hybrid ZeRO's replica AllReduces is held until ``bytes / W``
after its real end — it lasts at least that long from issue to end, and the throttle slept at most
that long (what ran between its real end and its wait hides part of it).
"""

import pytest

from _engine_common import spawn_once
import zerodp
from zerodp.bench import diloco
from zerodp.plan._common import fmt_bytes

pytestmark = pytest.mark.dist
#: the simulated link: far below loopback gloo's own speed, so that the throttle always holds a collective
SLOW = 2e6
SPEC = diloco.DiLoCoBenchSpec(model="nano", world_size=4, shard_size=2, stage=1,
                              outer=zerodp.DiLoCo(every=2, compress="int8"), steps=4, warmup=1, bandwidths=(SLOW,))


@pytest.fixture(scope="module")
def ranks():
    return spawn_once(diloco.run_rank, 4, SPEC, timeout=300)


def test_cross_group_bytes_equal_the_planner(ranks):
    for r in ranks:
        planned = diloco.predicted_bytes(SPEC, r)
        for name, run in r.items():
            mean = sum(run["cross_bytes"]) / len(run["cross_bytes"])
            assert mean == pytest.approx(planned[name], rel=1e-12), name
    d = ranks[0]["diloco"]
    assert d["outer_state_bytes"] == d["expected_outer_state_bytes"] > 0


def test_the_simulated_link_holds_the_cross_group_bytes(ranks):
    for r in ranks:
        slow = [p for p in r["hybrid"]["phases"] if p["bandwidth"] == SLOW][0]
        per_step = sum(r["hybrid"]["cross_bytes"]) / len(r["hybrid"]["cross_bytes"])
        cost = SPEC.steps * per_step / SLOW
        assert 0 < slow["throttled_s"] <= cost * (1 + 1e-6)
        assert slow["cross_s"] >= cost * (1 - 1e-6)
        assert all(p["throttled_s"] == 0 for p in r["hybrid"]["phases"] if p["bandwidth"] is None)


def test_the_table_names_every_contender(ranks):
    text = diloco.table(SPEC, ranks)
    for words in ("DDP", "hybrid stage 1", "DiLoCo over stage 1 (H = 2, int8)", f"step @ {fmt_bytes(SLOW)}/s"):
        assert words in text
