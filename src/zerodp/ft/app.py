"""``zerodp train --replica-groups R``: the training app over replica groups that survive.

Each replica group is a job of its own: ``--nproc`` ranks (ZeRO at ``--stage`` over them, their
own rendezvous), joined to the other groups by torchft (:class:`zerodp.ft.ReplicaGroups`).

* **Locally** (:func:`run_local`, what ``zerodp train --replica-groups R`` does without torchrun):
  a lighthouse in this process and R groups of ``--nproc`` ranks, started by
  :class:`zerodp.ft.launch.LocalGroups`. A group one of whose ranks is killed (a signal) is
  ended whole and started again — up to ``--max-restarts`` times per group, as torchrun's agent
  restarts its job — joins the running quorum and heals from a live peer while the others step
  on. A rank that fails with an error ends the run with that error in one line.
* **Stopping**: a group's state lives in the live groups, so a stop signal ends a rank at once,
  without a checkpoint, with one line and the status 128 + the signal (:mod:`zerodp.train.stop`'s
  replica-group rule, :func:`zerodp.ft.worker.install_stop`): the agent that ends a group after one
  of its ranks died (``LocalGroups.end`` here, torchrun's on a cluster) gets it back promptly, and
  the group started again heals. SIGTERM or SIGINT to the local launcher ends every group that way
  and says in one line that no live group is left to heal from.
* **Under torchrun** (:func:`run_torchrun`, a cluster: one ``torchrun`` per group): this process
  is one rank of group ``$REPLICA_GROUP`` (0..R-1), the lighthouse at ``$TORCHFT_LIGHTHOUSE``
  (``torchft_lighthouse``; docs/reliability.md shows the commands).

**The batch.** ``--global-batch-tokens`` is the global batch with every group live: each group
takes ``1/R`` of it per step (``--micro-batch`` × grad_acc × ``--nproc`` sequences, grad_acc from
guide §6.1 over R × ``--nproc`` ranks). Group batch ``b`` is the run's ``b``-th slice of that size
of the data stream (:mod:`zerodp.train.data`: samples ``[b·B, (b+1)·B)``), and a group takes
``b = ReplicaGroups.batch_index()``: with every group live, step ``s`` reads exactly the samples
a plain run on R × ``--nproc`` ranks reads at step ``s``; with a group down, the step commits the
live groups' share (the global batch shrinks, the mean divides by the live count) and the next
step goes on from there — over the committed steps every sample is read once, none skipped.

What a rank logs (one JSON line per step, ``OUT/ft-logs/g<group>-r<rank>-a<attempt>.jsonl``):
the step, whether it committed, the groups that took part, the group batch, the group's mean
loss, the learning rate, the step's time, the quorum's time, a heal, the validation loss on the
``--eval-every`` interval. At the end every rank of group 0 writes the checkpoint of the last
step into ``OUT/checkpoints`` (``zerodp sample OUT`` reads it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

TARGET = "zerodp.ft.app:rank_main"
REPORT_FILE = "ft-report.json"
LOG_DIR = "ft-logs"
PAUSE_ENV = "ZERODP_TEST_FT_PAUSE_S"  # test-only: seconds each rank sleeps after each step


# ---- one rank ---------------------------------------------------------------------------------------
def _build(cfg, mc, replicas):
    import torch

    from zerodp.engine import parallelize
    from zerodp.plan.units import AUTO
    from zerodp.train.model import GPT

    torch.manual_seed(cfg.seed)  # the same initial weights in every group
    model = GPT(mc)
    n_params = model.num_params()
    wd, betas = cfg.weight_decay, (0.9, 0.95)
    engine = parallelize(
        model, optimizer=lambda groups: torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=wd, betas=betas),
        stage=cfg.stage, mixed_precision=cfg.mixed_precision, bucket_mb=cfg.bucket_mb,
        **(dict(profile=cfg.profile, tokens_per_rank=cfg.tokens_per_rank) if cfg.bucket_mb == AUTO else {}),
        units=list(model.blocks) if cfg.stage == 3 else None, max_nonfinite_skips=cfg.max_skipped_steps,
        reduce_dtype=cfg.reduce_dtype, quantize_params=cfg.quantize is not None and cfg.quantize.params,
        quantize_grads=cfg.quantize is not None and cfg.quantize.grads, replicas=replicas,
        outer=cfg.outer())  # --diloco-every H: DiLoCo over the replica groups (docs/diloco.md)
    return engine, n_params


def rank_main(ctx) -> None:
    """One rank of one group (:mod:`zerodp.ft.worker`'s target): train until ``--steps`` steps
    are committed (or the launcher says stop)."""
    import torch
    import torch.distributed as dist

    from zerodp.ft.replicas import ReplicaGroups
    from zerodp.ft.trainer import digest
    from zerodp.train.config import TrainConfig
    from zerodp.train.data import Sharding, TrainStream
    from zerodp.train.loop import RankContext, evaluate, lr_at, prepare, set_lr

    cfg = TrainConfig.from_dict(ctx.args["config"])
    groups, g = ctx.groups, ctx.world_size
    corpus, mc, plan, train_w, val_w = prepare(cfg, groups * g)
    stream = TrainStream(train_w, Sharding(plan.micro_batch, plan.grad_acc, g), cfg.seed)
    rctx = RankContext(ctx.rank, g, ctx.rank, torch.device("cpu"))
    # jobs started apart (under torchrun) wait for each other at the first step; a restarted one heals
    replicas = ReplicaGroups(ctx.group, groups, ctx.lighthouse, timeout_s=min(cfg.timeout_s, 60.0),
                             quorum_timeout_s=cfg.timeout_s, start_groups=groups if ctx.attempt == 0 else None)
    engine, n_params = _build(cfg, mc, replicas)
    replicas.attach(engine)
    group_batch = plan.micro_batch * plan.grad_acc * g
    ctx.log(event="start", pid=os.getpid(), params=n_params, grad_acc=plan.grad_acc, group_batch=group_batch,
            seq_len=cfg.seq_len, corpus=corpus.name)
    ctx.barrier()
    t_start = time.time()
    pause = float(os.environ.get(PAUSE_ENV, "0"))  # tests: stretch the run so that a kill lands mid-run
    try:
        while replicas.step < cfg.steps and not ctx.stopped(replicas.step):
            t0 = time.perf_counter()
            heals = replicas.heals
            replicas.start_step()  # the quorum; a group that is behind heals here
            step = replicas.step
            if step >= cfg.steps:  # healed to the end of the run
                break
            index, first = replicas.batch_index(), replicas.batches_committed
            lr = lr_at(step, cfg)
            set_lr(engine, lr)
            loss_sum = torch.zeros((), dtype=torch.float64)
            for micro in range(plan.grad_acc):
                x, y = stream.micro_batch(index, micro, ctx.rank)
                with engine.no_sync(micro < plan.grad_acc - 1):
                    loss = engine(x, y) / plan.grad_acc
                    loss.backward()
                loss_sum += loss.detach().double()
            engine.clip_grad_norm_(cfg.clip)
            before = replicas.commits
            engine.step()  # applied only if the quorum commits
            engine.zero_grad()
            committed = replicas.commits > before
            if not replicas.commits and replicas.participants < groups:  # the start: not every group is here
                if time.time() - t_start > cfg.timeout_s:
                    raise RuntimeError(f"only {replicas.participants} of {groups} replica groups joined within "
                                       f"--timeout-s {cfg.timeout_s:g} s of the start")
                time.sleep(0.2)
                continue
            dist.all_reduce(loss_sum)  # the group's mean loss
            rec = dict(event="step", step=step, committed=committed, participants=replicas.participants,
                       batch=index if replicas.took_part else None, first=first, loss=float(loss_sum) / g, lr=lr,
                       s=round(time.perf_counter() - t0, 4), quorum_s=round(replicas.last_quorum_s or 0.0, 4),
                       healed=replicas.heals > heals)
            if committed and (step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
                rec["val_loss"] = evaluate(engine, val_w, cfg, rctx)
            if committed and step + 1 == cfg.steps:  # the groups' states, bitwise (equal in every group;
                # under DiLoCo the outer state: each group keeps its own inner optimizer state)
                rec["digest"] = digest(engine, outer=engine.outer is not None)
            ctx.log(**rec)
            if pause:
                time.sleep(pause)
        if ctx.group == 0 and cfg.out and replicas.step >= cfg.steps:
            _save(engine, cfg, mc, corpus, replicas, group_batch)
    finally:
        replicas.shutdown()


def _save(engine, cfg, mc, corpus, replicas, group_batch: int) -> None:
    """The checkpoint of the last step (every rank of group 0), as ``zerodp train`` writes it."""
    from zerodp.train import checkpoint as ckpt
    from zerodp.train.loop import CHECKPOINTS

    step = replicas.step
    consumed = replicas.batches_committed * group_batch
    meta = dict(stage=cfg.stage, mixed_precision=cfg.mixed_precision, model=mc.to_dict(), train=asdict(cfg),
                scalars=engine.checkpoint.scalar_state(),
                data=dict(step=step, samples_consumed=consumed, seed=cfg.seed, corpus=corpus.name, kind=corpus.kind,
                          epoch=consumed / max(1, (corpus.train.size - 1) // cfg.seq_len)))
    ckpt.save(engine.checkpoint.state_pieces(), Path(cfg.out) / CHECKPOINTS, step, meta, keep=cfg.keep_checkpoints)


# ---- the local launcher -------------------------------------------------------------------------------
#: a rank's status when a stop signal ended it (zerodp.train.stop's replica-group rule: 128 + the signal)
_SIGNALLED = (128 + signal.SIGTERM, 128 + signal.SIGINT)


def _group_state(procs) -> str:
    """``running``, ``done`` (every rank ended with 0), ``killed`` (a rank ended by a signal: killed,
    or stopped by SIGTERM/SIGINT) or ``failed`` (a rank ended with an error, none by a signal)."""
    codes = [p.poll() for p in procs]
    if any(c is not None and (c < 0 or c in _SIGNALLED) for c in codes):
        return "killed"
    if any(c is not None and c > 0 for c in codes):
        return "failed"
    return "done" if all(c == 0 for c in codes) else "running"


def _last_error(log_dir: Path, group: int, attempt: int) -> str:
    """The last line of a failed rank's error output (its exception), for the one-line message."""
    for path in sorted(log_dir.glob(f"g{group}-r*-a{attempt}.err")):
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
        if lines:
            return f"rank {path.stem.split('-')[1][1:]}: {lines[-1].strip()}"
    return "no error output"


def run_local(cfg, say=print) -> int:
    """Start the lighthouse and the groups here, restart a killed group, print progress, report."""
    from zerodp.ft.launch import LocalGroups
    from zerodp.ft.replicas import _torchft
    from zerodp.train.loop import prepare

    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse's per-quorum INFO lines (before torchft loads)
    _torchft()
    groups, g = cfg.replica_groups, cfg.nproc
    corpus, mc, plan, _, _ = prepare(cfg, groups * g)  # bad input: one line, before any process starts
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / LOG_DIR
    step_tokens = plan.global_batch * cfg.seq_len
    c = LocalGroups(TARGET, groups, g, dict(config=json.loads(json.dumps(asdict(cfg), default=str)),
                                            timeout_s=cfg.timeout_s), log_dir)
    say(f"replica groups: lighthouse {c.address}; {groups} groups x {g} ranks, each a job of its own | model "
        f"{cfg.preset}, stage {cfg.stage} in a group | global batch {plan.global_batch} x {cfg.seq_len} tokens = "
        f"{plan.micro_batch} micro x {plan.grad_acc} grad_acc x {g} ranks x {groups} groups | logs {log_dir}",
        flush=True)
    every = cfg.progress_every or max(1, cfg.steps // 20)
    restarts = dict.fromkeys(range(groups), 0)
    down: set[int] = set()  # groups ended for good (killed, no restart left)
    seen_heals: set[tuple[int, int]] = set()
    shown = -1
    t0 = time.time()
    try:
        c.start_all()
        while True:
            time.sleep(0.25)
            recs = [r for r in c.records(rank=0) if r.get("event") == "step"]
            for r in recs:
                if r["healed"] and (r["group"], r["attempt"]) not in seen_heals:
                    seen_heals.add((r["group"], r["attempt"]))
                    say(f"group {r['group']} healed from a live peer at step {r['step'] + 1} and steps on with "
                        f"{r['participants']} groups", flush=True)
            done = {}
            for r in recs:
                if r["committed"]:
                    done.setdefault(r["step"], []).append(r)
            for s in sorted(x for x in done if x > shown):
                if (s + 1) % every == 0 or s + 1 == cfg.steps or any("val_loss" in r for r in done[s]):
                    rows = done[s]
                    val = [r["val_loss"] for r in rows if "val_loss" in r]
                    say(f"step {s + 1}/{cfg.steps}  loss {sum(r['loss'] for r in rows) / len(rows):.4f}"
                        + (f"  val {val[0]:.4f}" if val else "")
                        + f"  groups {rows[0]['participants']}/{groups}  {max(r['s'] for r in rows) * 1e3:.0f} ms",
                        flush=True)
                    shown = s
            states = {k: _group_state(c.procs[k]) for k in range(groups)}
            for k, state in states.items():
                if state == "failed":
                    raise RuntimeError(f"group {k} failed: {_last_error(log_dir, k, c.attempts[k])}")
                if state == "killed" and k not in down:
                    c.end([k])  # its other ranks, as torchrun's agent ends the job: each ends at once
                    finished = any(v == "done" for v in states.values())
                    if restarts[k] < cfg.max_restarts and not finished:
                        restarts[k] += 1
                        say(f"group {k}: a rank was killed; starting the group again "
                            f"({restarts[k]}/{cfg.max_restarts}); it heals from a live peer", flush=True)
                        c.start(k)
                    else:
                        down.add(k)
                        say(f"group {k}: a rank was killed; the group stays down "
                            f"({'the run has ended' if finished else '--max-restarts ' + str(cfg.max_restarts)})",
                            flush=True)
            if len(down) == groups:
                raise RuntimeError("every replica group is down: there is no live peer to heal from (restart "
                                   "from a checkpoint, or raise --max-restarts)")
            if all(states[k] == "done" or k in down for k in range(groups)):
                break
    except KeyboardInterrupt as e:  # a stop signal to this process (_Stop) or a Ctrl-C
        sig = getattr(e, "sig", signal.SIGINT)
        for s in (signal.SIGTERM, signal.SIGINT):  # a repeat while the groups end changes nothing
            signal.signal(s, signal.SIG_IGN)
        c.end(sig=sig)  # every rank ends at once, each with its line
        steps = {r["step"] for r in c.records(rank=0) if r.get("event") == "step" and r["committed"]}
        say(f"\nzerodp train: stopped on {sig.name} after {len(steps)} committed steps: every replica group was "
            "ended, so no live group is left to heal from; a replica-group run writes its checkpoint only after its "
            f"last step (--resume does not run with --replica-groups); logs in {log_dir}", file=sys.stderr)
        return 128 + sig
    except RuntimeError as e:
        say(f"zerodp train: error: {e}; logs in {log_dir}", file=sys.stderr)
        return 1
    finally:
        c.close()
    wall = time.time() - t0
    return _report(cfg, c.records(rank=0), out, wall, step_tokens // groups, restarts, say)


def _report(cfg, recs: list[dict], out: Path, wall: float, group_tokens: int, restarts: dict, say) -> int:
    committed: dict[int, list[dict]] = {}
    for r in recs:
        if r.get("event") == "step" and r["committed"]:
            committed.setdefault(r["step"], []).append(r)
    steps = sorted(committed)
    tokens = sum(committed[s][0]["participants"] * group_tokens for s in steps)
    last = committed[steps[-1]] if steps else []
    val = [r["val_loss"] for r in last if "val_loss" in r]
    report = dict(steps=len(steps), groups=cfg.replica_groups, ranks_per_group=cfg.nproc, stage=cfg.stage,
                  committed_tokens=tokens, wall_s=round(wall, 2), committed_tokens_per_s=round(tokens / wall, 1),
                  final_loss=sum(r["loss"] for r in last) / len(last) if last else None,
                  final_val_loss=val[0] if val else None, restarts=restarts,
                  heals=sum(1 for r in recs if r.get("healed")),
                  steps_with_fewer_groups=sum(1 for s in steps if committed[s][0]["participants"] < cfg.replica_groups))
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    say(f"committed {report['steps']} steps ({report['steps_with_fewer_groups']} with fewer than "
        f"{cfg.replica_groups} groups), {tokens:,} tokens in {wall:.1f} s ({report['committed_tokens_per_s']:,.0f} "
        f"tokens/s); {report['heals']} heals; final loss {report['final_loss']:.4f}"
        + (f", val {report['final_val_loss']:.4f}" if val else ""), flush=True)
    say(f"\nrun directory: {out}", file=sys.stderr)
    return 0 if len(steps) == cfg.steps else 1


# ---- under torchrun ---------------------------------------------------------------------------------
class _ClusterContext:
    """A :class:`zerodp.ft.worker.Context` without a local launcher: no start barrier (a group that
    starts late heals at its first quorum), no stop flag; rank 0 prints progress lines and every
    rank logs its records into ``OUT/ft-logs``."""

    def __init__(self, cfg, group: int, lighthouse: str):
        import torch.distributed as dist

        self.group, self.groups, self.lighthouse = group, cfg.replica_groups, lighthouse
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.args = dict(config=json.loads(json.dumps(asdict(cfg), default=str)))
        self.every = cfg.progress_every or max(1, cfg.steps // 20)
        self.steps = cfg.steps
        self.file = None
        if cfg.out:
            d = Path(cfg.out) / LOG_DIR
            d.mkdir(parents=True, exist_ok=True)
            self.file = open(d / f"g{group}-r{self.rank}-a{self.attempt}.jsonl", "a")

    def log(self, **rec) -> None:
        if self.file is not None:
            self.file.write(json.dumps(dict(rec, t=round(time.time(), 4))) + "\n")
            self.file.flush()
        if self.rank == 0 and rec.get("event") == "step" and rec["committed"]:
            s = rec["step"] + 1
            if s % self.every == 0 or s == self.steps or rec["healed"] or "val_loss" in rec:
                print(f"group {self.group}: step {s}/{self.steps}  loss {rec['loss']:.4f}"
                      + (f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else "")
                      + f"  groups {rec['participants']}/{self.groups}" + ("  (healed from a peer)" if rec["healed"]
                                                                           else ""), flush=True)

    def barrier(self) -> None:
        pass

    def stopped(self, step: int) -> bool:
        return False


def run_torchrun(cfg) -> int:
    """One rank of group ``$REPLICA_GROUP`` under torchrun, the lighthouse at ``$TORCHFT_LIGHTHOUSE``."""
    from datetime import timedelta

    import torch.distributed as dist

    from zerodp.ft.replicas import _torchft
    from zerodp.ft.worker import install_stop, run_target

    _torchft()
    group = os.environ.get("REPLICA_GROUP")
    if group is None or not group.isdigit() or not 0 <= int(group) < cfg.replica_groups:
        raise ValueError(f"--replica-groups {cfg.replica_groups} under torchrun: set REPLICA_GROUP to this "
                         f"group's index, 0 to {cfg.replica_groups - 1} (got {group!r})")
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise ValueError("--replica-groups under torchrun: set TORCHFT_LIGHTHOUSE to the lighthouse's address "
                         "(http://HOST:PORT of torchft_lighthouse)")
    # torchrun's agent ends the group with SIGTERM when one of its ranks died: end at once, and the
    # group started again heals from a live one (zerodp.train.stop's replica-group rule)
    install_stop(group, os.environ.get("RANK", "0"))
    # keys under a prefix per torchrun attempt: a restarted group must not read the addresses its
    # dead attempt's ranks listened on (zerodp.train.launch.attempt_store)
    from zerodp.train.launch import attempt_store

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=cfg.timeout_s)
    dist.init_process_group("gloo", store=attempt_store(rank, world, int(os.environ.get(
        "TORCHELASTIC_RESTART_COUNT", "0")), timeout), rank=rank, world_size=world, timeout=timeout)
    try:
        return run_target(rank_main, _ClusterContext(cfg, int(group), lighthouse))
    finally:
        dist.destroy_process_group()


class _Stop(KeyboardInterrupt):
    """SIGTERM or SIGINT to the local launcher: it ends every group (docs/reliability.md)."""

    def __init__(self, sig: signal.Signals):
        super().__init__(sig.name)
        self.sig = sig


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum))


def run(cfg) -> int:
    """``zerodp train --replica-groups R``: locally, or as one rank under torchrun."""
    from zerodp.train.launch import launched_by_torchrun

    if launched_by_torchrun():
        return run_torchrun(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a stop signal ends the local groups, each rank at once
        signal.signal(sig, _raise_stop)
    try:
        return run_local(cfg)
    except _Stop as e:  # before the groups started
        print(f"zerodp train: stopped on {e.sig.name} before the replica groups started", file=sys.stderr)
        return 128 + e.sig
