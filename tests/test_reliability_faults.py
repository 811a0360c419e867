"""Issue 9, faults: a crashed rank is restarted and the run ends where an uninterrupted one does;
a rank that dies or stalls never leaves the others hanging.

The faults are injected with the test-only ``ZERODP_TEST_FAULT`` hook (zerodp.train.faults):
``exit:R:S`` ends rank R's process at the start of step S (first attempt only), ``stall:R:S``
makes it sleep for an hour there. The runs go through the real ``zerodp train`` command and the
elastic launcher; two runs that do not depend on each other are started side by side.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from _engine_common import spawn_once
from _train_common import cpu_context
from zerodp.spawn import RankFailure
from zerodp.train import checkpoint as ckpt
from zerodp.train.config import TrainConfig
from zerodp.train.watchdog import CollectiveFailure, Watchdog, explain, is_collective_error

pytestmark = pytest.mark.dist

RUN = ["--preset", "nano", "--seq-len", "32", "--global-batch-tokens", "256", "--micro-batch", "4",
       "--eval-every", "0", "--no-progress", "--stage", "2"]
STARTUP_S = 120  # starting Python, torch and two ranks on a loaded 2-core machine


def _start(out, *extra, fault=None):
    env = dict(os.environ)
    env.pop("ZERODP_TEST_FAULT", None)
    if fault:
        env["ZERODP_TEST_FAULT"] = fault
    cmd = [sys.executable, "-m", "zerodp.cli", "train", *RUN, "--out", str(out), *extra]
    # its own session, so that a hang can be ended with every rank the launcher started
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _finish(proc, limit):
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"zerodp train did not end within {limit} s (a hang):\n{out[-2000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def test_a_killed_rank_restarts_the_group_which_ends_bitwise_where_an_uninterrupted_run_ends(tmp_path):
    steps = ["--steps", "6", "--ckpt-every", "2", "--keep-checkpoints", "3"]
    straight = _start(tmp_path / "straight", *steps)
    crashed = _start(tmp_path / "crashed", *steps, "--max-restarts", "1", fault="exit:1:3")
    rc_a, out_a, err_a = _finish(straight, 3 * STARTUP_S)
    rc_b, out_b, err_b = _finish(crashed, 3 * STARTUP_S)
    assert rc_a == 0, err_a[-3000:]
    assert rc_b == 0, err_b[-3000:]
    assert "rank 1: exiting with code 13 at step 3" in out_b  # the fault did happen
    assert "restart 1 of the group after a failure; resuming from" in out_b and "step_00000002" in out_b
    a = ckpt.Checkpoint.open(ckpt.find(tmp_path / "straight"))
    b = ckpt.Checkpoint.open(ckpt.find(tmp_path / "crashed"))
    assert a.step == b.step == 6
    for name in a.names():
        for kind in a.kinds(name):
            assert torch.equal(a.full(name, kind), b.full(name, kind)), (name, kind)
    assert a.manifest["scalars"] == b.manifest["scalars"]
    records = [json.loads(l) for l in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in records if r["event"] in ("start", "resume")] == [
        ("start", 0), ("resume", 2)]


def test_no_hang_when_a_rank_dies_or_stalls(tmp_path):
    t0 = time.monotonic()
    died = _start(tmp_path / "died", "--steps", "4", "--ckpt-every", "2", fault="exit:1:2")
    stalled = _start(tmp_path / "stalled", "--steps", "4", "--ckpt-every", "2", "--timeout-s", "8",
                     fault="stall:1:2")
    rc_d, _, err_d = _finish(died, STARTUP_S + 60)
    rc_s, _, err_s = _finish(stalled, STARTUP_S + 60)  # one rank sleeps for an hour
    assert time.monotonic() - t0 < 2 * STARTUP_S

    assert rc_d == 1
    assert ("zerodp train: rank 1 failed (exit code 13): its process ended without a Python error"
            in err_d), err_d[-3000:]
    assert "The newest complete checkpoint is" in err_d and "step_00000002" in err_d

    assert rc_s == 1
    assert ("zerodp train: rank 0 failed (exit code 1): CollectiveFailure: rank 0 of 2 stopped in a "
            "collective during step 2") in err_s, err_s[-3000:]
    assert "waited more than --timeout-s 8 s for another rank: that rank stalled" in err_s
    for err in (err_d, err_s):  # the failure in words, not a traceback from inside a collective
        assert "Traceback" not in err, err[-3000:]


BASE = TrainConfig(preset="nano", seq_len=32, global_batch_tokens=256, micro_batch=4, steps=4,
                   eval_every=0, eval_batches=1, ckpt_every=0, progress=False, timeout_s=60)


def _survivor(rank, world, root):
    from zerodp.train.loop import train

    return train(replace(BASE, out=f"{root}/run"), cpu_context(rank, world))


def test_the_survivors_of_a_dead_rank_end_by_themselves_and_say_why(tmp_path):
    """No launcher to clean up (as on another node under torchrun): rank 0 must notice alone."""
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn_once(_survivor, 2, str(tmp_path), timeout=240, grace=90,
                   env={"ZERODP_TEST_FAULT": "exit:1:2"})
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "rank 1 died with exit code 13" in text
    assert "CollectiveFailure: rank 0 of 2 stopped in a collective during step 2" in text, text[-3000:]
    assert "lost the connection to another rank: that rank's process ended" in text
    assert elapsed < 90 + STARTUP_S - 30  # rank 0 ended itself, well before run_local's grace ran out


def test_the_watchdog_ends_a_rank_that_makes_no_progress_and_only_then():
    ended = []
    with Watchdog(0.6, rank=3, slow_limit_s=2.5, exit=ended.append, out=open(os.devnull, "w")) as dog:
        for _ in range(8):  # petted more often than the limit: never fires
            dog.pet("busy")
            time.sleep(0.15)
        assert ended == [] and not dog.fired
        dog.slow("start-up")  # a slow phase gets the longer limit
        time.sleep(1.2)
        assert ended == []
        dog.pet("step 7, micro-batch 0 (forward/backward)")
        time.sleep(1.5)
    assert ended == [75] and dog.fired


def test_backend_errors_become_one_sentence():
    stalled = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    died = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    assert is_collective_error(stalled) and is_collective_error(died)
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_error(ValueError("timed out"))
    e = explain(stalled, 0, 2, "step 4", 30)
    assert isinstance(e, CollectiveFailure)
    assert str(e).startswith("rank 0 of 2 stopped in a collective during step 4: it waited more than "
                             "--timeout-s 30 s for another rank")
    assert "lost the connection to another rank" in str(explain(died, 1, 4, "step 1", 30))
