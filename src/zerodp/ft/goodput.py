"""Goodput under a kill schedule: heal from a peer against restart from a checkpoint (issue 52).

    python -m zerodp.ft.goodput [--duration-s 600] [--every-s 60] [--seed 0] [--model tiny]
                                [--stage 1] [--ckpt-every 10] [--out DIR]

Three runs of the same training — ``zerodp train`` on the bundled corpus, the same model, stage,
global batch and 4 ranks — each for ``--duration-s`` from its first step:

1. **fault-free**: ``--replica-groups 2 --nproc 2`` (:mod:`zerodp.ft.app`: 2 groups of 2 ranks);
2. **heal from a peer**: the same, and every ``--every-s`` seconds a fault drawn from ``--seed``:
   a whole group SIGKILLed, or one rank of it (its group-mates then fail in their collectives);
   the app starts the group again and it heals from the live group while that one steps on (a
   fault that comes while a group is still coming back hits that group again, so that one group
   stays live: what is measured is the heal, not the loss of every replica);
3. **restart from a checkpoint** (today's path): plain hybrid sharding, ``--nproc 4 --shard-size
   2 --max-restarts 1000 --ckpt-every K``, the same fault times, each a SIGKILL of a random rank;
   the elastic agent ends every rank and starts them all again from the newest checkpoint.

Goodput is committed tokens per second over the window: for the replica groups every committed
step's tokens (the live groups' share of the global batch; a committed step is never taken
again); for the restart path the progress the run keeps — the step it stands at the window's end
less the step it stood at the window's start (the steps since the last checkpoint that a failure
throws away do not count), times the global batch's tokens. Printed per run with its faults: the
ratio to the fault-free run, and the ratio to the run's own pace (the global batch per its median
step with every rank up — on a shared machine the load drifts between runs taken minutes apart);
the heal run is also checked with :func:`zerodp.ft.chaos.problems`
(consecutive committed steps, each batch once, no restarted group from step 0, no survivor step
longer than 60 s). ``make chaos`` runs the 10-minute schedule (about 35 minutes in all).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zerodp.ft.chaos import fault_times, problems, schedule_parser


def _train_cmd(out: Path, a, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zerodp.cli", "train", "--model", a.model, "--stage", str(a.stage),
            "--global-batch-tokens", str(a.global_batch_tokens), "--micro-batch", str(a.micro_batch),
            "--steps", "1000000", "--eval-every", "0", "--no-progress", "--out", str(out), *extra]


def _jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


class _FtRun:
    """``zerodp train --replica-groups 2``: its records, its ranks' pids, a fault."""

    kind = "replica groups"

    def __init__(self, out: Path, a):
        self.out, self.a = out, a
        self.hit = {0: 0.0, 1: 0.0}  # when each group was last killed
        self.proc = subprocess.Popen(_train_cmd(out, a, "--replica-groups", "2", "--nproc", "2", "--max-restarts",
                                                "1000", "--ckpt-every", "0"),
                                     stdout=open(out.parent / f"{out.name}.out", "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def records(self) -> list[dict]:
        recs = []
        for path in sorted((self.out / "ft-logs").glob("g*-r*-a*.jsonl")):
            g, r, at = (int(p[1:]) for p in path.stem.split("-"))
            recs += [dict(x, group=g, rank=r, attempt=at) for x in _jsonl(path)]
        return recs

    def first_step_t(self) -> float | None:
        ts = [r["t"] for r in self.records() if r.get("event") == "step" and r["committed"]]
        return min(ts) if ts else None

    def fault(self, rng: random.Random) -> str:
        recs = self.records()
        latest = {}
        for r in recs:
            if r.get("event") == "start":
                latest[(r["group"], r["rank"])] = max(latest.get((r["group"], r["rank"]), (-1, 0)),
                                                      (r["attempt"], r["pid"]))
        # a group is stepping once it committed a step after its last kill (healed, if it was killed)
        stepping = {g for g in (0, 1) if any(r.get("event") == "step" and r["group"] == g and r["committed"]
                                             and r["t"] > self.hit[g] for r in recs)}
        g = rng.randrange(2)
        whole = rng.random() < 0.5
        rank = rng.randrange(2)
        if len(stepping) < 2 and stepping:  # a group still coming back: hit it, keep the live one live
            g = ({0, 1} - stepping).pop()
        self.hit[g] = time.time()
        pids = [pid for (gg, r), (a, pid) in latest.items() if gg == g and (whole or r == rank)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return f"SIGKILL group {g}" + ("" if whole else f" rank {rank}")

    def committed_tokens(self, t0: float, t1: float, group_tokens: int) -> int:
        steps = {r["step"]: r["participants"] for r in self.records()
                 if r.get("event") == "step" and r["committed"] and r["rank"] == 0 and t0 <= r["t"] <= t1}
        return sum(steps.values()) * group_tokens

    def median_step_s(self, t0: float, t1: float) -> float:
        """The median time of a committed step with both groups in the window (the run's own pace)."""
        import statistics

        return statistics.median(r["s"] for r in self.records() if r.get("event") == "step" and r["committed"]
                                 and r["rank"] == 0 and r["participants"] == 2 and t0 <= r["t"] <= t1)

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)


class _RestartRun:
    """Plain hybrid sharding under ``--max-restarts``: its step position over time, a fault."""

    kind = "restart from checkpoint"

    def __init__(self, out: Path, a):
        self.out = out
        self.proc = subprocess.Popen(_train_cmd(out, a, "--nproc", "4", "--shard-size", "2", "--max-restarts", "1000",
                                                "--ckpt-every", str(a.ckpt_every)),
                                     stdout=open(out.parent / f"{out.name}.out", "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def steps(self) -> list[tuple[float, int]]:
        return [(r["time"], r["step"]) for r in _jsonl(self.out / "metrics.jsonl") if r.get("event") == "step"]

    def first_step_t(self) -> float | None:
        s = self.steps()
        return s[0][0] if s else None

    def workers(self) -> list[int]:
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmd:
                pids.append(int(d.name))
        return sorted(pids)

    def fault(self, rng: random.Random) -> str:
        pids = self.workers()
        g, _, rank = rng.randrange(2), rng.random() < 0.5, rng.randrange(2)  # the same draws as the heal run
        if not pids:
            return "no worker to kill (the ranks were starting again)"
        victim = pids[(2 * g + rank) % len(pids)]
        os.kill(victim, signal.SIGKILL)
        return f"SIGKILL rank {(2 * g + rank) % len(pids)} (every rank restarts from the newest checkpoint)"

    def median_step_s(self, t0: float, t1: float) -> float:
        import statistics

        return statistics.median(r["step_s"] for r in _jsonl(self.out / "metrics.jsonl")
                                 if r.get("event") == "step" and t0 <= r["time"] <= t1)

    def position(self, t: float) -> int:
        """The step the run stands at, at time ``t`` (the newest step record up to then)."""
        at = [s for ts, s in self.steps() if ts <= t]
        return at[-1] if at else 0

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)


def _stop(proc: subprocess.Popen, sig) -> None:
    """Ask the run to stop (the app ends its groups; the restart path stops its ranks), then end
    whatever of its session is left."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _run(run, a, faults_on: bool, say) -> dict:
    """Wait for the first step, then the schedule for ``duration_s``; the window and the faults."""
    deadline = time.time() + 600
    while run.first_step_t() is None:
        if run.proc.poll() is not None:
            raise RuntimeError(f"{run.kind}: the run ended before its first step (exit {run.proc.returncode}); "
                               f"see {run.out}.out")
        if time.time() > deadline:
            raise RuntimeError(f"{run.kind}: no first step within 600 s; see {run.out}.out")
        time.sleep(0.2)
    t0 = run.first_step_t()
    rng = random.Random(a.seed)
    faults = []
    for _ in fault_times(t0, a.every_s, a.duration_s if faults_on else 0.0):
        what = run.fault(rng)
        faults.append(what)
        say(f"  {time.time() - t0:6.1f} s  {what}")
        if run.proc.poll() is not None:
            raise RuntimeError(f"{run.kind}: the run ended (exit {run.proc.returncode}); see {run.out}.out")
    time.sleep(max(0.0, t0 + a.duration_s - time.time()))
    t1 = t0 + a.duration_s
    time.sleep(1.0)  # the records of the window's last steps
    return dict(t0=t0, t1=t1, faults=faults)


def main(argv=None) -> int:
    p = schedule_parser("zerodp.ft.goodput", "Goodput under a kill schedule: replica groups that heal from a peer "
                                             "against restart from a checkpoint, beside a fault-free run.")
    p.add_argument("--global-batch-tokens", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank (4 ranks: grad_acc 1 at 4096 tokens)")
    p.add_argument("--ckpt-every", type=int, default=10,
                   help="the restart path's checkpoint interval in steps (about Young's sqrt(2 C M) here)")
    p.add_argument("--out", help="folder of the three runs (default: a temporary one)")
    a = p.parse_args(argv)
    if not 0 < a.every_s <= a.duration_s:
        print(f"python -m zerodp.ft.goodput: error: --every-s must be > 0 and <= --duration-s, got {a.every_s:g}",
              file=sys.stderr)
        return 2
    from zerodp.train.config import TrainConfig

    try:
        cfg = TrainConfig(preset=a.model, stage=a.stage, nproc=4, global_batch_tokens=a.global_batch_tokens,
                          micro_batch=a.micro_batch)
        from zerodp.train.config import plan_batch

        plan_batch(cfg.global_batch_tokens, cfg.seq_len, cfg.micro_batch, 4)
    except ValueError as e:
        print(f"python -m zerodp.ft.goodput: error: {e}", file=sys.stderr)
        return 2
    global_tokens = cfg.global_batch_tokens
    root = Path(a.out or tempfile.mkdtemp(prefix="zerodp-ft-goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    say = lambda m: print(m, flush=True)  # noqa: E731
    say(f"{a.model}, stage {a.stage}, 4 ranks, global batch {global_tokens} tokens; {a.duration_s:g} s from the "
        f"first step, a fault every {a.every_s:g} s (seed {a.seed}); runs in {root}")
    rows, bad = [], []
    for name, cls, faults_on in (("fault-free (2 replica groups)", _FtRun, False),
                                 ("heal from a peer (2 replica groups)", _FtRun, True),
                                 (f"restart from checkpoint (every {a.ckpt_every} steps)", _RestartRun, True)):
        say(name)
        run = cls(root / name.split(" ")[0].replace("-", "_"), a)
        try:
            w = _run(run, a, faults_on, say)
        finally:
            run.stop()
        if isinstance(run, _FtRun):
            tokens = run.committed_tokens(w["t0"], w["t1"], global_tokens // 2)
            if faults_on:
                recs = [r for r in run.records() if r.get("event") == "step"]
                bad = problems(recs, stall_s=60.0)
        else:
            tokens = (run.position(w["t1"]) - run.position(w["t0"])) * global_tokens
        pace = global_tokens / run.median_step_s(w["t0"], w["t1"])  # tokens/s at the run's own fault-free pace
        rows.append((name, len(w["faults"]), tokens / a.duration_s, pace))
        say(f"  {tokens:,} tokens committed in {a.duration_s:g} s: {tokens / a.duration_s:,.0f} tokens/s "
            f"(its median full step: {global_tokens / pace:.3f} s)")
    base = rows[0][2]
    say("\ngoodput (committed tokens/s over the window) against the fault-free run, and against the run's own "
        "pace (the global batch per its median step with every rank up: the machine's load drifts between runs)")
    for name, n, g, pace in rows:
        say(f"  {name:<42} {n:3d} faults  {g:9,.0f} tokens/s  {g / base:.3f}x  own pace {g / pace:.3f}")
    say("\n".join(bad) if bad else "heal run checks: PASS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
