"""Hybrid sharding (guide §14): bytes per leg of a step equal the planner's per-leg formula.

4 ranks as 2 shard groups × 2 replicas, fp32, one synchronizing backward per step. The engine's
own trace counts what each collective sends per rank (ring bytes, ``sent_bytes``) and on which leg
(``intra`` inside a shard group, ``inter`` across replicas); the planner's
:func:`zerodp.plan.hybrid.step_bytes_per_leg` is written independently of the engine. Stage 3
gathers each unit in forward and again in backward except the unit kept from forward into
backward (2L − 1 AllGathers, guide §9.3), so its intra leg lies between one and two gathers per
step; its inter leg and every leg of stages 1-2 are exact. (Numerical equality of hybrid runs
with the single-process reference is the differential matrix's ``mesh=hybrid`` dimension.)
"""

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

import zerodp
from zerodp.plan.hybrid import step_bytes_per_leg
from _engine_common import spawn_once
from zerodp.train.model import GPT, PRESETS

pytestmark = pytest.mark.dist
NANO = dataclasses.replace(PRESETS["nano"], bias=False)


def _legs(rank, world):
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        engine = zerodp.parallelize(GPT(NANO), lambda g: torch.optim.SGD(g, lr=0.1), stage=stage, shard_size=2,
                                    bucket_mb=0.05)
        for _ in range(2):
            x = torch.randint(0, NANO.vocab_size, (2, NANO.seq_len))
            F.cross_entropy(engine(x).flatten(0, 1), torch.roll(x, -1, 1).flatten()).backward()
            engine.step()
            engine.zero_grad()
        legs, count = {"intra": 0.0, "inter": 0.0}, 0
        for e in engine.recorder.step_events(engine.recorder.step - 1):
            if e.lane == "comm" and e.args.get("leg") in legs:
                legs[e.args["leg"]] += e.args["sent_bytes"]
                count += 1
        out[stage] = (legs, sum(d["padded_numel"] for d in engine.layout()), count)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn_once(_legs, 4, timeout=180)


@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_per_leg_equal_the_planner(results, stage):
    for r in results:
        legs, numel, count = r[stage]
        # float64 sums of ``count`` ring figures in another order: 2·count·ε apart at most
        assert legs == pytest.approx(step_bytes_per_leg(stage, numel, 4, 2), rel=2 * count * sys.float_info.epsilon)


def test_stage3_bytes_per_leg_within_the_gather_count(results):
    for r in results:
        legs, numel, count = r[3]
        one, two = (step_bytes_per_leg(3, numel, 4, 2, gathers_per_step=k) for k in (1, 2))
        assert legs["inter"] == pytest.approx(two["inter"], rel=2 * count * sys.float_info.epsilon)
        assert one["intra"] < legs["intra"] < two["intra"]
