"""The engine's own trace: compute spans and collectives with start and end times.

Every collective the engine issues and every forward/backward/optimizer span is recorded here,
so that a step can be *measured* the same way the planner's simulator *predicts* it (guide §4:
which buckets' communication hides under backward, and what is left exposed). The trace exports
to Chrome-trace JSON (open it in https://ui.perfetto.dev or chrome://tracing), one process per
rank with a compute lane and a communication lane.

**Two clocks, one meaning** (guide §13.3). On CPU/gloo every event is timed with the host clock
(``time.perf_counter``): the host does the work, so host time is the truth, and nothing else runs.

On CUDA the host only *enqueues* kernels and NCCL collectives, so host time around them measures
enqueueing. The recorder then times on the device: a ``torch.cuda.Event(enable_timing=True)`` is
recorded on the current stream at every ``begin``/``end``, and

- a **compute span** lasts from its start event to its end event: the device time of the kernels
  enqueued between them (plus any gap where the stream waited);
- a **collective** starts at an event recorded on the current stream just before the launch.
  NCCL runs the collective on its own internal stream, which first waits for the current stream,
  so that event completes when the collective *may* start. ``wait()`` makes the current stream
  wait for NCCL's (it does not block the host); an event recorded *before* that wait and one
  recorded *after* it (and after the post-processing, as on CPU) bracket the time the compute
  stream stood still for the collective. That stall is ``wait_s``: the **exposed** communication,
  what overlap did not hide — the same quantity host-blocked time is on CPU. The collective's end
  is the end of the wait, as on CPU: a collective that finished early but is waited for late ends
  where it is waited for on both clocks.

Device events are turned into the same :class:`Event` fields lazily: :meth:`Recorder.resolve`
runs when events are read (``step_events``, ``chrome_events``, ``to_dicts``: ``engine.stats()``
and the Chrome trace), blocking until their device work is done, and without blocking at each
``next_step`` for the events already complete. Device times are put on the host axis through a
chain of references: the first device event is anchored once to the host clock (after a device
synchronize), and each resolved event becomes the reference of later ones, so every offset is a
short ``elapsed_time`` (a float32 in ms, about 0.5 µs resolution). Offsets between the events of a
step thus stay exact to about a microsecond however long the run, where offsets from one anchor
would lose 0.1 ms after an hour; the placement on the host axis as a whole may drift by float32's
relative precision (about 1e-7 of the run's length), a shift shared by the events of a step.
Until resolved, an event holds host placeholders and its ``args`` say ``clock: "host"``; resolved,
``clock: "cuda"``. On CPU no device event is ever made: the host path runs the plain methods it
always ran.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

COMPUTE = "compute"
COMM = "comm"
LANES = (COMPUTE, COMM)
MAX_REFS = 256  # resolved device events kept as references for later ones (plus the anchor)


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


class DeviceTimer:
    """Timing events on the current CUDA stream of ``device`` (guide §13.3).

    ``event_cls`` and ``synchronize`` default to ``torch.cuda.Event`` and ``torch.cuda.synchronize``;
    anything with the same methods (``record``, ``query``, ``synchronize``, ``elapsed_time`` in ms)
    times the same way, which is how the resolution logic is tested without a GPU."""

    def __init__(self, device: Any = None, event_cls: Callable[..., Any] | None = None,
                 synchronize: Callable[[], None] | None = None):
        if event_cls is None or synchronize is None:
            import torch

            event_cls = event_cls or torch.cuda.Event
            synchronize = synchronize or (lambda: torch.cuda.synchronize(device))
        self.device = device
        self.event_cls = event_cls
        self._synchronize = synchronize

    def record(self) -> Any:
        """A timing event recorded now on the current stream."""
        ev = self.event_cls(enable_timing=True)
        ev.record()
        return ev

    def anchor(self, clock: Callable[[], float]) -> tuple[Any, float]:
        """A device event and the host time it happened at: the device is idle when it is recorded
        (a synchronize first), so it completes a few microseconds after ``clock()`` is read."""
        self._synchronize()
        t = clock()
        ev = self.record()
        ev.synchronize()
        return ev, t


class _Marks:
    """The device events of one :class:`Event` not yet resolved."""

    __slots__ = ("event", "seq", "start", "wait", "end")

    def __init__(self, event: Event, seq: int, start: Any):
        self.event = event
        self.seq = seq
        self.start = start
        self.wait = None
        self.end = None

    def recorded(self) -> list:
        return [e for e in (self.start, self.wait, self.end) if e is not None]


def default_device() -> Any:
    """The device the engine's events should be timed on when nobody said: CUDA's current device
    when the default process group is NCCL only (the engine then runs on it: ``check_device``),
    else None (the host clock)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
            return None
        import torch

        return torch.device("cuda", torch.cuda.current_device())
    except (RuntimeError, ValueError, AssertionError):  # no default group / no usable CUDA
        return None


