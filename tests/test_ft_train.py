"""``zerodp train --replica-groups R`` (issue 52, zerodp.ft.app) end to end: the lighthouse and 2
groups of 2 ranks started by the CLI on the bundled corpus, each group a job of its own.

make test: a fault-free run — every step committed by both groups, each group batch taken once,
the groups' master values and optimizer states equal at the end, bitwise; the report and the
checkpoint that ``zerodp sample`` reads. make fuzz: one rank of group 1 SIGKILLed mid-run; the launcher ends
the group, starts it again, it heals from group 0 and the run ends with every step committed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torchft")

from _engine_common import in_make_fuzz  # noqa: E402

pytestmark = pytest.mark.dist

RUN = ["--replica-groups", "2", "--nproc", "2", "--model", "nano", "--seq-len", "32", "--global-batch-tokens",
       "512", "--micro-batch", "4", "--stage", "1", "--eval-every", "0", "--no-progress"]


def _zerodp(*args, env=None):
    return [sys.executable, "-c", "import sys; from zerodp.cli import main; sys.argv[0] = 'zerodp'; "
            "sys.exit(main())", *args]


def _records(out):
    recs = []
    for path in sorted((out / "ft-logs").glob("g*-r*-a*.jsonl")):
        g, r, a = (int(p[1:]) for p in path.stem.split("-"))
        for line in path.read_text().splitlines():
            try:
                recs.append(dict(json.loads(line), group=g, rank=r, attempt=a))
            except json.JSONDecodeError:
                pass  # a line cut short by the SIGKILL
    return recs


def _check_steps(recs, steps):
    committed = [r for r in recs if r.get("event") == "step" and r["committed"] and r["rank"] == 0]
    by_step = {}
    for r in committed:
        by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == list(range(steps))
    # a group healing during a step logs no batch (it took no part: zerodp.ft.replicas)
    batches = [r["batch"] for rs in by_step.values() for r in rs if r["batch"] is not None]
    assert sorted(batches) == list(range(len(batches)))  # each group batch once, none skipped
    for rs in by_step.values():
        assert len([r for r in rs if r["batch"] is not None]) == rs[0]["participants"]
    for rank in (0, 1):  # at the last step every group holds the same state, bitwise
        last = [r for r in recs if r.get("step") == steps - 1 and r["committed"] and r["rank"] == rank]
        assert len(last) == 2 and len({r["digest"] for r in last}) == 1, last
    return by_step


def test_zerodp_train_replica_groups_end_to_end(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run(_zerodp("train", *RUN, "--steps", "10", "--out", str(out)), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 groups x 2 ranks" in p.stdout and "committed 10 steps (0 with fewer than 2 groups)" in p.stdout
    by_step = _check_steps(_records(out), 10)
    assert all(rs[0]["participants"] == 2 for rs in by_step.values())
    report = json.loads((out / "ft-report.json").read_text())
    assert report["steps"] == 10 and report["committed_tokens"] == 10 * 512 and report["heals"] == 0
    assert report["final_loss"] < by_step[0][0]["loss"]  # it learns
    s = subprocess.run(_zerodp("sample", str(out), "--max-new-tokens", "8"), capture_output=True, text=True,
                       timeout=120)
    assert s.returncode == 0, s.stderr


def test_zerodp_train_replica_groups_with_diloco(tmp_path):
    """--diloco-every H over the replica groups: every step committed by both groups, each batch
    once, the outer state (θ_outer, momentum) equal in both groups at the end, bitwise (each
    group keeps its own inner optimizer state); int8 and a delay refused in one line."""
    out = tmp_path / "run"
    p = subprocess.run(_zerodp("train", *RUN, "--steps", "8", "--diloco-every", "4", "--out", str(out)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_steps(_records(out), 8)
    report = json.loads((out / "ft-report.json").read_text())
    assert report["steps"] == 8 and report["heals"] == 0
    with pytest.raises(ValueError, match="--replica-groups does not run with --diloco-compress int8"):
        from zerodp.train.config import TrainConfig

        TrainConfig(replica_groups=2, diloco_every=4, diloco_compress="int8")


def test_zerodp_train_replica_groups_refuses_what_it_does_not_run(tmp_path):
    from zerodp.train.config import TrainConfig

    p = subprocess.run(_zerodp("train", "--replica-groups", "1", "--out", str(tmp_path / "x")), capture_output=True,
                       text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and "--replica-groups must be >= 2, got 1" in lines[0], p.stderr
    for kw, words in ((dict(shard_size=2), "--shard-size"), (dict(plan="auto"), "--plan auto"),
                      (dict(shard_size=1, diloco_every=4), "--shard-size"), (dict(compile=True), "--compile"),
                      (dict(diloco_every=4, diloco_delay=1), "--diloco-delay"),
                      (dict(resume="x"), "--resume")):
        with pytest.raises(ValueError, match=f"--replica-groups does not run with {words}"):
            TrainConfig(replica_groups=2, **kw)
    env = dict(os.environ, TORCHELASTIC_RUN_ID="x", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               GROUP_RANK="0", ROLE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    env.pop("REPLICA_GROUP", None)
    p = subprocess.run(_zerodp("train", *RUN, "--steps", "2"), capture_output=True, text=True, timeout=60, env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and "set REPLICA_GROUP" in lines[0], p.stderr


# one rank of a 2-rank group: the replica-group stop rule (zerodp.ft.worker.install_stop, what every
# zerodp.ft rank installs) or the plain one (a graceful stop with a checkpoint), then AllReduces for ever
_RANK = """
import datetime, os, sys
rank = int(os.environ["RANK"])
if sys.argv[1] == "replica":
    from zerodp.ft.worker import install_stop
    install_stop(1, rank)
