"""Stage 3's unit schedule, compared across ranks (guide §10.3).

Every rank must run the same units in the same order: an AllGather or ReduceScatter of unit i on
one rank pairs with whatever collective the others issued at that position, so a unit skipped on
some ranks (layer-drop, routing) would mix parameters or gradients between units, or hang.
:class:`UnitSchedule` keeps what this rank issued since the last step — a running hash and a
bounded log of unit collectives — and checks it in two places, each with one tiny AllReduce
(MAX of h and of −h, equal exactly when every rank's h is the same): the units of a training
forward at its end, before any gradient is reduced, and the whole step's collectives at
``step()`` (the hash rides on the used-parameter AllReduce there). On a mismatch every rank
raises one message naming the first unit where the ranks went different ways.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from zerodp.engine.control import UNIT_SCHEDULE

HASH_MOD = 1 << 50  # exact in float64, which the AllReduce carries
LOG_LIMIT = 4096  # collectives named in a mismatch report
_ADVICE = ("Every rank must run every unit in the same order in every forward (multiply a dropped "
           "unit's output by zero instead of skipping it), or use stages 0-2 with find_unused_parameters=True")


def _first_difference(logs: list[list[str]], missing: str) -> int:
    return next((i for i in range(max(map(len, logs)))
                 if len({log[i] if i < len(log) else missing for log in logs}) > 1), 0)


class UnitSchedule:
    """What one stage-3 rank issued this step, and the checks against the other ranks."""

    def __init__(self, comm, group: dist.ProcessGroup | None, world_size: int, device: torch.device):
        self.comm, self.group, self.world_size, self.device = comm, group, world_size, device
        self.hash = 0
        self._log: list[str] = []

    def log(self, kind: str, u) -> None:
        """One unit collective (``"AG"`` or ``"RS"``) of this step."""
        self.hash = (self.hash * 1_000_003 + (u.index + 1) * 4 + (kind == "RS")) % HASH_MOD
        if len(self._log) < LOG_LIMIT:
            self._log.append(f"{'ReduceScatter' if kind == 'RS' else 'AllGather'} of unit {u.label!r}")

    def reset(self) -> None:
        self.hash, self._log = 0, []

    def check_forward_order(self, units: Sequence) -> None:
        """End of a training forward: did every rank run ``units`` in the same order?"""
        h = 0
        for u in units:
            h = (h * 1_000_003 + u.index + 1) % HASH_MOD
        flags = torch.tensor([float(h), -float(h)], dtype=torch.float64, device=self.device)
        self.comm.all_reduce_max(flags, "unit_order")
        if flags[0].item() == -flags[1].item():
            return
        orders = self._gather([u.label for u in units])
        where = _first_difference(orders, None)
        seen = "; ".join(f"rank {r} ran {repr(o[where]) if where < len(o) else 'no further unit'}"
                         for r, o in enumerate(orders))
        raise RuntimeError(
            f"stage 3: the ranks ran different units in this forward (unit #{where + 1}: {seen}). A unit "
            "skipped on some ranks (data-dependent control flow such as layer-drop or routing) makes "
            "the ranks' AllGathers and ReduceScatters pair up wrongly, mixing parameters and gradients "
            f"between units or hanging. {_ADVICE}")

    def _gather(self, obj) -> list:
        """Every rank's ``obj``: on the engine's control group (bounded, named) where there is one."""
        control = getattr(self.comm, "control", None)
        if control is not None:
            return control.all_gather_object(obj, UNIT_SCHEDULE)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def mismatch(self) -> None:
        """The step's hashes differed across ranks: name the first collective that did, and raise."""
        logs = self._gather(self._log)
        where = _first_difference(logs, "nothing")
        seen = "; ".join(f"rank {r}: {log[where] if where < len(log) else 'nothing'}" for r, log in enumerate(logs))
        raise RuntimeError(
            f"stage 3: the ranks issued different unit collectives this step (collective #{where + 1}: "
            f"{seen}). A unit was skipped or run in another order on some ranks (data-dependent "
            "control flow such as layer-drop or routing), so gathered parameters or reduced "
            f"gradients were mixed between units; nothing of this step was applied. {_ADVICE}")
