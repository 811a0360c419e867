"""Graceful preemption: SIGTERM (or a first Ctrl-C) stops every rank after the step in flight with
a checkpoint of it, within --grace-s, with the documented exit status; --resume then ends bitwise
where an uninterrupted run ends. Under our launcher and under torchrun. A second Ctrl-C aborts at
once, and a stop that cannot finish within the grace period ends without touching the newest
complete checkpoint.

The runs go through the real ``zerodp train`` (and ``torchrun``) in sessions of their own; runs
that do not depend on each other are started side by side. The step at which the signal is sent
is drawn from a fixed seed.
"""

import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from zerodp.train import checkpoint as ckpt
from zerodp.train.chaos import RUN, Launch, compare, env_with
from _straight import CKPT_EVERY, STEPS as N_STEPS, straight as shared_straight
from _engine_common import in_make_fuzz

pytestmark = pytest.mark.dist

STEPS = ["--steps", str(N_STEPS), "--ckpt-every", str(CKPT_EVERY)]
STARTUP_S = 120  # starting Python, torch and two ranks on a loaded 2-core machine
GRACE_S = 30.0  # the default --grace-s
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
            "-m", "zerodp.cli", "train"]


def _launch(out, *extra, fault=None, torchrun=False):
    args = RUN[:-2] if torchrun else RUN  # torchrun would read --nproc as its own --nproc-per-node
    assert RUN[-2] == "--nproc"
    return Launch([*args, *STEPS, "--out", str(out), *extra], env_with(fault), [],
                  command=TORCHRUN if torchrun else None)


def _steps_done(out) -> int:
    try:
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    done = 0
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("event") == "step":
            done = r["step"]
    return done


def _when_at(runs: dict, limit_s: float = 2 * STARTUP_S) -> None:
    """``runs``: {out: (launch, step, action)}; call ``action(launch)`` once ``out`` reached ``step``."""
    pending = dict(runs)
    t_end = time.monotonic() + limit_s
    while pending and time.monotonic() < t_end:
        for out, (launch, step, action) in list(pending.items()):
            if _steps_done(out) >= step:
                action(launch)
                del pending[out]
            elif launch.proc.poll() is not None:
                pytest.fail(f"{out} ended (status {launch.proc.returncode}) before step {step}:\n"
                            + _text(launch)[-3000:])
        time.sleep(0.005)
    assert not pending, f"these runs never reached their step: {list(pending)}"


def _text(launch) -> str:
    return "\n".join(ln.text for ln in launch.lines)


def _signal(sig, group=False):
    def send(launch):
        launch.sent = time.monotonic()
        (os.killpg if group else os.kill)(launch.proc.pid, sig)
    return send


def _wait(launch, limit_s):
    rc = launch.wait(limit_s)
    assert rc is not None, f"no exit within {limit_s} s (a hang):\n{_text(launch)[-3000:]}"
    return rc, launch.ended - launch.sent


def _last_record(out) -> dict:
    return json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])


def _stopped(launch, out, rc: int, want_rc: int, took: float, at: int, signal: str | None = None) -> dict:
    """``launch`` (writing ``out``) exited with ``want_rc`` within the grace period of its signal,
    its last record a stop at step ``at`` or later (on ``signal``, where given) with a checkpoint
    of that step: the record."""
    assert rc == want_rc, _text(launch)[-3000:]
    assert took < GRACE_S
    stop = _last_record(out)
    assert stop["event"] == "stop" and stop["step"] >= at and (signal is None or stop["signal"] == signal)
    assert ckpt.Checkpoint.open(ckpt.find(out)).step == stop["step"]
    return stop


