"""``zerodp check`` and ``zerodp.check(...)``: is sharding exact for this model, this optimizer and
this usage, and what does it cost? (docs/check.md; guide §2.2, §9, §12.3)

At each requested stage and world size, local ranks train the user's model a few steps with
``zerodp.parallelize`` — gradient accumulation under ``no_sync``, clipping, optionally bf16 mixed
precision, a checkpoint saved at one stage and world size and loaded at another — against the same
model and stock optimizer in one process on the whole batch, and compare gradients, parameters
and optimizer state within tolerances derived from the dtype and the magnitude
(:mod:`zerodp.check.core`). The table adds the engine's measured memory and bytes against the
planner's (:mod:`zerodp.check.report`).

``zerodp.check(model="pkg.module:build", optimizer="adamw", input_shape=(3, 32, 32))`` returns a
:class:`CheckResult`; the package itself is callable so that ``zerodp.check(...)`` reads as the
command does. Torch is imported only when a check runs.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

from zerodp.check.spec import CheckConfig, CheckInputError

__all__ = ["check", "run", "CheckConfig", "CheckResult", "CheckInputError"]


@dataclass
class CheckResult:
    """The rows (one per stage and world size, plain dicts as ``--json`` prints them), whether
    every row passed, and the seconds the whole check took."""

    rows: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r["ok"] for r in self.rows)

    def table(self) -> str:
        from zerodp.check.report import table

        return table(self.rows)


def run(cfg: CheckConfig) -> CheckResult:
    """Spawn ``max(cfg.worlds)`` local ranks (gloo on CPU, NCCL on CUDA) and run every row on
    them (:func:`zerodp.check.runner.rank_main`); a rank that fails ends the group with its
    traceback (:class:`zerodp.spawn.RankFailure`), within ``cfg.timeout`` seconds."""
    import dataclasses
    import time

    import torch

    from zerodp.check.runner import rank_main
    from zerodp.spawn import run_local

    cfg.validate()
    if cfg.device == "auto":
        cfg = dataclasses.replace(cfg, device="cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.ranks:
        raise CheckInputError(f"--device cuda: {cfg.ranks} ranks need {cfg.ranks} GPUs, this machine has "
                              f"{torch.cuda.device_count()}")
    started = time.perf_counter()
    results = run_local(rank_main, cfg.ranks, cfg, backend="nccl" if cfg.device == "cuda" else "gloo",
                        timeout=cfg.timeout)
    return CheckResult(results[0], time.perf_counter() - started)


def check(model=None, optimizer: str = "adamw", **options) -> CheckResult:
    """``zerodp.check(model, optimizer, ...)``: :func:`run` over ``CheckConfig(model=model,
    optimizer=optimizer, **options)``; ``optimizer`` may also be a factory (called with the
    model, returning one optimizer or a list)."""
    if callable(optimizer):
        options["optimizer_factory"] = optimizer
        optimizer = "adamw"
    return run(CheckConfig(model=model, optimizer=optimizer, **options))


class _Callable(types.ModuleType):
    def __call__(self, *args, **kwargs) -> CheckResult:
        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable
