"""Kill replica groups (or single ranks) of a fault-tolerant run and check what the survivors and
the healed groups did (:mod:`zerodp.ft`; docs/reliability.md, "Replica groups that survive").

* :func:`heal_once`: R groups of g ranks; once every group commits, SIGKILL the last group; once
  the survivors committed some steps alone, start it again; once it committed steps with the
  others, stop. ``tests/test_ft_heal.py`` runs it (make test: stage 1, 2 × 2 ranks).
* :func:`run_schedule`: a seeded schedule of faults over a run of a given length — a whole group
  SIGKILLed, or one rank of a group (its group-mates then fail in their own collectives, and the
  group is restarted as a whole, as torchrun's agent restarts its job) — each group started
  again after a pause. ``python -m zerodp.ft.chaos --seed N`` (``make chaos`` runs it after the
  restart-from-checkpoint chaos run).
* :func:`problems`: the checks, one sentence per violation: every group's committed steps are
  consecutive (no committed step lost or repeated); the data position advances by the groups
  that took part, each batch index taken once; every healed group's first committed steps equal
  its peers' bitwise (a digest of every rank's master values and optimizer states; under DiLoCo,
  whose groups differ between syncs by design, of the outer state); no survivor step took longer
  than the stall bound.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from typing import Iterator

from zerodp.ft.launch import LocalGroups

TARGET = "zerodp.ft.trainer:train"


def _committed(recs, **match):
    return [r for r in recs if r["committed"] and all(r[k] == v for k, v in match.items())]


def problems(recs: list[dict], stall_s: float) -> list[str]:
    """What the run got wrong (module docstring); empty when it passed."""
    out = []
    by_step: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)  # (step, rank) -> group -> digest
    for (g, a), grp in _by_attempt(recs).items():
        start = min((x["step"] for x in grp), default=0)
        if a > 0 and start == 0:
            out.append(f"group {g} attempt {a} started from step 0: no live group to heal from")
        for r in sorted({x["rank"] for x in grp}):
            steps = [x["step"] for x in _committed(grp, rank=r)]
            if steps and steps != list(range(steps[0], steps[0] + len(steps))):
                out.append(f"group {g} rank {r} attempt {a}: committed steps not consecutive: {steps}")
        for x in _committed(grp):
            # DiLoCo: the groups' inner states differ by design between syncs; their outer state not
            key = "outer_digest" if "outer_digest" in x else "digest"
            if key in x:
                by_step[(x["step"], x["rank"])][g] = x[key]
    for (step, rank), digests in sorted(by_step.items()):
        if len(set(digests.values())) > 1:
            out.append(f"step {step} rank {rank}: the groups' states differ: {digests}")
    # the data position: per committed step, first + participants is the next step's first
    firsts: dict[int, tuple[int, int]] = {}
    taken: dict[int, list[int]] = defaultdict(list)
    for x in _committed(recs, rank=0):
        firsts.setdefault(x["step"], (x["first"], x["participants"]))
        if x["batch"] is None:  # a group healing during the step: its batch did not count
            continue
        taken[x["step"]].append(x["batch"])
        if not x["first"] <= x["batch"] < x["first"] + x["participants"]:
            out.append(f"group {x['group']} step {x['step']}: batch {x['batch']} outside [{x['first']}, "
                       f"{x['first'] + x['participants']})")
    for s in sorted(firsts):
        if s + 1 in firsts and firsts[s + 1][0] != sum(firsts[s]):
            out.append(f"step {s + 1} starts at batch {firsts[s + 1][0]}, step {s} ended at {sum(firsts[s])}")
    for s, batches in taken.items():
        if len(set(batches)) != len(batches):
            out.append(f"step {s}: two groups took the same batch ({sorted(batches)})")
    slow = [x for x in recs if x["s"] > stall_s]
    if slow:
        worst = max(slow, key=lambda x: x["s"])
        out.append(f"{len(slow)} steps took longer than {stall_s:g} s (worst: group {worst['group']} step "
                   f"{worst['step']}, {worst['s']} s)")
    return out


def _by_attempt(recs):
    out = defaultdict(list)
    for r in recs:
        out[(r["group"], r["attempt"])].append(r)
    return out


def heal_once(log_dir: str, stage: int = 1, groups: int = 2, ranks: int = 2, preset: str = "nano",
              before: int = 3, alone: int = 3, after: int = 2, timeout_s: float = 120.0,
              heartbeat_timeout_ms: int = 1000, diloco_every: int = 0, overlap_quorum: bool = True) -> dict:
    """One SIGKILL of the last group and one heal (module docstring): the records and timings.
    ``diloco_every``: H, the groups under a DiLoCo outer loop (0: plain replicas);
    ``overlap_quorum``: ``ReplicaGroups(overlap_quorum=...)`` in every group."""
    c = LocalGroups(TARGET, groups, ranks, dict(stage=stage, preset=preset, digest=True, step_sleep_s=0.02,
                                                diloco_every=diloco_every, overlap_quorum=overlap_quorum),
                    log_dir, heartbeat_timeout_ms=heartbeat_timeout_ms)
    dead = groups - 1
    t = {}
    try:
        t0 = time.time()
        c.start_all()
        c.wait_for(lambda: len(_committed(c.records(dead), rank=0, participants=groups)) >= before, timeout_s,
                   f"{before} steps of all {groups} groups")
        t["all_started_s"] = time.time() - t0
        c.kill(dead)
        t_kill = time.time()
        killed_after = max(r["step"] for r in _committed(c.records(0), rank=0))
        c.wait_for(lambda: len([r for r in _committed(c.records(0), rank=0, participants=groups - 1)
                                if r["step"] > killed_after]) >= alone, timeout_s,
                   f"{alone} steps without group {dead}")
        first = min(r["t"] for r in _committed(c.records(0), rank=0, participants=groups - 1))
        t["first_alone_step_s"] = first - t_kill
        c.start(dead)
        t_restart = time.time()
        c.wait_for(lambda: len([r for r in _committed(c.records(dead), rank=0, participants=groups)
                                if r["attempt"] == 1]) >= after, timeout_s, f"group {dead} healed and stepping")
        healed = [r for r in c.records(dead) if r["attempt"] == 1 and r["healed"]]
        t["restart_to_heal_s"] = (min(r["t"] for r in healed) - t_restart) if healed else None
        codes = c.stop()
    finally:
        c.close()
    return dict(records=c.records(), codes=codes, times=t, dead=dead, killed_after=killed_after)


def goodput(recs: list[dict], t0: float, t1: float) -> float:
    """Committed batches per second between ``t0`` and ``t1`` (each committed step counted once,
    with the groups that took part in it)."""
    steps = {r["step"]: r["participants"] for r in _committed(recs, rank=0) if t0 <= r["t"] <= t1}
    return sum(steps.values()) / (t1 - t0)


def fault_times(t0: float, every_s: float, duration_s: float) -> Iterator[float]:
    """The schedule's clock: sleeps until each fault is due — every ``every_s`` seconds from ``t0``
    whatever a heal took, up to ``duration_s`` — and yields its time."""
    at = t0 + every_s
    while at < t0 + duration_s:
        time.sleep(max(0.0, at - time.time()))
        yield at
        at += every_s


def run_schedule(log_dir: str, seed: int = 0, duration_s: float = 600.0, every_s: float = 60.0,
                 down_s: float = 5.0, stage: int = 1, groups: int = 2, ranks: int = 2,
                 preset: str = "tiny", faults_on: bool = True, out=print) -> dict:
    """A fault every ``every_s`` seconds (a whole group or one rank, drawn from ``seed``) for
    ``duration_s``; the failed group is started again ``down_s`` later and healed before the
    schedule goes on. ``faults_on=False``: the same run without faults (the reference). Returns
    the records, the faults and the schedule's start and end times."""
    rng = random.Random(seed)
    c = LocalGroups(TARGET, groups, ranks, dict(stage=stage, preset=preset, digest=True), log_dir)
    faults = []
    try:
        c.start_all()
        c.wait_for(lambda: all(_committed(c.records(g), rank=0) for g in range(groups)), 300, "every group stepping")
        t0 = time.time()
        for _ in fault_times(t0, every_s, duration_s if faults_on else 0.0):
            g = rng.randrange(groups)
            whole = rng.random() < 0.5
            rank = None if whole else rng.randrange(ranks)
            c.kill(g, None if whole else [rank])
            what = f"SIGKILL group {g}" if whole else f"SIGKILL group {g} rank {rank}"
            if not whole:  # its group-mates fail in their collectives; the group restarts as a whole
                time.sleep(1.0)
                c.kill(g)
            faults.append(what)
            out(f"{time.time() - t0:7.1f} s  {what}")
            time.sleep(down_s)
            c.start(g)
            attempt = c.attempts[g]
            c.wait_for(lambda: any(r["attempt"] == attempt and r["participants"] == groups
                                   for r in _committed(c.records(g), rank=0)), 300, f"group {g} healed")
            out(f"{time.time() - t0:7.1f} s  group {g} healed and stepping with the others")
        time.sleep(max(0.0, t0 + duration_s - time.time()))
        t1 = time.time()
        codes = c.stop()
        out(f"exit codes {codes}")
    finally:
        c.close()
    return dict(records=c.records(), faults=faults, t0=t0, t1=t1)


def schedule_parser(module: str, description: str) -> argparse.ArgumentParser:
    """``python -m <module>``'s parser with the kill schedule's options (this command's and
    ``python -m zerodp.ft.goodput``'s)."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    p.add_argument("--seed", type=int, default=0, help="draws which group or rank each fault kills")
    p.add_argument("--duration-s", type=float, default=600.0, help="length of the schedule")
    p.add_argument("--every-s", type=float, default=60.0, help="a fault every this many seconds")
    p.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--model", default="tiny", help="GPT preset")
    return p


def main(argv=None) -> int:
    p = schedule_parser("zerodp.ft.chaos", "SIGKILL replica groups and single ranks of a fault-tolerant run on a "
                                           "schedule; check the survivors and the healed groups.")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per group")
    p.add_argument("--out", help="log folder (default: a temporary one)")
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free run of the same length")
    a = p.parse_args(argv)
    log_dir = a.out or tempfile.mkdtemp(prefix="zerodp-ft-chaos-")
    kw = dict(stage=a.stage, groups=a.groups, ranks=a.nproc, preset=a.model)
    ref = None
    if not a.no_reference:
        ref = run_schedule(log_dir + "/reference", a.seed, a.duration_s, a.every_s, faults_on=False, **kw)
    run = run_schedule(log_dir + "/faults", a.seed, a.duration_s, a.every_s, **kw)
    bad = problems(run["records"], stall_s=60.0)
    got = goodput(run["records"], run["t0"], run["t1"])
    line = f"{len(run['faults'])} faults; goodput {got:.2f} committed batches/s"
    if ref is not None:
        base = goodput(ref["records"], ref["t0"], ref["t1"])
        line += f", fault-free {base:.2f}: {got / base:.3f}x"
    print(f"{line}; logs in {log_dir}")
    print("\n".join(bad) if bad else "PASS")
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
