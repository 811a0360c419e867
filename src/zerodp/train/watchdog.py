"""No hangs: a rank whose peer died or stalled ends within a bounded time, saying so.

Two mechanisms, both set by ``--timeout-s`` (:attr:`TrainConfig.timeout_s`):

1. **Collective timeout.** The process group is created with ``timeout=timeout_s``: a collective
   that waits longer for a peer fails (gloo: "Timed out waiting …"; a peer whose process is gone
   fails it at once: "Connection reset/closed by peer"). :func:`explain` turns such an error from
   deep inside ``torch.distributed`` into a :class:`CollectiveFailure` that names the step, the
   phase and the likely cause, instead of a traceback through the engine's internals.
2. **Watchdog.** A daemon thread that the training loop pets at every phase (each micro-batch,
   the optimizer step, evaluation, checkpoint). If the main thread makes no progress for
   ``WATCHDOG_FACTOR × timeout_s + WATCHDOG_SLACK_S`` — a hang the collective timeout cannot see
   (a stuck data read, a deadlock, a collective that ignores its timeout) — it prints which rank
   is stuck where and ends the process with :data:`WATCHDOG_EXIT_CODE`. The launcher (the elastic
   agent, ``torchrun``) then ends the other ranks, or restarts the group (``--max-restarts``).

The watchdog fires later than the collective timeout on purpose: when a peer stalls, the ranks
waiting for it should report "peer stalled" (their collective timed out) before the stalled rank's
own watchdog reports "I made no progress".
"""

from __future__ import annotations

import os
import sys
import threading
import time

WATCHDOG_EXIT_CODE = 75  # EX_TEMPFAIL: the run may succeed if restarted
WATCHDOG_FACTOR = 1.5
WATCHDOG_SLACK_S = 2.0
# Start-up, loading a checkpoint and evaluation may wait on ranks that start at different times:
# the watchdog allows them more, but still a bounded time.
SLOW_FACTOR = 3.0
SLOW_SLACK_S = 30.0

# What gloo and NCCL say when a peer is gone or too slow (their errors are plain RuntimeErrors).
_TIMEOUT_MARKS = ("timed out", "watchdog caught collective operation timeout")
_PEER_GONE_MARKS = ("connection reset by peer", "connection closed by peer", "connection refused",
                    "broken pipe", "read error", "write error", "ncclremoteerror", "socket closed",
                    "connection closed")


class CollectiveFailure(RuntimeError):
    """A collective could not complete because another rank died or stalled."""


def is_collective_error(exc: BaseException) -> bool:
    """True for the errors a backend raises when a peer is gone or does not answer in time."""
    try:
        import torch.distributed as dist

        if isinstance(exc, getattr(dist, "DistError", ())):
            return True
    except ImportError:  # pragma: no cover - torch is always there when training
        pass
    if not isinstance(exc, RuntimeError) or isinstance(exc, CollectiveFailure):
        return False
    text = str(exc).lower()
    return any(m in text for m in _TIMEOUT_MARKS + _PEER_GONE_MARKS)


def explain(exc: BaseException, rank: int, world: int, where: str, timeout_s: float) -> CollectiveFailure:
    """A :class:`CollectiveFailure` that says what happened in words (see the module docstring)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = text.lower()
    if any(m in low for m in _PEER_GONE_MARKS):
        cause = ("lost the connection to another rank: that rank's process ended (crashed, was "
                 "killed, or ran out of memory); look at its output for the reason")
    else:
        cause = (f"waited more than --timeout-s {timeout_s:g} s for another rank: that rank stalled "
                 "(hung, far slower, or stuck outside the collectives); raise --timeout-s if steps "
                 "legitimately take longer")
    return CollectiveFailure(f"rank {rank} of {world} stopped in a collective during {where}: it {cause}. "
                             f"(backend said: {text[:300]})")


class Watchdog:
    """Ends this process if the main thread stops making progress (see the module docstring).

    ``pet(where)`` records progress and what the rank is doing; ``close()`` stops the thread.
    Usable as a context manager. ``limit_s`` is the allowed time between two ``pet`` calls.
    ``slow(where)`` allows ``slow_limit_s`` instead until the next ``pet`` — for start-up (the
    ranks start at different times and build the engine together) and other long phases.
    """

    def __init__(self, limit_s: float, rank: int, slow_limit_s: float | None = None, exit=os._exit,
                 out=None):
        if not limit_s > 0:
            raise ValueError(f"watchdog limit must be positive, got {limit_s}")
        self.limit_s, self.rank = float(limit_s), rank
        self.slow_limit_s = max(self.limit_s, float(slow_limit_s or limit_s))
        self._exit, self._out = exit, out
        self._where = "start-up"
        self._last = time.monotonic()
        self._slow = False
        self._stop = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._run, name=f"zerodp-watchdog-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def for_timeout(cls, timeout_s: float, rank: int, **kw) -> "Watchdog":
        return cls(WATCHDOG_FACTOR * timeout_s + WATCHDOG_SLACK_S, rank,
                   slow_limit_s=SLOW_FACTOR * timeout_s + SLOW_SLACK_S, **kw)

    def pet(self, where: str) -> None:
        self._where = where
        self._last = time.monotonic()
        self._slow = False

    def slow(self, where: str) -> None:
        self._where = where
        self._last = time.monotonic()
        self._slow = True

    @property
    def where(self) -> str:
        return self._where

    def _run(self) -> None:
        poll = min(1.0, self.limit_s / 10)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            limit = self.slow_limit_s if self._slow else self.limit_s
            if idle > limit:
                self.fired = True
                out = self._out or sys.stderr
                print(f"zerodp watchdog: rank {self.rank} made no progress for {idle:.1f} s (limit "
                      f"{limit:.1f} s, from --timeout-s) during {self._where}; ending this rank "
                      f"with exit code {WATCHDOG_EXIT_CODE} so that the run does not hang",
                      file=out, flush=True)
                self._exit(WATCHDOG_EXIT_CODE)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
