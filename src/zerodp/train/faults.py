"""TEST-ONLY fault injection for the reliability tests and the chaos run: make a rank fail on purpose.

Nothing here runs unless the environment variable ``ZERODP_TEST_FAULT`` is set, and then rank 0
prints a warning line first, so a fault can never be active silently. The value is a
comma-separated list of ``KIND:RANK:STEPS[@ATTEMPT]`` where ``STEPS`` is a step number, a range
``A-B`` or ``*`` (any step; 0-based step numbers, the step about to be taken, or for the save
faults the step the checkpoint is of), and ``@ATTEMPT`` limits the fault to one attempt of the
group (``TORCHELASTIC_RESTART_COUNT``; 0 is the first), so that a step redone after a restart does
not meet the same fault again:

``exit:R:S``   rank R ends its process with ``os._exit(EXIT_CODE)`` at the start of step S, on the
               launcher's first attempt only unless ``@ATTEMPT`` says otherwise — a crash that an
               elastic restart then recovers from.
``kill:R:S``   rank R sends itself SIGKILL at the start of step S (nothing runs after it).
``kill-start:R:S``  rank R sends itself SIGKILL during start-up, after the process group is up and
               before the checkpoint is loaded; S is the step the attempt starts from (``*``: any)
               — a crash during a restart.
``kill-save-PHASE:R:S``  rank R sends itself SIGKILL while saving the checkpoint of step S, at
               PHASE ``files`` (its shard written, the others still writing), or, on rank 0 only,
               ``manifest``, ``renamed`` or ``complete`` (see zerodp.train.checkpoint.save).
``term:R:S``   rank R sends SIGTERM to its parent process (the launcher: our elastic agent or
               torchrun's) at the start of step S — a preemption notice.
``stall:R:S``  rank R sleeps ``STALL_S`` seconds at the start of step S — a hung rank.
``inf:R:S``    after the backward of step S, rank R writes +inf into its own gradient (the first
               element of the first gradient it will apply) — a numeric blow-up on one rank only.
``enospc:R:S``, ``eacces:R:S``, ``eio:R:S``, ``rmdir:R:S``  storage faults while saving the
               checkpoint of step S: rank R's write of its shard file fails with ENOSPC ("No space
               left on device") or EACCES ("Permission denied"), its fsync with EIO
               ("Input/output error"), or (``rmdir``) rank R removes the save's directory just
               before writing its shard, so the write meets a directory that is gone. They go
               through the ``before_fs`` seam the checkpoint writer calls
               (:class:`zerodp.train.hooks.Hooks`).

:class:`Faults` is the run's :class:`~zerodp.train.hooks.Hooks` object: the training loop passes it
to every seam, the checkpoint writer's included; no module global is set.

Example: ``ZERODP_TEST_FAULT=inf:1:2-3,exit:1:5,kill:0:9@1 zerodp train ...``.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from zerodp.train.hooks import SAVE_PHASES, Hooks

ENV = "ZERODP_TEST_FAULT"
EXIT_CODE = 13
STALL_S = 3600.0
STORAGE = {"enospc": ("shard", errno.ENOSPC), "eacces": ("shard", errno.EACCES),
           "eio": ("fsync", errno.EIO), "rmdir": ("shard", errno.ENOENT)}
KINDS = ("exit", "kill", "kill-start", *(f"kill-save-{p}" for p in SAVE_PHASES), "term", "stall",
         "inf", *STORAGE)
ANY = 1 << 62


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    first: int
    last: int
    attempt: int | None = None  # None: every attempt

    def hits(self, rank: int, step: int, attempt: int | None = None) -> bool:
        if self.attempt is not None and attempt is not None and attempt != self.attempt:
            return False
        return rank == self.rank and self.first <= step <= self.last

    def __str__(self) -> str:
        steps = "*" if (self.first, self.last) == (0, ANY) else (
            str(self.first) if self.first == self.last else f"{self.first}-{self.last}")
        return f"{self.kind}:{self.rank}:{steps}" + ("" if self.attempt is None else f"@{self.attempt}")


def parse(spec: str) -> list[Fault]:
    """``"inf:1:2-3,exit:0:5,kill:1:7@2"`` → faults; a malformed spec is an error (never ignored)."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        body, _, attempt = item.partition("@")
        parts = body.split(":")
        try:
            kind, rank, steps = parts
            if steps == "*":
                first, last = 0, ANY
            else:
                a, _, b = steps.partition("-")
                first, last = int(a), int(b or a)
            att = int(attempt) if attempt else (0 if kind == "exit" else None)
            fault = Fault(kind, int(rank), first, last, att)
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: cannot read {item!r}; write KIND:RANK:STEP, "
                             f"KIND:RANK:FIRST-LAST or KIND:RANK:* (optionally @ATTEMPT) with KIND one "
                             f"of {', '.join(KINDS)}") from None
        if fault.kind not in KINDS:
            raise ValueError(f"{ENV}={spec!r}: unknown fault {fault.kind!r}; use one of {', '.join(KINDS)}")
        faults.append(fault)
    return faults


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Faults(Hooks):
    """The faults that apply to one rank, as the run's hooks; each is a no-op when none is configured."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.all = faults
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int) -> "Faults":
        return cls(parse(os.environ.get(ENV, "")), rank)

    def warning(self) -> str:
        return f"{ENV}={os.environ.get(ENV, '')!r}: TEST fault injection is active" if self.all else ""

    def _hit(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.hits(self.rank, step, attempt()) for f in self.faults)

    def _say(self, what: str) -> None:
        print(f"[{ENV}] rank {self.rank}: {what} (attempt {attempt()})", flush=True)

    def _kill(self, where: str) -> None:
        self._say(f"SIGKILL {where}")
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached: the signal ends the process

    def at_start(self, step: int) -> None:
        """Start-up of an attempt that begins at ``step`` (the process group is up)."""
        if self._hit("kill-start", step):
            self._kill(f"during start-up (resuming at step {step})")

    def at_step_start(self, step: int) -> None:
        if self._hit("exit", step):
            self._say(f"exiting with code {EXIT_CODE} at step {step}")
            os._exit(EXIT_CODE)
        if self._hit("kill", step):
            self._kill(f"at step {step}")
        if self._hit("term", step):
            self._say(f"sending SIGTERM to the launcher (pid {os.getppid()}) at step {step}")
            os.kill(os.getppid(), signal.SIGTERM)
        if self._hit("stall", step):
            self._say(f"stalling at step {step}")
            time.sleep(STALL_S)

    def save_phase(self, step: int, phase: str) -> None:
        if self._hit(f"kill-save-{phase}", step):
            self._kill(f"while saving the checkpoint of step {step} (phase {phase!r})")

    def before_fs(self, point: str, step: int, path: Path) -> None:
        """The storage faults: the checkpoint writer meets this rank's ENOSPC, EACCES, EIO or a
        removed directory."""
        for kind, (where, code) in STORAGE.items():
            if point == where and self._hit(kind, step):
                if kind == "rmdir":
                    self._say(f"removing {path.parent} while saving the checkpoint of step {step}")
                    shutil.rmtree(path.parent, ignore_errors=True)
                    return  # the write that follows meets the missing directory itself
                self._say(f"{errno.errorcode[code]} at {path} while saving the checkpoint of step {step}")
                raise OSError(code, os.strerror(code), str(path))

    def after_backward(self, engine, step: int) -> None:
        if not self._hit("inf", step):
            return
        import torch

        engine.machine.finish_grad_sync()
        for g in engine.machine.master_grads():
            if g is not None and g.numel() > 0:
                with torch.no_grad():
                    g.view(-1)[0] = float("inf")
                return
