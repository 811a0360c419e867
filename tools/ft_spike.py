"""Spike: torchft's lighthouse and two replica groups of one rank each, one SIGKILLed mid-run.

    RUST_LOG=error python tools/ft_spike.py   # each group's steps; exit 0 when the survivor
                                              # went on alone and the restarted group healed

The parent starts a torchft ``LighthouseServer`` in-process and two groups as separate processes,
each with its own TCPStore (its own rendezvous), a ``torchft.Manager`` and a reconfigurable
``ProcessGroupGloo``. Each step: ``start_quorum``, a gradient of a seeded batch, ``allreduce``
through the manager (the average over the live groups), and the optimizer step only if
``should_commit``. Group 1 is SIGKILLed after step 8; group 0 must commit steps alone
(participants 1); group 1 is started again, heals from group 0 (torchft's HTTP checkpoint
transport) and both end with equal parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

STEPS = 1000
GROUPS = 2


def group_main(group: int, lighthouse: str, steps: int, start_port: int) -> None:
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    def load(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                      replica_id=f"group{group}", store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse, use_async_quorum=False,
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=10))
    # a start barrier in the launcher's store: every group's manager heartbeats before the first
    # quorum, so the first quorum holds them all (a group started later heals instead)
    start = dist.TCPStore("localhost", start_port, is_master=False)
    if start.add(f"restarts{group}", 0) == 0:
        start.add("started", 1)
        while int(start.add("started", 0)) < GROUPS:
            time.sleep(0.05)
    try:
        while manager.current_step() < steps and not start.check(["stop"]):
            t0 = time.perf_counter()
            manager.start_quorum()
            step = manager.current_step()
            g = torch.Generator().manual_seed(1000 * step + group)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():
                manager.allreduce(p.grad).wait()
            ok = manager.should_commit()
            if ok:
                opt.step()
            print(json.dumps(dict(group=group, step=step, committed=ok,
                                  participants=manager.num_participants(),
                                  s=round(time.perf_counter() - t0, 3),
                                  w=[round(v, 6) for v in model.weight.flatten().tolist()])),
                  flush=True)
            time.sleep(0.1)
    finally:
        manager.shutdown(wait=False)


def main() -> int:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                                  heartbeat_timeout_ms=2000)
    addr = lighthouse.address()
    import torch.distributed as dist
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def start(group):
        return subprocess.Popen([sys.executable, __file__, "--group", str(group), addr, str(STEPS),
                                 str(store.port)],
                                stdout=subprocess.PIPE, text=True, env=env)

    procs = {0: start(0), 1: start(1)}
    log: list[dict] = []
    killed_at = restarted = None
    os.set_blocking(procs[0].stdout.fileno(), False)
    os.set_blocking(procs[1].stdout.fileno(), False)
    deadline = time.time() + 180
    while time.time() < deadline:
        for gid, p in list(procs.items()):
            for line in iter(p.stdout.readline, ""):
                rec = json.loads(line)
                log.append(rec)
                print(line.strip(), flush=True)
                if gid == 1 and killed_at is None and rec["step"] >= 8 and rec["participants"] == 2:
                    p.send_signal(signal.SIGKILL)
                    killed_at = rec["step"]
                    print(f"--- SIGKILL group 1 after its step {rec['step']}", flush=True)
                    break
        if killed_at is not None and not restarted and procs[1].poll() is not None:
            alone = [r for r in log if r["group"] == 0 and r["participants"] == 1 and r["committed"]
                     and r["step"] > killed_at]
            if len(alone) >= 5:
                store.add("restarts1", 1)
                print("--- group 0 committed 5 steps alone; restarting group 1", flush=True)
                procs[1] = start(1)
                os.set_blocking(procs[1].stdout.fileno(), False)
                restarted = True
        if restarted:
            both = _paired(log, killed_at)
            if len(both) >= 5 and not store.check(["stop"]):
                store.set("stop", "1")
        if restarted and all(p.poll() is not None for p in procs.values()):
            for p in procs.values():
                os.set_blocking(p.stdout.fileno(), True)
                for line in p.stdout:
                    log.append(json.loads(line))
                    print(line.strip())
            break
        time.sleep(0.05)
    lighthouse.shutdown()
    alone = [r for r in log if r["group"] == 0 and r["participants"] == 1 and r["committed"]
             and r["step"] > killed_at]
    both = _paired(log, killed_at)
    same = all(a["w"] == b["w"] for a, b in both)
    stall = max((r["s"] for r in log if r["group"] == 0), default=0)
    ok = len(alone) >= 5 and len(both) >= 5 and same
    print(f"survivor committed {len(alone)} steps alone (longest step {stall} s, the quorum after "
          f"the kill); after the heal both groups committed steps {[a['step'] for a, _ in both]} "
          f"with 2 participants, parameters equal: {same}; {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _paired(log, killed_at):
    """(group 0's record, group 1's record) of each step both committed with 2 participants
    after the kill."""
    by = {}
    for r in log:
        if r["committed"] and r["participants"] == 2 and r["step"] > killed_at:
            by.setdefault(r["step"], {})[r["group"]] = r
    return [(v[0], v[1]) for _, v in sorted(by.items()) if len(v) == 2]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--group":
        group_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit(main())
