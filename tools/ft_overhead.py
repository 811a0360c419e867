"""Fault-free overhead of the managed path (zerodp.ft over torchft) against plain hybrid sharding.

    python tools/ft_overhead.py [--preset tiny] [--rows 2] [--stage 1] [--turns 8] [--steps 20]

Both paths in the same four processes, in interleaved turns, so that the machine's load, the
caches and the processes' start-up are the same for both:

* **plain**: one engine over the 4-rank job with ``shard_size=2`` — ZeRO inside 2 shard groups of 2
  ranks, the replica AllReduce in a gloo subgroup of the job (hybrid sharding, guide §14);
* **managed**: a second engine (the same model and seed) over this rank's 2-rank group with
  ``replicas=ReplicaGroups(...)``: each group's own store, torchft's lighthouse (in rank 0), a
  ``torchft.Manager`` per rank, the quorum (``start_step``), the replica AllReduce through
  torchft's managed gloo process group and ``should_commit`` every step.

After ``--warmup`` steps of each, ``--turns`` rounds of ``--steps`` steps per path, the order
rotating (plain-managed, managed-plain, ...); on a loaded machine ``--steps 1`` with many rounds
pairs each managed step with a plain one taken a moment apart, under the same load. A step is
timed on rank 0 from its start (the quorum, for the managed path) to ``zero_grad``'s end, after a
barrier of the whole job. Printed:
each turn's median step time, the ratio managed / plain per round (the median over the round's two
turns of each), the median of the rounds' ratios with its interquartile range and extremes, the
absolute difference of the medians in ms, and where the managed step's extra time goes: the
quorum (its start and the wait for it — with the quorum behind the forward, that wait is inside the
first AllReduce, which counts it too), the cross-group AllReduce(s) through torchft,
``should_commit`` (medians per step). ``--sync-quorum``: the managed path waits for its quorum in
``start_step``, before the forward (``ReplicaGroups(overlap_quorum=False)``).
"""

from __future__ import annotations

import argparse
import statistics
import time


def _quantiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[0], q[1], q[2]


