"""One rank of a replica group started by :class:`zerodp.ft.launch.LocalGroups`.

``python -m zerodp.ft.worker`` reads its place from the environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of its group's own rendezvous, ``ZERODP_FT_GROUP``,
``ZERODP_FT_GROUPS``, ``ZERODP_FT_ATTEMPT``, ``TORCHFT_LIGHTHOUSE``, the launcher's store
``ZERODP_FT_STORE``), joins its group's gloo process group, and calls the target
``ZERODP_FT_TARGET`` (``module:function``) with a :class:`Context`.
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


def main() -> int:
    import torch.distributed as dist
    from torch.distributed import TCPStore

    env = os.environ
    host, port = env["ZERODP_FT_STORE"].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    ctx = Context(group=int(env["ZERODP_FT_GROUP"]), groups=int(env["ZERODP_FT_GROUPS"]), rank=int(env["RANK"]),
                  world_size=int(env["WORLD_SIZE"]), attempt=int(env["ZERODP_FT_ATTEMPT"]),
                  lighthouse=env["TORCHFT_LIGHTHOUSE"], args=json.loads(env.get("ZERODP_FT_ARGS", "{}")),
                  store=store)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(ctx.args.get("timeout_s", 60))))
    module, _, name = env["ZERODP_FT_TARGET"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        fn(ctx)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