class Recorder:
    """Collects :class:`Event` s for one rank. Cheap enough to stay on during training.

    Memory stays bounded however the engine is used: events of steps older than ``keep_steps``
    are dropped at each step, and at most ``max_events`` events are held at any time (the oldest
    go first), so that loops that never call ``step()`` — evaluation, generation — do not grow.

    ``device``: where the engine computes. A CUDA device turns on device timing (module docstring);
    ``"auto"`` (the default) takes CUDA when the default process group is NCCL only; None or a
    CPU device keep the host clock. ``timer`` replaces the :class:`DeviceTimer` (tests).
    """

    def __init__(self, rank: int = 0, keep_steps: int = 50, enabled: bool = True,
                 max_events: int = 1 << 14, device: Any = "auto", timer: DeviceTimer | None = None):
        self.rank = rank
        self.keep_steps = keep_steps
        self.enabled = enabled
        self.step = 0
        self.max_events = max_events
        self.events: deque[Event] = deque(maxlen=max_events)
        self.t0 = time.perf_counter()
        self.timer: DeviceTimer | None = None
        self._marks: dict[int, _Marks] = {}
        self._refs: list[tuple[int, Any, float]] = []  # (seq, device event, host time), by seq
        self._seq = 0
        if device == "auto":
            device = default_device()
        if timer is not None:
            self._use_timer(timer)
        elif device is not None:
            self.set_device(device)

    def set_device(self, device: Any) -> None:
        """Time on ``device`` from now on: CUDA events for a CUDA device, the host clock otherwise."""
        kind = getattr(device, "type", None) or str(device).split(":")[0]
        if kind not in ("cpu", "cuda", "meta"):
            raise ValueError(f"trace timing: unsupported device {device!r} (cpu or cuda)")
        self.resolve()
        self._use_timer(DeviceTimer(device) if kind == "cuda" else None)

    def _use_timer(self, timer: DeviceTimer | None) -> None:
        # The device versions are bound on the instance, so that the host path runs exactly the
        # plain methods of the class below, with no test of which clock is on.
        self.timer = timer
        self._refs = []
        for name in ("begin", "end", "mark", "end_wait"):
            if timer is None:
                self.__dict__.pop(name, None)
            else:
                setattr(self, name, getattr(self, f"_{name}_device"))

    @property
    def clock_name(self) -> str:
        return "host" if self.timer is None else "cuda"

    def clock(self) -> float:
        return time.perf_counter()

    # ---- recording on the host clock ------------------------------------------------------------
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

    def mark(self) -> Any:
        """A point to measure a wait from (:meth:`end_wait`): the host time, and on CUDA also a
        device event on the current stream."""
        return self.clock()

    def end_wait(self, ev: Event, mark: Any, **args) -> Event:
        """Close collective ``ev`` after waiting for it from ``mark``: ``wait_s`` is the time the
        host (CPU) or the current stream (CUDA) stood still for it (module docstring)."""
        now = self.clock()
        ev.end = now
        if args:
            ev.args.update(args)
        ev.args["wait_s"] = now - mark
        return ev

    # ---- recording on the device (bound by _use_timer) -------------------------------------------
    def _begin_device(self, name: str, lane: str, **args) -> Event:
        ev = Event(name, lane, self.step, self.clock(), None, dict(args))  # host placeholder until resolved
        if self.enabled:
            self.events.append(ev)
            self._open_device(ev)
        return ev

    def _end_device(self, ev: Event, **args) -> Event:
        ev.end = self.clock()
        ev.args.update(args)
        m = self._marks.get(id(ev))
        if m is not None:
            m.end = self.timer.record()
        return ev

    def _mark_device(self) -> Any:
        t = self.clock()
        return (t, self.timer.record()) if self.enabled else (t, None)

    def _end_wait_device(self, ev: Event, mark: Any, **args) -> Event:
        host_t, dev = mark
        now = self.clock()
        ev.end = now
        ev.args.update(args)
        ev.args["wait_s"] = now - host_t  # placeholder until resolved
        m = self._marks.get(id(ev))
        if m is not None and dev is not None:
            m.wait = dev
            m.end = self.timer.record()
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
        if self._marks:
            self.resolve(block=False)
        if self.keep_steps and self.events and self.events[0].step <= self.step - self.keep_steps:
            cutoff = self.step - self.keep_steps
            self.events = deque((e for e in self.events if e.step > cutoff), maxlen=self.max_events)

    # ---- device events → Event fields ----------------------------------------------------------
    def _open_device(self, ev: Event) -> None:
        if not self._refs:
            anchor, t = self.timer.anchor(self.clock)
            self._refs = [(-1, anchor, t)]
        ev.args["clock"] = "host"
        self._marks[id(ev)] = _Marks(ev, self._seq, self.timer.record())
        self._seq += 1
        if len(self._marks) > self.max_events:
            self.resolve(block=False)
            while len(self._marks) > self.max_events:  # never read, never done: keep host times
                self._marks.pop(next(iter(self._marks)))

    def resolve(self, block: bool = True) -> int:
        """Turn the device events of every closed event into its start, end and ``wait_s``.

        ``block``: wait for their device work to finish (reads); otherwise resolve only those
        already complete (``next_step``). Events still open are left for later. Returns how many
        were resolved."""
        if not self._marks:
            return 0
        ready = []
        for key, m in list(self._marks.items()):
            if m.end is None:
                continue
            if block:
                for e in m.recorded():
                    e.synchronize()
            elif not all(e.query() for e in m.recorded()):
                continue
            ready.append(key)
        for key in ready:  # in begin order: references are resolved before what follows them
            self._apply(self._marks.pop(key))
        return len(ready)

    def _apply(self, m: _Marks) -> None:
        i = bisect.bisect_right(self._refs, m.seq, key=lambda r: r[0]) - 1
        _, ref, ref_t = self._refs[max(i, 0)]
        start = ref_t + ref.elapsed_time(m.start) / 1e3
        ev = m.event
        ev.start = start
        ev.end = start + m.start.elapsed_time(m.end) / 1e3
        if m.wait is not None:
            ev.args["wait_s"] = max(m.wait.elapsed_time(m.end) / 1e3, 0.0)
        ev.args["clock"] = "cuda"
        bisect.insort(self._refs, (m.seq, m.start, start), key=lambda r: r[0])
        if len(self._refs) > MAX_REFS + 1:
            del self._refs[1]  # the oldest but the anchor

    # ---- reading ---------------------------------------------------------------------------
    def step_events(self, step: int | None = None) -> list[Event]:
        """Events of one step (default: the last completed step)."""
        if self._marks:
            self.resolve()
        want = self.step - 1 if step is None else step
        return [e for e in self.events if e.step == want]

    def clear(self) -> None:
        self.events.clear()
        self._marks.clear()

    def chrome_events(self, step: int | None = None) -> list[dict]:
        if self._marks:
            self.resolve()
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
        if self._marks:
            self.resolve()
        return [asdict(e) for e in self.events]


def write_chrome_trace(path: str | os.PathLike, events: list[dict]) -> str:
    """Write Chrome-trace JSON (a list of per-rank events merged by the caller) atomically."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
    return path
