"""Run one function on N local ranks of a fresh process group, and bring back what each returned.

Tests, benchmarks and examples need "start N ranks, run this, give me the results" without
``torchrun``. Each rank is a fresh process — forked from a server that imported torch once, where
the platform has one (a rank starts in milliseconds instead of the seconds an import takes), else
spawned — with the caller's environment as it is at the call, ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, one intra-op thread (so N ranks share the cores
fairly), and an initialized default process group (gloo unless told otherwise).

No hangs: the parent waits at most ``timeout`` seconds in all; if any rank fails, the others
are given ``grace`` seconds to finish and are then killed, and one error names every rank that
failed with its traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or ran past the time limit."""


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    world_size: int
    port: int
    backend: str
    threads: int
    pg_timeout_s: float
    env: dict
    environ: dict  # the caller's os.environ at the call (a fork server's is that of its start)


_KILLED = " was killed by SIGKILL"


def _death(rank: int, exitcode: int) -> str:
    """Why a rank that reported nothing ended: SIGKILL from outside is, on a machine that ran out
    of memory, the kernel's out-of-memory killer."""
    if exitcode == -9:
        return (f"rank {rank}{_KILLED}, most likely by the kernel's out-of-memory "
                "killer (the machine ran out of memory; `dmesg` says so): use a smaller model or fewer ranks")
    return f"rank {rank} died with exit code {exitcode} and no traceback"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is the engine's ``CollectiveTimeout``: its process
    groups hold a collective that never completes, and are left to the process's exit."""
    from zerodp.engine.comm import CollectiveTimeout

    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, CollectiveTimeout):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


#: What the fork server imports once for every rank it starts (set before its first start).
PRELOAD = ("torch", "torch.distributed")


def _context() -> "mp.context.BaseContext":
    """Fork server where the platform has one (Linux, macOS), else spawn: both start each rank
    with a fresh interpreter state, and neither inherits a CUDA context from the caller."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return mp.get_context("spawn")


def _rank_main(job: _Job, rank: int, results: "mp.Queue") -> None:
    os.environ.clear()
    os.environ.update(job.environ)
    os.environ.update(job.env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(job.world_size),
        LOCAL_WORLD_SIZE=str(job.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(job.threads)
        dist.init_process_group(
            job.backend,
            rank=rank,
            world_size=job.world_size,
            timeout=datetime.timedelta(seconds=job.pg_timeout_s),
        )
        try:
            out = job.fn(rank, job.world_size, *job.args)
        except BaseException as e:
            if not _collective_failed(e):  # else destroying would wait for the collective that never ends
                dist.destroy_process_group()
            raise
        dist.destroy_process_group()
        # Pickled here, by value: a tensor sent through the queue as-is would live in this
        # process's shared memory, which is gone once it exits.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    grace: float = 10.0,
    threads: int = 1,
    env: dict | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises :class:`RankFailure`
    with every failing rank's traceback if any rank raises, exits without a result, or the whole
    job exceeds ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    job = _Job(fn, tuple(args), world_size, free_port(), backend, threads,
               pg_timeout_s=max(30.0, timeout), env=dict(env or {}), environ=dict(os.environ))
    procs = [ctx.Process(target=_rank_main, args=(job, r, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()

    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_error_at: float | None = None
    while len(outputs) + len(errors) < world_size:
        now = time.monotonic()
        limit = deadline if first_error_at is None else min(deadline, first_error_at + grace)
        if now >= limit:
            break
        try:
            rank, ok, payload = results.get(timeout=min(0.2, limit - now))
        except queue.Empty:
            # A rank that died without reporting (segfault, os._exit, OOM kill).
            for r, p in enumerate(procs):
                if r not in outputs and r not in errors and not p.is_alive() and p.exitcode not in (None, 0):
                    errors[r] = _death(r, p.exitcode)
                    first_error_at = first_error_at or time.monotonic()
            continue
        if ok:
            outputs[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            first_error_at = first_error_at or time.monotonic()

    for r, p in enumerate(procs):
        p.join(timeout=0.5 if (errors or r not in outputs) else 5.0)
        if p.is_alive():
            p.kill()
            p.join()
            if r not in outputs and r not in errors:
                errors[r] = (f"rank {r} did not finish within {timeout:.0f}s"
                             + (" (killed after another rank failed)" if first_error_at else ""))
    if errors:
        killed = [r for r in sorted(errors) if _KILLED in errors[r].split(",")[0]]
        if killed:  # the cause: the others only lost their peer ("Connection reset by peer")
            raise RankFailure(f"{errors[killed[0]]}; the other ranks stopped because their peer was gone")
        text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [outputs[r] for r in range(world_size)]
