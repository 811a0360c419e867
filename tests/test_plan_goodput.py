"""The planner's goodput under failures (zerodp.plan.goodput, docs/reliability.md "Goodput under
failures"): each closed form against a seeded Monte-Carlo simulation of the same failure process
written out here, and against the first-order hand formulas it must reduce to."""

import json
import math
import random

import pytest

from zerodp.cli import main
from zerodp.plan.goodput import (HOUR, LLAMA3_NODE_MTBF_H, best_interval, daly_interval,
                                 failure_domains, goodput_plan, heal_goodput, restart_goodput,
                                 young_interval)


def _simulate_restart(tau, ckpt, restart, mtbf, segments, rng):
    """Wall time to finish ``segments`` segments of τ compute + C checkpoint when failures arrive
    at rate 1/M at any moment (computing, writing, restarting); a failure loses the segment in
    flight and costs a restart of R, which a failure may itself interrupt."""
    t = 0.0
    for _ in range(segments):
        while True:
            x = rng.expovariate(1 / mtbf)
            if x >= tau + ckpt:
                t += tau + ckpt
                break
            t += x
            while True:  # the restart, itself interruptible
                y = rng.expovariate(1 / mtbf)
                if y >= restart:
                    t += restart
                    break
                t += y
    return segments * tau / t


def _simulate_heal(domains, rate, down, step, quorum, horizon, rng):
    """Committed work / fault-free over ``horizon`` seconds: each domain up for Exp(rate), then
    down for ``down``; the live domains progress at 1/d each, except during a stall (step +
    quorum after a failure, quorum after a rejoin) when nothing is committed."""
    events = []  # (time, change of live domains, change of stalls in force)
    for _ in range(domains):
        t = 0.0
        while t < horizon:
            t += rng.expovariate(rate)
            if t >= horizon:
                break
            events += [(t, -1, +1), (t + step + quorum, 0, -1)]
            t += down
            if t < horizon:
                events += [(t, +1, +1), (t + quorum, 0, -1)]
    events.sort()
    live, stalls, last, work = domains, 0, 0.0, 0.0
    for t, dl, ds in events:
        t = min(t, horizon)
        if stalls == 0:
            work += live * (t - last) / domains
        last, live, stalls = t, live + dl, stalls + ds
    if stalls == 0:
        work += live * (horizon - last) / domains
    return work / horizon


def test_restart_goodput_hand_numbers():
    """M = 10,000 s, C = 60 s, R = 600 s, τ = 1,000 s: 1000 / (1e4·e^0.06·(e^0.106 − 1))."""
    expected = 1000 / (1e4 * math.exp(0.06) * (math.exp(0.106) - 1))
    assert restart_goodput(1000, 60, 600, 1e4) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.84220, abs=1e-5)  # 1000 / 1187.36
    # no failures: only the checkpoint writes cost
    assert restart_goodput(1000, 60, 600, math.inf) == pytest.approx(1000 / 1060)


@pytest.mark.parametrize("mtbf,tau,ckpt,restart", [(3 * HOUR, 1200, 60, 600),
                                                  (2000, 600, 30, 300), (1e4, 3000, 200, 100)])
def test_restart_goodput_matches_a_simulation(mtbf, tau, ckpt, restart):
    sim = _simulate_restart(tau, ckpt, restart, mtbf, 60_000, random.Random(0))
    assert restart_goodput(tau, ckpt, restart, mtbf) == pytest.approx(sim, abs=3e-3)


def test_first_order_waste_young():
    """For C, R, τ ≪ M the goodput is 1 − C/τ − (τ/2 + R)/M to first order, Young's √(2CM)
    minimises that, and it lies within a fraction of a percent of the exact optimum; Daly's
    higher-order estimate is closer still."""
    m, c, r = 200 * HOUR, 30.0, 120.0
    tau = young_interval(c, m)
    assert tau == pytest.approx(math.sqrt(2 * 30 * 200 * 3600))
    first = 1 - c / tau - (tau / 2 + r) / m
    assert restart_goodput(tau, c, r, m) == pytest.approx(first, abs=2e-4)
    best = best_interval(c, m)
    assert abs(best - tau) / tau < 0.01
    assert abs(daly_interval(c, m) - best) < abs(tau - best)