def _digest(path: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture
def straight(tmp_path_factory):
    """The uninterrupted run every resumed run must end bitwise equal to (tests/_straight.py)."""
    return shared_straight(tmp_path_factory)


@in_make_fuzz("Ctrl-C stops with a checkpoint and a second one aborts (the next test)")
def test_sigterm_stops_with_a_checkpoint_within_the_grace_period_and_resume_is_bitwise(tmp_path, straight):
    rng = random.Random(18)
    at_l, at_t = rng.randint(8, 30), rng.randint(8, 30)  # well before the last step (60)
    ours, tr = tmp_path / "launcher", tmp_path / "torchrun"
    a = _launch(ours)
    b = _launch(tr, torchrun=True)
    _when_at({ours: (a, at_l, _signal(signal.SIGTERM)), tr: (b, at_t, _signal(signal.SIGTERM))})
    rc_a, took_a = _wait(a, 3 * GRACE_S)
    rc_b, took_b = _wait(b, 3 * GRACE_S)
    print(f"SIGTERM at step {at_l} (launcher): exit {rc_a} after {took_a:.2f} s; at step {at_t} "
          f"(torchrun): exit {rc_b} after {took_b:.2f} s")

    # our launcher: the documented status 143, within the grace period, a checkpoint of the stop step
    stop = _stopped(a, ours, rc_a, 143, took_a, at_l, "SIGTERM")
    assert f"zerodp train: stopped on SIGTERM after step {stop['step']}, with a checkpoint" in _text(a)
    assert stop["step"] < N_STEPS

    # torchrun forwards SIGTERM to its workers; they stop the same way (each exits 143, rank 0
    # says so); torchrun itself then exits 1 after its SignalException (its own behaviour)
    stop_b = _stopped(b, tr, rc_b, 1, took_b, at_t)
    assert f"zerodp train: stopped on SIGTERM after step {stop_b['step']}, with a checkpoint" in _text(b)
    assert stop_b["step"] < N_STEPS

    ra = _launch(ours, "--resume")
    rb = _launch(tr, "--resume", torchrun=True)
    assert ra.wait(3 * STARTUP_S) == 0, _text(ra)[-3000:]
    assert rb.wait(3 * STARTUP_S) == 0, _text(rb)[-3000:]
    ref = straight()
    for run in (ours, tr):
        step, diff = compare(ref, run)
        assert step == N_STEPS and not diff, (run, step, diff)


def test_ctrl_c_stops_gracefully_a_second_one_aborts_and_the_grace_period_bounds_a_stuck_stop(tmp_path):
    rng = random.Random(1818)
    at = rng.randint(8, 30)
    stuck = 23  # rank 1 sleeps at the start of this step, so a graceful stop cannot finish
    ctrl_c, twice, late = tmp_path / "ctrl_c", tmp_path / "twice", tmp_path / "late"
    c = _launch(ctrl_c)
    d = _launch(twice, fault=f"stall:1:{stuck}")
    e = _launch(late, "--grace-s", "12", fault=f"stall:1:{stuck}")
    before = {}

    def remember_then(sig, out):
        def act(launch):  # rank 1 is about to sleep at the start of step `stuck`
            before[out] = (ckpt.find(out), _digest(ckpt.find(out)))
            _signal(sig)(launch)
        return act

    # Ctrl-C in a terminal: SIGINT to every process of the group (launcher and ranks), and the
    # launcher forwards it once more; the ranks must take that as one interrupt, not two
    _when_at({ctrl_c: (c, at, _signal(signal.SIGINT, group=True)),
              twice: (d, stuck, remember_then(signal.SIGINT, twice)),
              late: (e, stuck, remember_then(signal.SIGTERM, late))})
    time.sleep(2.5)  # later than the debounce of zerodp.train.stop
    d.second = time.monotonic()
    os.kill(d.proc.pid, signal.SIGINT)
    rc_c, took_c = _wait(c, 3 * GRACE_S)
    rc_d, _ = _wait(d, 3 * GRACE_S)
    took_d = d.ended - d.second
    rc_e, took_e = _wait(e, 3 * GRACE_S)
    print(f"Ctrl-C at step {at}: exit {rc_c} after {took_c:.2f} s; second SIGINT: exit {rc_d} "
          f"{took_d:.2f} s after it; stuck stop with --grace-s 12: exit {rc_e} after {took_e:.2f} s")

    _stopped(c, ctrl_c, rc_c, 130, took_c, at, "SIGINT")
    assert "second interrupt" not in _text(c)

    assert rc_d == 1, _text(d)[-3000:]
    assert took_d < 10  # at once: the launcher kills the ranks without waiting
    assert "zerodp train: second interrupt: the ranks were ended at once." in _text(d)

    assert rc_e == 1, _text(e)[-3000:]
    assert took_e < 12  # the grace period given
    assert "the ranks ended without a checkpoint of the step in flight" in _text(e)
    assert "did not stop cleanly within --grace-s 12 s" in _text(e)

    for out in (twice, late):  # the newest complete checkpoint is the one from before, untouched
        path, digest = before[out]
        assert ckpt.find(out) == path and _digest(path) == digest
        assert ckpt.Checkpoint.open(path).step == (stuck // 10) * 10  # SHA-256 of every file checked
