"""Graceful stop (preemption): SIGTERM or a first SIGINT ends the run at a step boundary with a
checkpoint, within a grace period; a second SIGINT aborts at once.

Clusters announce preemption with SIGTERM and a grace period before SIGKILL (SLURM with
``--signal``, Kubernetes with ``terminationGracePeriodSeconds``, spot instances). Every rank installs
:class:`StopRequest` as its handler of SIGTERM and SIGINT. The handler only records the signal;
the training loop adds "this rank was asked to stop" to the AllReduce it makes at the end of every
step anyway (the loss), so all ranks learn the same answer after the same step and stop together —
a rank that was not signalled, or was signalled a moment later, is never left alone in a
collective. Then every rank saves the checkpoint of that step (one collective save) and returns.

Exit statuses of ``zerodp train`` (the launcher and, under torchrun, each worker):

=====  ==========================================================================================
0      the run finished
143    stopped on SIGTERM (128 + 15) with a complete checkpoint of the step it stopped after:
       ``--resume`` continues exactly as if it had never stopped
130    the same, on a first SIGINT (128 + 2)
74     stopped because a checkpoint could not be written (EX_IOERR; see ``--on-save-error``);
       the checkpoints saved before are intact
1      any other end: a rank failed, a second SIGINT aborted, or the ranks could not stop within
       ``--grace-s`` (the message names the newest complete checkpoint)
=====  ==========================================================================================

Bounded in time: from the first signal a rank allows itself ``grace_s`` minus a margin to finish
the step and save; past that it ends at once (the checkpoint save is atomic, so the previous one is
untouched), and the launcher kills whatever is left at ``grace_s``.

A second SIGINT aborts at once, again leaving the newest complete checkpoint as it was. A Ctrl-C in
a terminal reaches every process of the foreground group — the launcher and the ranks — and the
launcher then forwards it to the ranks once more; so a rank counts a SIGINT as the second one only
when it arrives at least :data:`DEBOUNCE_S` after the first.

**Replica groups** (``zerodp train --replica-groups R``, :mod:`zerodp.ft`) stop by another rule:
a rank's state lives in the live peer groups — a group started again heals from one — so a stop
signal ends the rank at once, without a checkpoint, with one line and the status 128 + the
signal (``StopRequest(saves=False)``). The agent that ends a group after one of its ranks died
sends that SIGTERM, and the group's survivors cannot finish a step or a save whose collectives
need the dead rank: waiting out the grace period would only delay the group's restart. The
signal is read on a thread of its own (``signal.set_wakeup_fd``), so a rank blocked in a
collective or an RPC that the dead peer will never answer — where a Python signal handler does
not run until the call returns — still ends within moments.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_SAVE_FAILED = 74  # EX_IOERR
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEBOUNCE_S = 2.0
DEFAULT_GRACE_S = 30.0


def exit_code(sig: int) -> int:
    """The status of a clean stop on ``sig``: 128 + its number, as a shell reports a signal."""
    return 128 + int(sig)


def margin_s(grace_s: float) -> float:
    """How long before the end of the grace period a rank gives up on its own (the rest is for
    ending the processes and the launcher)."""
    return min(5.0, grace_s / 4)


class StopRequest:
    """This process's record of stop signals (see the module docstring).

    ``signal`` is the first stop signal received (None before). ``install()`` makes it the handler
    of SIGTERM and SIGINT (main thread only); ``done()`` cancels the grace-period deadline.

    ``saves=False``: the replica-group rule — the first stop signal ends the process at once with
    128 + its number, saying so in one line (``who`` names the rank in it, "rank N" by default),
    and ``install()`` also reads the signals on a thread of its own so that this holds while the
    main thread is blocked in C code.
    """

    def __init__(self, rank: int = 0, grace_s: float = DEFAULT_GRACE_S, exit=os._exit, out=None,
                 clock=time.monotonic, saves: bool = True, who: str | None = None):
        self.rank, self.grace_s, self.saves = rank, float(grace_s), saves
        self.who = who or f"rank {rank}"
        self.signal: signal.Signals | None = None
        self.at: float | None = None
        self._first_int: float | None = None
        self._exit, self._out, self._clock = exit, out, clock
        self._done = threading.Event()
        self._once = threading.Lock()

    # -- handler
    def install(self) -> "StopRequest":
        if not self.saves:
            self._watch()
            return self
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)
        return self

    def _watch(self) -> None:
        """Call :meth:`handle` from a thread of its own as soon as a stop signal arrives: the C-level
        handler writes each signal's number to a pipe (``set_wakeup_fd``) even while the main
        thread, which alone runs Python signal handlers, is blocked in a collective. The Python
        handler itself does nothing (it only has to be there for the C-level one to write)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, _on_the_watcher)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)

        def watch() -> None:
            while True:
                for num in os.read(read, 64):
                    if num in STOP_SIGNALS:
                        self.handle(num)

        threading.Thread(target=watch, name="zerodp-stop", daemon=True).start()

    def _say(self, text: str) -> None:
        print(f"zerodp: {self.who}: {text}", file=self._out or sys.stderr, flush=True)

    def handle(self, signum, frame=None) -> None:
        sig, now = signal.Signals(signum), self._clock()
        if not self.saves:
            if self._once.acquire(blocking=False):  # the first one; the process ends with it
                self.signal, self.at = sig, now
                self._say(f"{sig.name} received: ending now, without a checkpoint (a replica group's state lives "
                          "in the live groups; started again, this group heals from one)")
                self._exit(exit_code(sig))
            return
        if sig == signal.SIGINT and self._first_int is not None and now - self._first_int >= DEBOUNCE_S:
            self._say("second interrupt: ending now, without a checkpoint; the newest complete "
                      "checkpoint is untouched")
            self._exit(EXIT_FAILED)
            return
        if sig == signal.SIGINT and self._first_int is None:
            self._first_int = now
        if self.signal is not None:
            return  # a repeat (the launcher forwards what a rank may already have had)
        self.signal, self.at = sig, now
        if self.rank == 0:
            self._say(f"{sig.name} received: finishing the step in flight, then every rank saves a "
                      f"checkpoint and stops (within --grace-s {self.grace_s:g} s)")
        threading.Thread(target=self._deadline, name="zerodp-grace", daemon=True).start()

    def _deadline(self) -> None:
        if self._done.wait(max(0.5, self.grace_s - margin_s(self.grace_s))):
            return
        self._say(f"the grace period (--grace-s {self.grace_s:g} s) ran out before the checkpoint was "
                  "complete; ending now, without it (the newest complete checkpoint is untouched)")
        self._exit(EXIT_FAILED)

    def done(self) -> None:
        self._done.set()

    # -- what the training loop asks
    @property
    def requested(self) -> bool:
        return self.signal is not None

    def votes(self) -> tuple[float, float]:
        """This rank's (SIGTERM, SIGINT) votes for the end-of-step AllReduce."""
        return (float(self.signal == signal.SIGTERM), float(self.signal == signal.SIGINT))


def _on_the_watcher(signum, frame) -> None:
    """The Python-level handler under ``saves=False``: the watcher thread has the signal already."""


_current = StopRequest()  # never installed: nothing is ever requested


def current() -> StopRequest:
    return _current


def install(rank: int, grace_s: float, saves: bool = True, who: str | None = None) -> StopRequest:
    """Make this process's SIGTERM and SIGINT request a graceful stop (call in the main thread);
    ``saves=False``: end it at once instead (replica groups, module docstring)."""
    global _current
    _current = StopRequest(rank, grace_s, saves=saves, who=who).install()
    return _current


def decided(term_votes: float, int_votes: float) -> signal.Signals | None:
    """The stop the ranks agreed on from the summed votes: SIGTERM wins over SIGINT."""
    if term_votes > 0:
        return signal.SIGTERM
    if int_votes > 0:
        return signal.SIGINT
    return None
