"""What was measured: a calibration profile and a Chrome trace, read once when ``zerodp ui`` starts.

* A **profile** (``zerodp calibrate --out FILE``) is a hardware file: its α, W and C become the
  hardware "calibrated-<host>" that every panel can pick, and the overlap panel simulates it by
  default.
* A **trace** (``zerodp train --trace``, Chrome-trace JSON with one process per rank and the lanes
  ``compute`` and ``comm``) is drawn as it was recorded, next to the simulated timeline.

Reading a trace is bookkeeping, not modelling: events are listed with their times shifted so that
each rank's first event starts at 0 (every rank's recorder has its own zero); nothing is computed
from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from zerodp import plan
from zerodp.plan._common import read_json

#: ranks drawn from a trace (two lanes each); more would not fit a phone screen
MAX_RANKS = 4
US = 1e-6


@dataclass(frozen=True)
class Span:
    """One recorded interval: ``rank``, ``lane`` ("compute"/"comm"), ``name``, ``start_s``,
    ``end_s`` (seconds from the rank's first event), ``args`` as recorded."""

    rank: int
    lane: str
    name: str
    start_s: float
    end_s: float
    args: dict

    def to_dict(self) -> dict:
        return {"rank": self.rank, "lane": self.lane, "name": self.name,
                "start_s": self.start_s, "end_s": self.end_s, "args": self.args}


def read_trace(path: str) -> list[Span]:
    """The complete ("X") events of a Chrome trace, ranks 0..MAX_RANKS−1, sorted by start."""
    path = os.fspath(path)
    data = read_json(path, "trace", "write one with 'zerodp train --trace'", "expected a Chrome trace")
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: expected a Chrome trace (a list or {{'traceEvents': [...]}})")
    lanes = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name":
            lanes[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", e.get("tid")))
    spans = []
    for e in events:
        if not (isinstance(e, dict) and e.get("ph") == "X"):
            continue
        try:
            rank, ts, dur = int(e.get("pid", 0)), float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: event without numeric ts/dur/pid: {e!r:.200}") from None
        if rank >= MAX_RANKS:
            continue
        lane = lanes.get((e.get("pid"), e.get("tid")), str(e.get("tid", "")))
        spans.append(Span(rank, lane, str(e.get("name", "")), ts * US, (ts + dur) * US,
                          dict(e.get("args") or {})))
    if not spans:
        raise ValueError(f"{path}: no complete ('ph': 'X') events; is it a 'zerodp train --trace' file?")
    # each rank's clock starts at its own recorder: put every rank's first event at 0
    t0 = {}
    for s in spans:
        t0[s.rank] = min(t0.get(s.rank, s.start_s), s.start_s)
    spans = [Span(s.rank, s.lane, s.name, s.start_s - t0[s.rank], s.end_s - t0[s.rank], s.args)
             for s in spans]
    return sorted(spans, key=lambda s: (s.rank, s.lane, s.start_s))


@dataclass
class Measured:
    """The optional inputs of ``zerodp ui``: ``--profile`` and ``--trace``."""

    hardware: plan.Hardware | None = None
    profile_path: str | None = None
    trace: list[Span] = field(default_factory=list)
    trace_path: str | None = None

    @classmethod
    def load(cls, profile: str | None = None, trace: str | None = None) -> "Measured":
        hw = plan.load_hardware(profile) if profile else None
        if hw is not None and hw.name.lower() in (n.lower() for n in plan.hardware_names()):
            raise ValueError(f"{profile}: the profile's name {hw.name!r} is a preset name; rename it")
        return cls(hw, profile, read_trace(trace) if trace else [], trace)

    def to_dict(self) -> dict:
        return {
            "available": bool(self.hardware or self.trace),
            "profile": None if self.hardware is None else {
                "path": self.profile_path, "hardware": self.hardware.to_dict()},
            "trace": None if not self.trace else {
                "path": self.trace_path, "spans": [s.to_dict() for s in self.trace]},
        }
