"""The engine's own trace: compute spans and collectives with start and end times.

Every collective the engine issues and every forward/backward/optimizer span is recorded here,
so that a step can be *measured* the same way the planner's simulator *predicts* it (guide §4:
which buckets' communication hides under backward, and what is left exposed). The trace exports
to Chrome-trace JSON (open it in https://ui.perfetto.dev or chrome://tracing), one process per
rank with a compute lane and a communication lane.

Times are host wall-clock seconds from ``time.perf_counter``. On CPU/gloo that is the truth; on
CUDA a collective's host-side start is when it was enqueued and its end is when the host saw it
complete (``wait``), which bounds the device-side interval from outside.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator

COMPUTE = "compute"
COMM = "comm"
LANES = (COMPUTE, COMM)


@dataclass
class Event:
    """One interval on a lane. For collectives ``args`` holds kind, bytes, label and wait time."""

    name: str
    lane: str
    step: int
    start: float
    end: float | None = None
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return (self.end if self.end is not None else self.start) - self.start


class Recorder:
    """Collects :class:`Event` s for one rank. Cheap enough to stay on during training.

    Memory stays bounded however the engine is used: events of steps older than ``keep_steps``
    are dropped at each step, and at most ``max_events`` events are held at any time (the oldest
    go first), so that loops that never call ``step()`` — evaluation, generation — do not grow.
    """

    def __init__(self, rank: int = 0, keep_steps: int = 50, enabled: bool = True,
                 max_events: int = 1 << 14):
        self.rank = rank
        self.keep_steps = keep_steps
        self.enabled = enabled
        self.step = 0
        self.max_events = max_events
        self.events: deque[Event] = deque(maxlen=max_events)
        self.t0 = time.perf_counter()

    def clock(self) -> float:
        return time.perf_counter()

    def begin(self, name: str, lane: str, **args) -> Event:
        """Open an event now; close it later with :meth:`end`."""
        ev = Event(name, lane, self.step, self.clock(), None, dict(args))
        if self.enabled:
            self.events.append(ev)
        return ev

    def end(self, ev: Event, **args) -> Event:
        ev.end = self.clock()
        ev.args.update(args)
        return ev

    @contextmanager
    def span(self, name: str, lane: str = COMPUTE, **args) -> Iterator[Event]:
        ev = self.begin(name, lane, **args)
        try:
            yield ev
        finally:
            self.end(ev)

    def next_step(self) -> None:
        """Mark the end of an optimizer step; drop events older than ``keep_steps`` steps."""
        self.step += 1
        if self.keep_steps and self.events and self.events[0].step <= self.step - self.keep_steps:
            cutoff = self.step - self.keep_steps
            self.events = deque((e for e in self.events if e.step > cutoff), maxlen=self.max_events)

    def step_events(self, step: int | None = None) -> list[Event]:
        """Events of one step (default: the last completed step)."""
        want = self.step - 1 if step is None else step
        return [e for e in self.events if e.step == want]

    def clear(self) -> None:
        self.events.clear()

    def chrome_events(self, step: int | None = None) -> list[dict]:
        events = self.events if step is None else [e for e in self.events if e.step == step]
        out = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
        ]
        for tid, lane in enumerate(LANES):
            out.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}})
        for e in events:
            if e.end is None:
                continue
            out.append({
                "name": e.name, "ph": "X", "pid": self.rank,
                "tid": LANES.index(e.lane) if e.lane in LANES else len(LANES),
                "ts": (e.start - self.t0) * 1e6, "dur": max(e.duration, 0.0) * 1e6,
                "args": {"step": e.step, **e.args},
            })
        return out

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]


def write_chrome_trace(path: str | os.PathLike, events: list[dict]) -> str:
    """Write Chrome-trace JSON (a list of per-rank events merged by the caller) atomically."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
    return path
