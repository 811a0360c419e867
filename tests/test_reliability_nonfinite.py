"""Issue 9, NaN/Inf: a non-finite gradient on ONE rank makes every rank skip that step alike.

Engine level, every stage: inf is written into rank 1's own gradient only (its shard under ZeRO,
its replica under DP), so without an agreement the ranks would decide differently. Checked
against an independent reference: the same engine run that simply never took the bad step must
end bitwise where the guarded run ends. Then the loop level: the skip is counted and reported in
the metrics, and N consecutive skips stop training on every rank with a message.
"""

import json
from dataclasses import replace

import pytest
import torch

from _engine_common import gpt_batch, make_gpt, spawn_once
from _train_common import cpu_context
from zerodp.train.config import TrainConfig


pytestmark = pytest.mark.dist


def _engine(stage, skips):
    import zerodp

    model = make_gpt(bias=False)
    return zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-2), stage=stage,
                              bucket_mb=0.02, first_bucket_mb=0.005, max_nonfinite_skips=skips,
                              units=list(model.blocks) if stage == 3 else None)


def _backward(engine, step, rank, world, poison_rank=None):
    x, y = gpt_batch(step, world)
    engine(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]).backward()
    if poison_rank == rank:  # this rank's own gradient only, as zerodp.train.faults does
        engine.machine.finish_grad_sync()
        g = next(g for g in engine.machine.master_grads() if g is not None and g.numel())
        with torch.no_grad():
            g.view(-1)[0] = float("inf")


def _take(engine, step, rank, world, poison_rank=None, clip=True):
    _backward(engine, step, rank, world, poison_rank)
    if clip:
        engine.clip_grad_norm_(1.0)
    engine.step()
    engine.zero_grad()


def _snapshot(engine):
    params = {k: v.numpy() for k, v in engine.full_state_dict().items()}
    states = {(p.name, p.kind, p.start): p.tensor.clone().numpy() for p in engine.checkpoint.state_pieces()}
    return params, states


def _same(a, b):
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def _guarded_vs_reference(rank, world, stages):
    from zerodp.engine.guard import NonFiniteGradients

    out = {}
    for stage in stages:
        for clip in (True, False):  # the check must not depend on clipping having run
            guarded = _engine(stage, skips=2)
            _take(guarded, 0, rank, world, clip=clip)
            before = _snapshot(guarded)
            _take(guarded, 1, rank, world, poison_rank=1, clip=clip)
            skipped = _snapshot(guarded)
            s1 = guarded.stats().nonfinite
            _take(guarded, 2, rank, world, clip=clip)
            s2 = guarded.stats().nonfinite
            final = _snapshot(guarded)

            reference = _engine(stage, skips=None)  # never sees the bad step
            _take(reference, 0, rank, world, clip=clip)
            _take(reference, 2, rank, world, clip=clip)
            ref = _snapshot(reference)

            # two bad steps in a row with max_nonfinite_skips=2: stop, on every rank
            _take(guarded, 3, rank, world, poison_rank=1, clip=clip)
            try:
                _take(guarded, 4, rank, world, poison_rank=0, clip=clip)
                stopped = None
            except NonFiniteGradients as e:
                stopped = str(e)
            out[(stage, clip)] = dict(
                unchanged=_same(before[0], skipped[0]) and _same(before[1], skipped[1]),
                moved=not _same(skipped[0], final[0]),
                equals_reference=_same(final[0], ref[0]) and _same(final[1], ref[1]),
                params=final[0], s1=s1, s2=s2, stopped=stopped)
    return out


def test_one_rank_inf_skips_the_step_on_every_rank_for_every_stage():
    from zerodp.engine import engine_class

    stages = []
    for s in (0, 1, 2, 3):
        try:
            engine_class(s)
            stages.append(s)
        except ImportError:
            continue
    r0, r1 = spawn_once(_guarded_vs_reference, 2, stages, timeout=300)
    for key in r0:
        for res in (r0[key], r1[key]):
            assert res["unchanged"], f"stage/clip {key}: a skipped step changed parameters or optimizer state"
            assert res["moved"], f"stage/clip {key}: the step after the skip did nothing"
            assert res["equals_reference"], f"stage/clip {key}: the skip was not a clean no-op"
            assert res["s1"] == dict(skipped_steps=1, consecutive=1, last_skipped=True, last_ranks=[1],
                                     max_consecutive=2), key
            assert res["s2"]["consecutive"] == 0 and res["s2"]["skipped_steps"] == 1 and not res["s2"]["last_skipped"]
            assert res["stopped"] and "inf/NaN for 2 consecutive steps" in res["stopped"], key
            assert "last seen on rank(s) 0" in res["stopped"] and "max_nonfinite_skips=2" in res["stopped"]
        assert _same(r0[key]["params"], r1[key]["params"]), f"{key}: ranks diverged"


def test_the_guard_refuses_a_bad_limit():
    from zerodp.engine.guard import NonFiniteGuard

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"max_nonfinite_skips=.*integer >= 1"):
            NonFiniteGuard(bad)
    assert NonFiniteGuard.local_nonfinite([torch.ones(3), None]) is False
    assert NonFiniteGuard.local_nonfinite([torch.tensor([1.0, float("nan")])]) is True
    assert NonFiniteGuard.local_nonfinite([torch.tensor([-float("inf")], dtype=torch.bfloat16)]) is True
    assert NonFiniteGuard.local_nonfinite([torch.full((4,), 3e38)]) is False  # no overflow on finite values


BASE = TrainConfig(preset="nano", seq_len=32, global_batch_tokens=256, micro_batch=4, steps=5,
                   eval_every=0, eval_batches=1, ckpt_every=0, progress=False, stage=2,
                   max_skipped_steps=2, timeout_s=60)


def _loop(rank, world, root):
    """Two runs in one process group: inf on rank 1 at step 2 (skipped, training goes on), then
    inf on rank 0 at steps 1-4 with max_skipped_steps=2 (training stops at the second)."""
    import os

    from zerodp.engine.guard import NonFiniteGradients
    from zerodp.train.loop import train

    ctx = cpu_context(rank, world)
    os.environ["ZERODP_TEST_FAULT"] = "inf:1:2"
    summary = train(replace(BASE, out=f"{root}/run"), ctx)
    os.environ["ZERODP_TEST_FAULT"] = "inf:0:1-4"
    try:
        train(replace(BASE, out=f"{root}/stopped"), ctx)
        stopped = None
    except NonFiniteGradients as e:
        stopped = f"{type(e).__name__}: {e}"
    return summary, stopped


def test_the_training_loop_counts_reports_continues_and_stops_after_n_in_a_row(tmp_path):
    (r0, stop0), (_, stop1) = spawn_once(_loop, 2, str(tmp_path), timeout=240)
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in records if r["event"] == "skip"]
    assert [(r["step"], r["ranks"], r["consecutive"]) for r in skips] == [(3, [1], 1)]
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    assert sorted(steps) == [1, 2, 3, 4, 5]  # training went on after the skip
    assert [steps[s]["skipped"] for s in range(1, 6)] == [False, False, True, False, False]
    assert steps[5]["skipped_steps"] == 1
    assert r0["skipped_steps"] == 1 and all(s.nonfinite["skipped_steps"] == 1 for s in r0["stats"])
    assert r0["steps"] == 5
    # two in a row: every rank stops by itself, with the message (none is left waiting)
    for stop in (stop0, stop1):
        assert stop and stop.startswith("NonFiniteGradients: gradients held inf/NaN for 2 consecutive steps")
        assert "last seen on rank(s) 0" in stop and "lower the learning rate" in stop
    stopped = [json.loads(l) for l in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in stopped if r["event"] == "skip"] == [2]  # the 2nd raised before logging
