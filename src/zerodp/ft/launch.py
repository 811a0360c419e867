"""A torchft lighthouse and R replica groups of g local ranks, each group a job of its own.

For demos, tests and the chaos schedule on one machine (a cluster runs one ``torchrun`` per group
instead, docs/reliability.md). :class:`LocalGroups` starts the lighthouse in this process and each
group's ranks as processes with the group's own rendezvous (``MASTER_ADDR``/``MASTER_PORT`` of its
own: a group that dies takes no other group's store with it); kills a group (SIGKILL to each of
its ranks) and starts it again; ends a group as torchrun's agent ends a job (:meth:`LocalGroups.end`:
SIGTERM, and SIGKILL past a few seconds). Each rank runs ``python -m zerodp.ft.worker`` with a target
function (``module:function``) and its JSON arguments; what the rank logs
(:meth:`zerodp.ft.worker.Context.log`) goes, one JSON object per line, to
``<log_dir>/g<group>-r<rank>-a<attempt>.jsonl``, read back by :meth:`LocalGroups.records`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from zerodp.spawn import free_port

#: how long :meth:`LocalGroups.end` waits for a signalled rank before it SIGKILLs it
END_GRACE_S = 5.0


class LocalGroups:
    """R groups of g ranks on this machine, coordinated by a lighthouse run here."""

    def __init__(self, target: str, groups: int, ranks: int, args: dict, log_dir: str | os.PathLike, *,
                 heartbeat_timeout_ms: int = 1000, join_timeout_ms: int = 100, env: dict | None = None):
        from torch.distributed import TCPStore

        os.environ.setdefault("RUST_LOG", "error")  # the lighthouse's per-quorum INFO lines
        from torchft.coordination import LighthouseServer

        self.target, self.groups, self.ranks, self.args = target, groups, ranks, dict(args)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms,
                                           heartbeat_timeout_ms=heartbeat_timeout_ms)
        # The launcher's own store: the first launch's start barrier (every group's managers
        # heartbeat before the first quorum) and the stop flag. No quorum is formed here.
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.env = dict(env or {})
        self.procs: dict[int, list[subprocess.Popen]] = {}
        self.attempts = {g: -1 for g in range(groups)}
        self.started_at: dict[int, float] = {}
        self.killed_at: dict[int, float] = {}

    @property
    def address(self) -> str:
        return self.lighthouse.address()

    def start(self, group: int) -> None:
        """Start (or start again) every rank of ``group``, with a rendezvous of its own."""
        self.attempts[group] += 1
        attempt = self.attempts[group]
        port = free_port()
        procs = []
        for rank in range(self.ranks):
            env = dict(os.environ, **self.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks),
                       LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       TORCHFT_LIGHTHOUSE=self.address, ZERODP_FT_GROUP=str(group),
                       ZERODP_FT_GROUPS=str(self.groups), ZERODP_FT_ATTEMPT=str(attempt),
                       ZERODP_FT_STORE=f"127.0.0.1:{self.store.port}", ZERODP_FT_TARGET=self.target,
                       ZERODP_FT_ARGS=json.dumps(self.args), OMP_NUM_THREADS="1",
                       RUST_LOG=os.environ.get("RUST_LOG", "error"), PYTHONUNBUFFERED="1")
            out = open(self.log_dir / f"g{group}-r{rank}-a{attempt}.jsonl", "w")
            err = open(self.log_dir / f"g{group}-r{rank}-a{attempt}.err", "w")
            procs.append(subprocess.Popen([sys.executable, "-m", "zerodp.ft.worker"], env=env, stdout=out,
                                          stderr=err, start_new_session=True))
            out.close()
            err.close()
        self.procs[group] = procs
        self.started_at[group] = time.time()

    def start_all(self) -> None:
        for g in range(self.groups):
            self.start(g)

    def kill(self, group: int, ranks: list[int] | None = None) -> None:
        """SIGKILL the ranks of ``group`` (all by default) and reap them."""
        self.killed_at[group] = time.time()
        for r, p in enumerate(self.procs.get(group, [])):
            if (ranks is None or r in ranks) and p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for r, p in enumerate(self.procs.get(group, [])):
            if ranks is None or r in ranks:
                p.wait()

    def end(self, groups: list[int] | None = None, sig: int = signal.SIGTERM, grace_s: float = END_GRACE_S) -> None:
        """End the live ranks of ``groups`` (all by default) as torchrun's agent ends a job: ``sig``,
        then SIGKILL whatever is left after ``grace_s``. A rank of a replica group ends at once on
        it, with one line (:mod:`zerodp.train.stop`'s replica-group rule)."""
        procs = [p for g in (self.procs if groups is None else groups) for p in self.procs.get(g, [])]
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.time() + grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def alive(self, group: int) -> bool:
        return any(p.poll() is None for p in self.procs.get(group, []))

    def records(self, group: int | None = None, rank: int | None = None) -> list[dict]:
        """Every logged record (with ``group``, ``rank``, ``attempt``), in log order per file."""
        out = []
        for path in sorted(self.log_dir.glob("g*-r*-a*.jsonl")):
            g, r, a = (int(part[1:]) for part in path.stem.split("-"))
            if (group is not None and g != group) or (rank is not None and r != rank):
                continue
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a SIGKILL
                out.append(dict(rec, group=g, rank=r, attempt=a))
        return out

    def errors(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.err"))
                         if p.read_text().strip())

    def wait_for(self, predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> None:
        """Wait until ``predicate()`` holds; a rank that ended with an error status fails it."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if predicate():
                return
            failed = [(g, r, p.returncode) for g, ps in self.procs.items() for r, p in enumerate(ps)
                      if p.returncode not in (None, 0, -signal.SIGKILL)]
            if failed:
                raise RuntimeError(f"waiting for {what}: ranks ended with errors {failed}\n{self.errors()}")
            time.sleep(poll_s)
        raise TimeoutError(f"waiting for {what}: not within {timeout_s:.0f} s\n{self.errors()}")

    def stop(self, timeout_s: float = 60.0, margin: int = 2) -> list[int]:
        """Ask every rank to stop at the same committed step (``margin`` past the furthest logged),
        wait for them, end the lighthouse; the exit codes."""
        steps = [r["step"] for r in self.records() if r.get("committed")]
        self.store.set("stop_at", str(max(steps, default=0) + margin))
        deadline = time.time() + timeout_s
        codes = []
        for ps in self.procs.values():
            for p in ps:
                try:
                    codes.append(p.wait(max(0.1, deadline - time.time())))
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes.append(p.wait())
        self._shutdown_lighthouse()
        return codes

    def _shutdown_lighthouse(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None

    def close(self) -> None:
        for ps in self.procs.values():
            for p in ps:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self._shutdown_lighthouse()
