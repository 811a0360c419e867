"""TEST-ONLY fault injection for the reliability tests (issue 9): make one rank fail on purpose.

Nothing here runs unless the environment variable ``ZERODP_TEST_FAULT`` is set, and then rank 0
prints a warning line first, so a fault can never be active silently. The value is a
comma-separated list of ``KIND:RANK:STEPS`` where ``STEPS`` is a step number or a range ``A-B``
(0-based step numbers, the step about to be taken):

``exit:R:S``   rank R ends its process with ``os._exit(EXIT_CODE)`` at the start of step S, on the
               launcher's first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0) — a crash that
               an elastic restart then recovers from.
``stall:R:S``  rank R sleeps ``STALL_S`` seconds at the start of step S — a hung rank.
``inf:R:S``    after the backward of step S, rank R writes +inf into its own gradient (the first
               element of the first gradient it will apply) — a numeric blow-up on one rank only.

Example: ``ZERODP_TEST_FAULT=inf:1:2-3,exit:1:5 zerodp train ...``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV = "ZERODP_TEST_FAULT"
EXIT_CODE = 13
STALL_S = 3600.0
KINDS = ("exit", "stall", "inf")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    first: int
    last: int

    def hits(self, rank: int, step: int) -> bool:
        return rank == self.rank and self.first <= step <= self.last


def parse(spec: str) -> list[Fault]:
    """``"inf:1:2-3,exit:0:5"`` → faults; a malformed spec is an error (never ignored)."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            kind, rank, steps = parts
            first, _, last = steps.partition("-")
            fault = Fault(kind, int(rank), int(first), int(last or first))
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: cannot read {item!r}; write KIND:RANK:STEP or "
                             f"KIND:RANK:FIRST-LAST with KIND one of {', '.join(KINDS)}") from None
        if fault.kind not in KINDS:
            raise ValueError(f"{ENV}={spec!r}: unknown fault {fault.kind!r}; use one of {', '.join(KINDS)}")
        faults.append(fault)
    return faults


class Faults:
    """The faults that apply to one rank; every hook is a no-op when none is configured."""

    def __init__(self, faults: list[Fault], rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.all = faults
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int) -> "Faults":
        return cls(parse(os.environ.get(ENV, "")), rank)

    def __bool__(self) -> bool:
        return bool(self.all)

    def describe(self) -> str:
        return f"{ENV}={os.environ.get(ENV, '')!r}: TEST fault injection is active"

    def _hit(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.hits(self.rank, step) for f in self.faults)

    def at_step_start(self, step: int) -> None:
        if self._hit("exit", step) and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            print(f"[{ENV}] rank {self.rank}: exiting with code {EXIT_CODE} at step {step}", flush=True)
            os._exit(EXIT_CODE)
        if self._hit("stall", step):
            print(f"[{ENV}] rank {self.rank}: stalling at step {step}", flush=True)
            time.sleep(STALL_S)

    def after_backward(self, engine, step: int) -> None:
        if not self._hit("inf", step):
            return
        import torch

        engine._finish_grad_sync()
        for g in engine._master_grads():
            if g is not None and g.numel() > 0:
                with torch.no_grad():
                    g.view(-1)[0] = float("inf")
                return