def _rank(rank, world, preset, stage, rows, warmup, turns, steps, via, overlap):
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    os.environ.setdefault("RUST_LOG", "error")
    import zerodp
    from zerodp.ft.replicas import ReplicaGroups
    from zerodp.ft.trainer import batch
    from zerodp.spawn import free_port
    from zerodp.train.model import GPT, PRESETS

    cfg = PRESETS[preset]
    g, me = rank // 2, rank % 2
    lighthouse = None
    if rank == 0:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    # the managed path's per-group stores (torchft's managed process groups meet there)
    ports = [free_port() if me == 0 else None]
    box = [None] * world
    dist.all_gather_object(box, (lighthouse.address() if lighthouse else None, ports[0]))
    address, store_port = box[0][0], box[2 * g][1]
    if me == 0:
        group_store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
    jobs = [dist.new_group([0, 1]), dist.new_group([2, 3])]

    def opt(groups):
        return torch.optim.AdamW(groups, lr=1e-3)

    torch.manual_seed(0)
    plain = zerodp.parallelize(GPT(cfg), optimizer=opt, stage=stage, shard_size=2)
    replicas = ReplicaGroups(g, 2, address, rank=me, world_size=2, store_addr="127.0.0.1", store_port=store_port,
                             timeout_s=60, quorum_timeout_s=120, overlap_quorum=overlap)
    torch.manual_seed(0)
    managed = zerodp.parallelize(GPT(cfg), optimizer=opt, stage=stage, group=jobs[g], replicas=replicas)
    replicas.attach(managed)

    # time inside the managed step: the torchft AllReduce(s) and should_commit
    parts = {"allreduce": 0.0, "commit": 0.0, "plain_allreduce": 0.0}
    inner_reduce, inner_commit = replicas.all_reduce_mean, replicas.should_commit

    def timed_reduce(*a, **k):
        t = time.perf_counter()
        inner_reduce(*a, **k)
        parts["allreduce"] += time.perf_counter() - t

    def timed_commit():
        t = time.perf_counter()
        ok = inner_commit()
        parts["commit"] += time.perf_counter() - t
        return ok

    replicas.all_reduce_mean, replicas.should_commit = timed_reduce, timed_commit
    plain_reduce = plain.replica_comm.all_reduce_mean  # the plain path's cross-group AllReduce, timed too

    def timed_plain_reduce(*a, **k):
        t = time.perf_counter()
        out = plain_reduce(*a, **k)
        parts["plain_allreduce"] += time.perf_counter() - t
        return out

    plain.replica_comm.all_reduce_mean = timed_plain_reduce
    counter = {"plain": 0}

    def step_plain():
        k = counter["plain"]
        counter["plain"] += 1
        parts["plain_allreduce"] = 0.0
        t0 = time.perf_counter()
        x, y = batch(2 * k + g, rows * 2, cfg.seq_len, cfg.vocab_size)
        mine = slice(me * rows, (me + 1) * rows)
        F.cross_entropy(plain(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
        plain.step()
        plain.zero_grad()
        return dict(s=time.perf_counter() - t0, allreduce=parts["plain_allreduce"])

    def step_managed():
        parts["allreduce"] = parts["commit"] = 0.0
        t0 = time.perf_counter()
        replicas.start_step()
        x, y = batch(replicas.batch_index(), rows * 2, cfg.seq_len, cfg.vocab_size)
        mine = slice(me * rows, (me + 1) * rows)
        F.cross_entropy(managed(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
        before = replicas.commits
        managed.step()
        managed.zero_grad()
        if replicas.commits == before and replicas.commits + replicas.aborted > 1:
            # (the first step of a run does not commit with the quorum behind the forward: zerodp.ft.replicas)
            raise RuntimeError("a fault-free managed step did not commit")
        return dict(s=time.perf_counter() - t0, quorum=replicas.last_quorum_s, allreduce=parts["allreduce"],
                    commit=parts["commit"])

    def turn(fn, n):
        out = []
        for _ in range(n):
            dist.barrier()
            out.append(fn())
        return out

    turn(step_plain, warmup)
    turn(step_managed, warmup)
    def step_via_manager():
        replicas.via_manager = True
        try:
            return step_managed()
        finally:
            replicas.via_manager = False

    result = []
    paths = [("plain", step_plain), ("managed", step_managed)] + ([("via manager", step_via_manager)] if via else [])
    for r in range(turns):
        order = paths[r % len(paths):] + paths[:r % len(paths)]  # each path first in turn
        if (r // len(paths)) % 2:
            order.reverse()
        for name, fn in order:
            result.append((r, name, turn(fn, steps)))
    dist.barrier()
    replicas.shutdown()
    if me == 0:
        del group_store
    if lighthouse is not None:
        lighthouse.shutdown()
    return result if rank == 0 else None


def main(argv=None) -> int:
    from zerodp.spawn import run_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--rows", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--turns", type=int, default=8, help="rounds of one turn per path")
    p.add_argument("--steps", type=int, default=20, help="steps per turn")
    p.add_argument("--via-manager", action="store_true",
                   help="also a third path: the managed one with the cross-group AllReduce through "
                        "torchft.Manager.allreduce (ReplicaGroups.via_manager), not straight on its process group")
    p.add_argument("--sync-quorum", action="store_true",
                   help="the managed path waits for its quorum before the forward "
                        "(ReplicaGroups(overlap_quorum=False)) instead of forming it behind the forward")
    a = p.parse_args(argv)
    res = run_local(_rank, 4, a.preset, a.stage, a.rows, a.warmup, a.turns, a.steps, a.via_manager,
                    not a.sync_quorum, timeout=1800)[0]
    ratios, med = [], {}
    extra: dict[str, dict[str, list]] = {}
    by_round: dict[int, dict[str, float]] = {}
    for r, name, recs in res:
        m = statistics.median(x["s"] for x in recs)
        by_round.setdefault(r, {})[name] = m
        med.setdefault(name, []).extend(x["s"] for x in recs)
        for k in ("quorum", "allreduce", "commit") if name != "plain" else ("allreduce",):
            extra.setdefault(name, {}).setdefault(k, []).extend(x[k] for x in recs)
    print(f"{a.preset}, stage {a.stage}, {a.rows} sequences per rank, 2 groups x 2 ranks; {a.turns} rounds of "
          f"{a.steps} steps per path, interleaved (after {a.warmup} warm-up steps each); the managed path's quorum "
          + ("waited for before the forward" if a.sync_quorum else "formed behind the forward"))
    for r, d in sorted(by_round.items()):
        ratios.append(d["managed"] / d["plain"])
        if len(by_round) <= 12:
            print(f"  round {r}: " + "  ".join(f"{k} {v * 1e3:6.1f} ms" for k, v in d.items())
                  + f"  managed/plain {ratios[-1]:.3f}" + (f"  via manager/plain {d['via manager'] / d['plain']:.3f}"
                                                          if "via manager" in d else ""))
    q1, q2, q3 = _quantiles(ratios)
    mp = statistics.median(med["plain"])
    print(f"managed / plain, the median of the rounds' ratios: {q2:.3f}  interquartile {q1:.3f}-{q3:.3f}  "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
    diffs = [d["managed"] - d["plain"] for d in by_round.values()]
    d1, d2, d3 = _quantiles(diffs)
    print(f"managed - plain, the median of the rounds' differences: {d2 * 1e3:+.1f} ms  interquartile "
          f"{d1 * 1e3:+.1f} to {d3 * 1e3:+.1f} ms")
    if d2 > 0:  # a cost per step whatever the step's size: the step from which it is 2% or less
        print(f"at that cost per step the managed path is within 2% of plain from a {d2 / 0.02 * 1e3:,.0f} ms step "
              f"up ({q2 - 1:+.1%} at this one's {mp * 1e3:.0f} ms)")
    if "via manager" in med:
        v = [d["via manager"] / d["plain"] for d in by_round.values()]
        v1, v2, v3 = _quantiles(v)
        print(f"via manager / plain: {v2:.3f}  interquartile {v1:.3f}-{v3:.3f}  range {min(v):.3f}-{max(v):.3f}")
    for name in med:
        if name == "plain":
            print(f"median step: plain {mp * 1e3:.1f} ms; in it the cross-group AllReduce(s) "
                  f"{statistics.median(extra['plain']['allreduce']) * 1e3:.2f} ms")
            continue
        mm = statistics.median(med[name])
        qm, am, cm = (statistics.median(extra[name][k]) * 1e3 for k in ("quorum", "allreduce", "commit"))
        print(f"median step: {name} {mm * 1e3:.1f} ms ({(mm - mp) * 1e3:+.1f} ms, {(mm / mp - 1) * 100:+.1f}%); in it "
              f"the quorum {qm:.2f} ms, the cross-group AllReduce(s) {am:.2f} ms, should_commit {cm:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
