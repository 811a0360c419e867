"""One rank of a replica group started by :class:`zerodp.ft.launch.LocalGroups`.

``python -m zerodp.ft.worker`` reads its place from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of its group's own rendezvous, ``ZERODP_FT_GROUP``,
``ZERODP_FT_GROUPS``, ``ZERODP_FT_ATTEMPT``, ``TORCHFT_LIGHTHOUSE``, the launcher's store
``ZERODP_FT_STORE``), joins its group's gloo process group, and calls the target
``ZERODP_FT_TARGET`` (``module:function``) with a :class:`Context`. A stop signal ends it at once
(:func:`install_stop`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta


@dataclass
class Context:
    """What a target function gets: its place, its arguments, the launcher's store."""

    group: int
    groups: int
    rank: int
    world_size: int
    attempt: int
    lighthouse: str
    args: dict
    store: object = field(repr=False)

    def log(self, **record) -> None:
        """One JSON line to this rank's log (read back by LocalGroups.records)."""
        print(json.dumps(dict(record, t=round(time.time(), 4))), flush=True)

    def barrier(self, timeout_s: float = 120.0) -> None:
        """The first launch's start barrier: every rank of every group arrives (after building
        its torchft manager, so that the first quorum holds every group). A group started again
        after a failure skips it and joins the running quorum."""
        if self.attempt > 0:
            return
        self.store.add("ready", 1)
        deadline = time.time() + timeout_s
        while int(self.store.add("ready", 0)) < self.groups * self.world_size:
            if time.time() > deadline:
                raise TimeoutError("the start barrier: not every group's ranks arrived")
            time.sleep(0.02)

    def stopped(self, step: int) -> bool:
        """The launcher asked every rank to stop at committed step ``stop_at`` (a step number, so
        that every rank of every group stops after the same step)."""
        return self.store.check(["stop_at"]) and step >= int(self.store.get("stop_at"))


def install_stop(group: int | str, rank: int | str):
    """A replica-group rank's stop rule (:mod:`zerodp.train.stop`, ``saves=False``): SIGTERM or
    SIGINT ends it at once, with one line and the status 128 + the signal — the group's state
    lives in the live groups, and a group started again heals from one."""
    from zerodp.train import stop

    return stop.install(int(rank), stop.DEFAULT_GRACE_S, saves=False, who=f"group {group} rank {rank}")


#: what torchft's manager client says when the group's manager server (on the group's rank 0) is gone
_MANAGER_GONE = ("transport error", "tcp connect error")


def run_target(fn, ctx) -> int:
    """``fn(ctx)``; a collective or a quorum call that failed because a peer died or stalled (a rank
    of this group, the torchft manager server on its rank 0, the launcher's store) ends the rank
    with one line instead of a traceback (status 1): the group ends and, started again, heals from a
    live group. Any other error is raised as it is."""
    try:
        fn(ctx)
    except Exception as exc:
        from zerodp.train.watchdog import is_collective_error

        text = str(exc).lower()
        if not (is_collective_error(exc) or (isinstance(exc, RuntimeError) and any(m in text for m in _MANAGER_GONE))):
            raise
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:240]
        print(f"zerodp: group {ctx.group} rank {ctx.rank}: a collective failed: a peer died or stopped answering "
              f"(the backend said: {said}); this group ends, and started again it heals from a live group",
              file=sys.stderr, flush=True)
        return 1
    return 0


def main() -> int:
    env = os.environ
    install_stop(env["ZERODP_FT_GROUP"], env["RANK"])  # first: before the imports that take seconds

    import torch.distributed as dist
    from torch.distributed import TCPStore

    host, port = env["ZERODP_FT_STORE"].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    ctx = Context(group=int(env["ZERODP_FT_GROUP"]), groups=int(env["ZERODP_FT_GROUPS"]), rank=int(env["RANK"]),
                  world_size=int(env["WORLD_SIZE"]), attempt=int(env["ZERODP_FT_ATTEMPT"]),
                  lighthouse=env["TORCHFT_LIGHTHOUSE"], args=json.loads(env.get("ZERODP_FT_ARGS", "{}")),
                  store=store)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(ctx.args.get("timeout_s", 60))))
    module, _, name = env["ZERODP_FT_TARGET"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    code = run_target(fn, ctx)
    if code:
        # a peer died: the group ends now, with its one line last — no exit handler (the engine's
        # serving of calls made alone, the process group's teardown) writes to the dead peer's store
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