@pytest.mark.parametrize("mtbf,ckpt", [(3 * HOUR, 60), (1000, 200), (50 * HOUR, 5)])
def test_best_interval_is_the_maximum(mtbf, ckpt):
    best = best_interval(ckpt, mtbf)
    g = restart_goodput(best, ckpt, 600, mtbf)
    for f in (0.5, 0.9, 0.99, 1.01, 1.1, 2):
        assert restart_goodput(best * f, ckpt, 600, mtbf) <= g
    # the stationarity condition M·(1 − e^{−(τ+C)/M}) = τ
    assert mtbf * -math.expm1(-(best + ckpt) / mtbf) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("domains,rate,down,step,quorum", [
    (4, 1 / (10 * HOUR), 1800, 20, 20), (2, 1 / (3 * HOUR), 900, 60, 30),
    (16, 1 / (40 * HOUR), 3600, 5, 10)])
def test_heal_goodput_matches_a_simulation(domains, rate, down, step, quorum):
    rng = random.Random(1)
    h = heal_goodput(domains, rate, down, step, quorum, ckpt_s=60, restart_s=600)
    horizon = 20_000 / (domains * rate)  # about 20,000 failures
    sim = _simulate_heal(domains, rate, down, step, quorum, horizon, rng)
    # the simulation lets the last copies die too (all domains down: nothing committed); the
    # model prices that rare case by G_loss separately
    assert h.goodput / h.loss_goodput == pytest.approx(sim, abs=1e-3)
    assert h.live_fraction == pytest.approx(1 / (1 + rate * down))


def test_heal_goodput_hand_numbers():
    """d = 2, λ_d = 1e-4/s, D = 1,000 s: A = 1/1.1, ν = 2e-4/1.1, stall loss
    ν·[(t+q)·A + q·(1+A)]/2 with t = q = 10 s."""
    h = heal_goodput(2, 1e-4, 1000, 10, 10, ckpt_s=60, restart_s=600)
    a = 1 / 1.1
    nu = 2e-4 * a
    stall = nu * (20 * a + 10 * (1 + a)) / 2
    assert h.live_fraction == pytest.approx(a)
    assert h.stall_loss == pytest.approx(stall)
    loss = 2 * 1e-4 * a * (1 - a)
    assert h.loss_rate == pytest.approx(loss)
    assert h.loss_goodput == pytest.approx(restart_goodput(best_interval(60, 1 / loss), 60, 600,
                                                           1 / loss))
    assert h.goodput == pytest.approx((a - stall) * h.loss_goodput)


def test_failure_domains():
    assert failure_domains(16, 8, 64).to_dict() == dict(count=2, nodes_each=8, groups_each=1,
                                                        what="a replica group of 8 nodes")
    assert failure_domains(4, 8, 2).count == 4 and failure_domains(4, 8, 2).groups_each == 4
    with pytest.raises(ValueError, match="two replica groups"):
        failure_domains(8, 8, 64)
    with pytest.raises(ValueError, match="multiple or a divisor"):
        failure_domains(12, 8, 12)
    with pytest.raises(ValueError, match="does not divide"):
        failure_domains(3, 8, 16)


def test_heal_beats_restart_and_the_gap_grows_with_the_cluster():
    kw = dict(gpus_per_node=8, shard_size=8, mtbf_node_s=LLAMA3_NODE_MTBF_H * HOUR,
              state_bytes=20e9, transfer_bw=25e9)
    plans = [goodput_plan(n, **kw) for n in (16, 256, 2048)]
    gains = [p.gain for p in plans]
    assert all(g > 0 for g in gains) and gains == sorted(gains)
    big = plans[-1]
    assert big.job_mtbf_s == pytest.approx(LLAMA3_NODE_MTBF_H * HOUR / 2048)
    assert big.interval_s == big.young_interval_s
    assert big.transfer_s == pytest.approx(0.8)
    assert big.heal.down_s == pytest.approx(600.8)
    assert big.restart_best_goodput >= big.restart_goodput


def test_cli_table_and_json(capsys):
    argv = ["plan", "goodput", "--nodes", "16,2048", "--model", "llama3-70b", "--shard-size", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "job MTBF" in out and "2,048" in out and "16,384" in out
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [p["nodes"] for p in d["plans"]] == [16, 2048]
    big = d["plans"][1]
    assert big["replicas"] == 256 and big["domains"]["nodes_each"] == 8
    assert 0 < big["restart_goodput"] < big["heal"]["goodput"] <= 1
    assert big["gpu_hours_saved_per_day"] == pytest.approx(big["gain"] * 16384 * 24)


def test_cli_refuses_one_group(capsys):
    assert main(["plan", "goodput", "--nodes", "8", "--shard-size", "64"]) != 0
    assert "two replica groups" in capsys.readouterr().err
