"""Skip a step whose gradients hold inf or NaN: one decision for all ranks, agreed by a collective.

Why a collective: under ZeRO each rank steps only its own 1/N shard (guide §9). An inf that lands
in rank 1's shard is seen by rank 1 alone; if rank 1 skipped and rank 0 stepped, the replicas
would silently diverge (and under stage 0, where every rank holds the full averaged gradient, a
rank whose *local* replica went bad would do the same). So every rank computes a local flag —
"some gradient element I am about to apply is not finite" — and one small AllReduce (SUM of a
vector with one slot per rank) tells every rank which ranks saw a bad value. All ranks then take
the same decision: step, or skip the optimizer step entirely (no parameter, optimizer-state or
step-count change — as ``torch.amp.GradScaler`` does for fp16 overflow) and discard the step's
gradients.

Skips are counted (``skipped_steps``, ``consecutive``) and reported through ``engine.stats()``.
After ``max_consecutive`` skips in a row the guard raises :class:`NonFiniteGradients` on every
rank (they agree, so none is left waiting in a collective): a run whose gradients stay non-finite
is diverging, and skipping forever would only hide it.

The check is ``max |g|`` over this rank's gradient tensors (``torch._foreach_norm`` with
``ord=inf``): inf and NaN propagate through it and, unlike a sum of squares, it cannot overflow
for finite values.

Enabled with ``parallelize(..., max_nonfinite_skips=N)``; off (``None``) by default, so that the
engine's collectives are exactly the peers' unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Label of the flag AllReduce in the engine's trace and stats.
FLAG_LABEL = "nonfinite_flag"


class NonFiniteGradients(RuntimeError):
    """Raised on every rank when too many consecutive steps had non-finite gradients."""


@dataclass
class GuardStats:
    """What the guard saw so far (reported in ``engine.stats().nonfinite``)."""

    skipped_steps: int = 0  # steps skipped since the engine was built
    consecutive: int = 0  # skips in a row, up to and including the last step
    last_skipped: bool = False  # the most recent step was skipped
    last_ranks: list[int] = field(default_factory=list)  # ranks that saw inf/NaN at the last skip
    max_consecutive: int = 0


class NonFiniteGuard:
    """The skip decision of :meth:`StageEngine.step`; see the module docstring."""

    def __init__(self, max_consecutive: int):
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(
                f"max_nonfinite_skips={max_consecutive!r}: give the number of consecutive steps with "
                "inf/NaN gradients to skip before training stops, an integer >= 1 (or None to "
                "turn the check off)")
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        self.consecutive = 0
        self.last_skipped = False
        self.last_ranks: list[int] = []
        self.steps_seen = 0

    @staticmethod
    @torch.no_grad()
    def local_nonfinite(grads: list[torch.Tensor | None]) -> bool:
        """True when some element of this rank's gradients is inf or NaN."""
        grads = [g for g in grads if g is not None and g.numel() > 0]
        if not grads:
            return False
        peaks = torch._foreach_norm(grads, float("inf"))
        return not bool(torch.isfinite(torch.stack([p.float() for p in peaks])).all())

    @torch.no_grad()
    def should_skip(self, engine) -> bool:
        """Collective (every rank, every step): True when any rank's gradients are not finite.

        Updates the counters and raises :class:`NonFiniteGradients` (on every rank) when the
        number of consecutive skips reaches ``max_consecutive``.
        """
        flags = torch.zeros(engine.world_size, dtype=torch.float32, device=engine.device)
        flags[engine.rank] = 1.0 if self.local_nonfinite(engine.machine.master_grads()) else 0.0
        if engine.world_size > 1:
            flags = engine.comm.all_reduce_sum(flags, FLAG_LABEL)
        ranks = [r for r, f in enumerate(flags.tolist()) if f > 0]
        step = self.steps_seen
        self.steps_seen += 1
        self.last_skipped = bool(ranks)
        if not ranks:
            self.consecutive = 0
            return False
        self.skipped_steps += 1
        self.consecutive += 1
        self.last_ranks = ranks
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteGradients(
                f"gradients held inf/NaN for {self.consecutive} consecutive steps (engine steps "
                f"{step - self.consecutive + 1}-{step}; last seen on rank(s) "
                f"{', '.join(map(str, ranks))}), the limit max_nonfinite_skips={self.max_consecutive}: "
                "training stopped without applying them. The run is diverging: lower the learning "
                "rate, clip gradients, check the data, or resume from an earlier checkpoint")
        return True

    def stats(self) -> GuardStats:
        return GuardStats(self.skipped_steps, self.consecutive, self.last_skipped,
                          list(self.last_ranks), self.max_consecutive)
