"""The chaos run: many faults in one training run, and proof that it still ends where an
uninterrupted run ends, bit for bit.

``make chaos`` (``python -m zerodp.train.chaos``) draws a schedule of faults from a seed and runs
``zerodp train`` through it under ``--max-restarts``:

1. SIGKILL of a random rank at a random step;
2. SIGKILL of a random rank while it saves a checkpoint (at a random phase of the save);
3. SIGKILL of a random rank during the restart that follows (start-up of the next attempt);
4. a stalled rank (it sleeps; its peer's collective times out, or its own watchdog ends it);
5. SIGTERM to the launcher at a random step (a preemption): the ranks stop with a checkpoint and
   the launcher exits with 143; the harness then starts the run again with ``--resume``, as a
   scheduler requeues a preempted job;
6. SIGKILL of a random rank in that second launch;
7. SIGKILL of rank 0 right after the checkpoint of the last step is complete (the restarted group
   must see that the run is done, not fail for want of steps to take).

The faults are injected through the test-only ``ZERODP_TEST_FAULT`` hook (zerodp.train.faults),
one per attempt of the group (``@ATTEMPT``), so the schedule is reproducible from the seed. The
harness reads the output of the run as it comes (timestamping every line) and the metrics log,
and reports for each fault how it was detected, how long the run took to take a new step after
it, and how many steps had to be computed again. Then it runs the same configuration without
faults and compares the final checkpoints: every parameter and optimizer state, bitwise.

``--short`` is the version ``make test`` runs: two faults (a SIGKILL during a checkpoint write and
one during the restart after it) over a shorter run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zerodp.train.faults import ENV
from zerodp.train.hooks import SAVE_PHASES

# A tiny run: two ranks of the nano model on CPU (gloo). Stage 2 shards gradients and optimizer
# states, so a checkpoint holds pieces of every rank.
RUN = ["--preset", "nano", "--seq-len", "32", "--global-batch-tokens", "256", "--micro-batch", "4",
       "--eval-every", "0", "--no-progress", "--stage", "2", "--nproc", "2"]
FAULT_LINE = re.compile(r"\[" + ENV + r"\] rank (\d+): (.*) \(attempt (\d+)\)")


@dataclass
class Planned:
    """One fault of the schedule: its ``ZERODP_TEST_FAULT`` item and which launch it belongs to."""

    spec: str
    launch: int
    words: str


@dataclass
class Line:
    t: float  # wall-clock time the harness read it
    stream: str
    text: str


@dataclass
class Outcome:
    """What the harness saw of one fault."""

    planned: Planned
    seen_at: float | None = None
    message: str = ""
    detected: str = ""
    recovered_s: float | None = None
    lost: int | None = None
    resumed_at: int | None = None


@dataclass
class Report:
    outcomes: list[Outcome]
    launches: list[int] = field(default_factory=list)  # exit status of each launch
    equal: bool = False
    mismatches: list[str] = field(default_factory=list)
    final_step: int | None = None
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.equal and not self.problems

    def text(self) -> str:
        rows = [("#", "fault", "detected by", "recovered in", "steps lost")]
        for i, o in enumerate(self.outcomes, 1):
            rec = f"{o.recovered_s:.1f} s" if o.recovered_s is not None else "-"
            lost = "-" if o.lost is None else (f"{o.lost} (resumed at {o.resumed_at})"
                                               if o.resumed_at is not None else f"{o.lost} (run was complete)")
            rows.append((str(i), o.planned.words, o.detected or "NOT SEEN", rec, lost))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        out = ["chaos run: " + ", ".join(o.planned.spec for o in self.outcomes)]
        for j, r in enumerate(rows):
            out.append(" | ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
            if j == 0:
                out.append("-+-".join("-" * w for w in widths))
        out.append(f"launches exited with {self.launches}; final step {self.final_step}; wall time "
                   f"{self.wall_s:.0f} s")
        out.append("final parameters and optimizer states vs the uninterrupted run: "
                   + ("bitwise equal" if self.equal else "DIFFERENT: " + "; ".join(self.mismatches[:5])))
        out.extend(f"problem: {p}" for p in self.problems)
        out.append("PASS" if self.passed else "FAIL")
        return "\n".join(out)


def schedule(seed: int, steps: int, ckpt_every: int, short: bool = False) -> list[Planned]:
    """The faults, drawn from ``seed``: each one in an attempt of its own (see the module docstring).

    The steps are chosen so that every fault lies ahead of where the run resumes after the one
    before, whatever the random draws."""
    rng = random.Random(seed)
    k = ckpt_every
    rank = lambda: rng.randrange(2)  # noqa: E731
    plan = []

    def save_kill(attempt: int, after: int) -> tuple[Planned, int]:
        c = (after // k + rng.randint(1, 3)) * k
        if c >= steps:
            raise ValueError(f"--steps {steps} is too few for this schedule; use at least {c + 2 * k}")
        r = rank()
        phase = rng.choice(SAVE_PHASES) if r == 0 else "files"  # later phases are rank 0's
        resumed = c if phase == "complete" else c - k  # COMPLETE written: that checkpoint counts
        return Planned(f"kill-save-{phase}:{r}:{c}@{attempt}", 0,
                       f"SIGKILL rank {r} while saving the checkpoint of step {c} (phase {phase})"), resumed

    if short:
        p, resumed = save_kill(0, rng.randint(1, 2) * k)
        r = rank()
        return [p, Planned(f"kill-start:{r}:*@1", 0, f"SIGKILL rank {r} during the restart (start-up)")]
    s1 = rng.randint(k + 2, 4 * k)
    r = rank()
    plan.append(Planned(f"kill:{r}:{s1}@0", 0, f"SIGKILL rank {r} at step {s1}"))
    p, resumed = save_kill(1, s1)
    plan.append(p)
    c = int(p.spec.split(":")[2].split("@")[0])
    r = rank()
    plan.append(Planned(f"kill-start:{r}:*@2", 0, f"SIGKILL rank {r} during the restart (start-up)"))
    s4 = c + rng.randint(3, 2 * k)
    r = rank()
    plan.append(Planned(f"stall:{r}:{s4}@3", 0, f"rank {r} stalls at step {s4}"))
    s5 = s4 + rng.randint(k, 3 * k)
    r = rank()
    plan.append(Planned(f"term:{r}:{s5}@4", 0, f"SIGTERM to the launcher at step {s5} (sent by rank {r}'s hook)"))
    s6 = min(steps - 5, s5 + rng.randint(k + 3, 3 * k))
    r = rank()
    plan.append(Planned(f"kill:{r}:{s6}@0", 1, f"SIGKILL rank {r} at step {s6} (second launch)"))
    plan.append(Planned(f"kill-save-complete:0:{steps}@1", 1,
                        "SIGKILL rank 0 right after the checkpoint of the last step is complete"))
    if s6 <= s5 + 3:
        raise ValueError(f"--steps {steps} is too few for this schedule; use at least {s5 + 20}")
    return plan


class Launch:
    """``zerodp train`` in a session of its own, its output read line by line with timestamps."""

    def __init__(self, args: list[str], env: dict, lines: list[Line], command: list[str] | None = None):
        command = command or [sys.executable, "-m", "zerodp.cli", "train"]
        self.proc = subprocess.Popen([*command, *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines = lines
        self.ended: float | None = None  # time.monotonic() when the process ended
        self._readers = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                         for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        self._readers.append(threading.Thread(target=self._wait_end, daemon=True))
        for t in self._readers:
            t.start()

    def _wait_end(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def _read(self, stream, name: str) -> None:
        for text in stream:
            self.lines.append(Line(time.time(), name, text.rstrip("\n")))

    def wait(self, limit_s: float) -> int:
        try:
            rc = self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = None
        for t in self._readers:
            t.join(timeout=10)
        if self.ended is None:
            self.ended = time.monotonic()
        return rc


def env_with(faults: str | None) -> dict:
    env = dict(os.environ)
    env.pop(ENV, None)
    if faults:
        env[ENV] = faults
    return env


def compare(a_dir: Path, b_dir: Path) -> tuple[int | None, list[str]]:
    """Final checkpoints of two runs: (their common step, every difference in words)."""
    import torch

    from zerodp.train import checkpoint as ckpt

    a = ckpt.Checkpoint.open(ckpt.find(a_dir, log=lambda m: None))
    b = ckpt.Checkpoint.open(ckpt.find(b_dir, log=lambda m: None))
    diff = []
    if a.step != b.step:
        diff.append(f"steps {a.step} and {b.step}")
    if sorted(a.names()) != sorted(b.names()):
        diff.append("different tensors")
    for name in a.names():
        for kind in a.kinds(name):
            if not torch.equal(a.full(name, kind), b.full(name, kind)):
                diff.append(f"{name}/{kind}")
    if a.manifest.get("scalars") != b.manifest.get("scalars"):
        diff.append("optimizer scalars (step counts)")
    return (a.step if a.step == b.step else None), diff


def _metrics(out: Path) -> list[dict]:
    try:
        text = (out / "metrics.jsonl").read_text()
    except OSError:
        return []
    recs = []
    for line in text.splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return recs


def _detected(fault: str, window: list[Line], at: float) -> str:
    """How the run noticed the fault that happened at ``at``, from what it printed (in words)."""
    found = []
    for ln in window:
        t = ln.text
        m = re.search(r"rank (\d+) of \d+ stopped in a collective during ([^:]+): "
                      r"it (lost the connection|waited more than --timeout-s [\d.]+ s)", t)
        if m:
            how = m.group(3)
            if how != "lost the connection":
                how = how.replace("waited more than ", "timed out after ")
            found.append(f"rank {m.group(1)}'s collective {how} (during {m.group(2)})")
        m = re.search(r"zerodp watchdog: rank (\d+) made no progress for ([\d.]+) s", t)
        if m:
            found.append(f"rank {m.group(1)}'s watchdog ({m.group(2)} s without progress)")
        if "nothing to redo" in t:
            found.append("the restarted group found the run complete")
        if fault.startswith("term") and "SIGTERM received: finishing the step in flight" in t:
            found.append("the launcher forwarded SIGTERM; the ranks agreed to stop at the next step end")
        m = re.search(r"stopped on SIGTERM after step (\d+)", t)
        if m and "zerodp train:" in t:
            found.append(f"stopped after step {m.group(1)} with its checkpoint, exit 143")
    restarts = [m.group(1) for ln in window if ln.t >= at
                for m in [re.search(r"zerodp: restart (\d+) of the group", ln.text)] if m]
    if restarts:  # rank 0 of the new attempt says so when it starts
        who = "the killed rank's process end" if fault.startswith("kill") else "a rank end"
        found.insert(0, f"the elastic agent saw {who} and restarted the group (restart {restarts[0]})")
    seen = []
    for f in found:
        if f not in seen:
            seen.append(f)
    return "; ".join(seen)


def analyse(plan: list[Planned], lines: list[Line], out: Path) -> list[Outcome]:
    """Match every planned fault with its line in the output and its effect in the metrics log."""
    lines = sorted(lines, key=lambda ln: ln.t)
    recs = _metrics(out)
    outcomes = [Outcome(p) for p in plan]
    fault_lines = [ln for ln in lines if FAULT_LINE.search(ln.text)]
    used = set()
    for o in outcomes:
        kind, rank, rest = o.planned.spec.split(":")
        attempt = int(rest.split("@")[1])
        for i, ln in enumerate(fault_lines):
            m = FAULT_LINE.search(ln.text)
            if i in used or int(m.group(1)) != int(rank) or int(m.group(3)) != attempt:
                continue
            if ln.t < (max((x.seen_at for x in outcomes if x.seen_at), default=0)):
                continue
            used.add(i)
            o.seen_at, o.message = ln.t, m.group(2)
            break
    seen = [o for o in outcomes if o.seen_at is not None]
    for j, o in enumerate(seen):
        nxt = seen[j + 1].seen_at if j + 1 < len(seen) else float("inf")
        prev = seen[j - 1].seen_at if j > 0 else 0.0
        # from a moment before the fault's own line: its two output streams are read separately
        window = [ln for ln in lines if o.seen_at - 0.2 <= ln.t < nxt]
        o.detected = _detected(o.planned.spec, window, o.seen_at)
        # the attempt that took the next step: the first start/resume record after the fault
        resumed = [r for r in recs if r.get("event") in ("resume", "start") and o.seen_at < r["time"]]
        before = [r["step"] for r in recs if r.get("event") == "step" and prev < r["time"] <= o.seen_at]
        if resumed:
            o.resumed_at = resumed[0]["step"]
            o.lost = max(0, (max(before) if before else o.resumed_at) - o.resumed_at)
            after = [r for r in recs if r.get("event") == "step" and r["time"] >= resumed[0]["time"]]
            if after:  # recovered: the first step taken after the fault, by the attempt that followed it
                o.recovered_s = after[0]["time"] - o.seen_at
        elif any("nothing to redo" in ln.text for ln in window):  # it struck after the last step
            o.lost = 0
    return outcomes


def run_chaos(work: Path, seed: int = 0, steps: int = 200, ckpt_every: int = 10, short: bool = False,
              timeout_s: float = 8.0, limit_s: float = 900.0, log=print, reference=None) -> Report:
    """Run the schedule in ``work/chaos`` and the same run without faults in ``work/straight``.

    ``reference``: instead of that run, a function that returns the directory of an uninterrupted
    run of the same configuration (``RUN``, ``steps``, ``ckpt_every``) made elsewhere."""
    t0 = time.monotonic()
    plan = schedule(seed, steps, ckpt_every, short)
    args = [*RUN, "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--keep-checkpoints", "3",
            "--timeout-s", f"{timeout_s:g}"]
    chaos, straight = work / "chaos", work / "straight"
    log(f"chaos: seed {seed}, {len(plan)} faults over {steps} steps: " + ", ".join(p.spec for p in plan))
    lines: list[Line] = []
    ref = None if reference else Launch([*args, "--out", str(straight)], env_with(None), [])  # side by side
    report = Report([])
    launches = sorted({p.launch for p in plan})
    for n in launches:
        faults = ",".join(p.spec for p in plan if p.launch == n)
        restarts = sum(1 for p in plan if p.launch == n and not p.spec.startswith("term"))
        extra = ["--max-restarts", str(restarts)] + (["--resume"] if n > 0 else [])
        run = Launch([*args, "--out", str(chaos), *extra], env_with(faults), lines)
        rc = run.wait(limit_s)
        report.launches.append(rc)
        stopped = any(p.spec.startswith("term") for p in plan if p.launch == n)
        want = 143 if stopped else 0
        if rc != want:
            report.problems.append(f"launch {n + 1} exited with {rc}, expected {want}")
            tail = "\n".join(ln.text for ln in lines[-40:])
            report.problems.append(f"its last lines:\n{tail}")
            break
    if ref is not None:
        rc_ref = ref.wait(limit_s)
        if rc_ref != 0:
            report.problems.append(f"the uninterrupted run exited with {rc_ref}")
    else:
        straight = reference()
    report.outcomes = analyse(plan, lines, chaos)
    for o in report.outcomes:
        if o.seen_at is None:
            report.problems.append(f"fault {o.planned.spec} did not happen")
    if not report.problems or all("did not happen" in p for p in report.problems):
        try:
            report.final_step, report.mismatches = compare(straight, chaos)
            report.equal = not report.mismatches and report.final_step == steps
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            report.problems.append(f"cannot compare the final checkpoints: {type(e).__name__}: {e}")
    report.wall_s = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerodp.train.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="draws the schedule (ranks, steps, phases)")
    ap.add_argument("--steps", type=int, default=200, help="steps of the run (the full schedule needs about 150)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--timeout-s", type=float, default=8.0, help="--timeout-s of the run (stall detection)")
    ap.add_argument("--short", action="store_true", help="two faults (what make test runs)")
    ap.add_argument("--work", default=None, help="directory for the two runs (default: a temporary one)")
    a = ap.parse_args(argv)
    try:
        schedule(a.seed, a.steps, a.ckpt_every, a.short)  # a run too short for it: one line, now
    except ValueError as e:
        ap.error(str(e))
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="zerodp-chaos-"))
    report = run_chaos(work, a.seed, a.steps, a.ckpt_every, a.short, a.timeout_s)
    print(report.text())
    print(f"runs in {work}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