else:
    from zerodp.train import stop
    stop.install(rank, 30.0)
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
print("stepping", flush=True)
while True:
    dist.all_reduce(t)
"""


def _group_of_two(rule):
    from zerodp.spawn import free_port

    port = str(free_port())
    return [subprocess.Popen([sys.executable, "-c", _RANK, rule], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port, OMP_NUM_THREADS="1"))
            for r in (0, 1)]


def test_a_rank_whose_group_lost_a_peer_ends_at_once_on_the_agents_sigterm():
    """The agent ends a group whose rank died with SIGTERM to the others. Rank 1 here stops answering
    with its connections open (SIGSTOP, as a lost node leaves them), so rank 0 is blocked inside an
    AllReduce, where no Python signal handler runs: under the replica-group rule it ends at once
    (one line, status 143); under the plain rule it would wait for a checkpoint it cannot make."""
    groups = {rule: _group_of_two(rule) for rule in ("replica", "plain")}
    try:
        for procs in groups.values():
            for p in procs:
                assert p.stdout.readline().strip() == "stepping", p.stderr.read()
            os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 is in its next AllReduce, waiting for rank 1
        sent = time.monotonic()
        for procs in groups.values():
            procs[0].send_signal(signal.SIGTERM)
        ft = groups["replica"][0]
        code = ft.wait(10)
        took = time.monotonic() - sent
        lines = [ln for ln in ft.stderr.read().splitlines() if ln.strip()]
        print(f"replica-group rule: rank 0, blocked in an AllReduce, ended {took:.3f} s after SIGTERM (status {code})")
        assert code == 143 and took < 5.0, (code, took, lines)
        assert len(lines) == 1 and lines[0].startswith("zerodp: group 1 rank 0: SIGTERM received: ending now, "
                                                       "without a checkpoint"), lines
        time.sleep(max(0.0, sent + 3.0 - time.monotonic()))
        assert groups["plain"][0].poll() is None  # still blocked: its handler has not even run
    finally:
        for procs in groups.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()


@in_make_fuzz("the fault-free run (test_zerodp_train_replica_groups_end_to_end)")
def test_zerodp_train_replica_groups_heals_a_killed_group(tmp_path):
    out = tmp_path / "run"
    steps = 120
    env = dict(os.environ, ZERODP_TEST_FT_PAUSE_S="0.15")
    proc = subprocess.Popen(_zerodp("train", *RUN, "--steps", str(steps), "--max-restarts", "1", "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.time() + 180
        victim = None
        while time.time() < deadline and victim is None:
            time.sleep(0.5)
            recs = _records(out) if (out / "ft-logs").exists() else []
            if any(r.get("event") == "step" and r["committed"] and r["step"] >= 5 for r in recs):
                victim = next(r["pid"] for r in recs if r.get("event") == "start" and r["group"] == 1
                              and r["rank"] == 0)
        assert victim is not None, "the run did not reach step 5"
        os.kill(victim, signal.SIGKILL)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, text
    assert "group 1: a rank was killed; starting the group again (1/1)" in text
    assert "group 1 healed from a live peer" in text
    recs = _records(out)
    by_step = _check_steps(recs, steps)
    assert any(rs[0]["participants"] == 1 for rs in by_step.values())  # group 0 went on alone
    healed = [r for r in recs if r.get("event") == "step" and r["group"] == 1 and r["attempt"] == 1]
    assert healed[0]["healed"] and healed[0]["step"] > 5
    assert healed[-1]["step"] == steps - 1
    # the killed rank's group-mate ended with one line (its collective failed, or the launcher's SIGTERM)
    err = _err_lines(out, 1, 1, 0)
    assert err and err[-1].startswith("zerodp: group 1 rank 1: ") and not any("Traceback" in x for x in err), err


def _err_lines(out, group, rank, attempt):
    text = (out / "ft-logs" / f"g{group}-r{rank}-a{attempt}.err").read_text(errors="replace")
    return [x for x in text.splitlines() if x.strip() and "NCCL flight recorder" not in x]  # torchft's per-quorum line


@in_make_fuzz("the stop rule in two processes (test_a_rank_whose_group_lost_a_peer_ends_at_once_on_the_agents_sigterm)")
def test_zerodp_train_replica_groups_ends_every_group_at_once_on_sigterm(tmp_path):
    """A stop of the whole job: SIGTERM to the launcher ends every rank at once, each with one line, and
    the launcher says in one line that no live group is left to heal from (status 143)."""
    out = tmp_path / "run"
    env = dict(os.environ, ZERODP_TEST_FT_PAUSE_S="0.1")
    proc = subprocess.Popen(_zerodp("train", *RUN, "--steps", "100000", "--out", str(out)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            time.sleep(0.3)
            recs = _records(out) if (out / "ft-logs").exists() else []
            if any(r.get("event") == "step" and r["committed"] and r["step"] >= 3 for r in recs):
                break
        else:
            pytest.fail("the run did not reach step 3")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.strip().splitlines()
    assert proc.returncode == 143 and took < 15, (proc.returncode, took, err[-3000:])
    assert lines[-1].startswith("zerodp train: stopped on SIGTERM after ") and "no live group is left" in lines[-1]
    for g in (0, 1):
        for r in (0, 1):
            rank = _err_lines(out, g, r, 0)
            assert rank and rank[-1].startswith(f"zerodp: group {g} rank {r}: SIGTERM received: ending now"), rank
