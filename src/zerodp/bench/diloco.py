"""``zerodp bench --regimes diloco``: DiLoCo over hybrid ZeRO beside DDP and hybrid ZeRO on one machine (guide §16).

Three contenders on the same GPT, data and seed, N ranks as R = N/g groups of g: **DDP** (stage
0 over all N: its whole AllReduce crosses the groups), **hybrid ZeRO** at ``stage`` (shard groups
of g, the replica AllReduce across them) and **DiLoCo** over the same stage (nothing crosses the
groups on an inner step; every H steps each rank's shard of the pseudo-gradient does,
:mod:`zerodp.engine.outer`). Per contender:

* **cross-group bytes per step**, exact, from the engine's own accounting: what each rank sent per
  step in collectives that cross the groups — DDP's every collective, the ``"inter"`` leg of the
  others (:mod:`zerodp.engine.comm`) — averaged over ``steps`` (a whole number of rounds of H);
  beside it the planner's figure (:func:`zerodp.plan.diloco.diloco_bytes`);
* **step time** under a **simulated slow link** between the groups, one figure per bandwidth: each
  collective that crosses the groups completes ``latency × ring steps + bytes this rank sends /
  bandwidth`` after its real end on this machine (:class:`SlowLink`, the planner's
  :meth:`~zerodp.plan.diloco.GroupLink.time`): the simulated link is in series with this machine's
  own, as a slow link's transfer follows the peers' arrival. The throttle lives here, in the bench
  harness, around the replica group's :class:`~zerodp.engine.comm.Collectives` (DDP: its world
  group); the engine's path never sleeps. What runs between a collective's real end and its wait
  (backward behind DDP's buckets, inner steps behind a delayed fragment, τ) hides the link's time,
  as the planner assumes;
* the outer loop's **local time per sync** (the DiLoCo steps' outer work: Δ, the outer SGD,
  θ_local ← θ_outer, less the exchange's waits) and the **outer state** bytes against 8Ψ/g.

:func:`crossover` fits the measured step-time difference hybrid − DiLoCo, linear in 1/W (guide
§16.4), and solves it for the bandwidth where the two steps are equally long, beside the planner's
figure from the measured compute and outer times (``diloco_plan(..., compute_s=, intra_s=,
outer_s=)``) on the whole link — the simulated one in series with this machine's own
(:func:`own_link`, :func:`series`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

from zerodp.engine.config import DiLoCo
from zerodp.plan.collectives import ring_steps

CONTENDERS = ("ddp", "hybrid", "diloco")


@dataclass(frozen=True)
class DiLoCoBenchSpec:
    """What the DiLoCo regime runs (module docstring). ``bandwidths``: bytes/s per rank on the
    simulated link, one timed phase each (empty: the link of this machine only); ``steps``:
    timed steps per phase (a multiple of ``every``: whole rounds)."""

    model: str = "tiny"
    world_size: int = 4
    shard_size: int = 2
    stage: int = 3
    outer: DiLoCo = DiLoCo(every=100)  # the DiLoCo contender's outer loop: H, F, τ, int8 or fp32
    micro_batch: int = 1
    seq_len: int | None = None  # None: the preset's
    steps: int = 0  # 0: one round (every steps)
    warmup: int = 2
    bandwidths: tuple[float, ...] = ()
    latency: float = 0.0
    seed: int = 0
    contenders: tuple[str, ...] = CONTENDERS

    def __post_init__(self):
        if self.world_size % self.shard_size or self.world_size // self.shard_size < 2:
            raise ValueError(f"the DiLoCo regime needs at least two replica groups: --shard-size {self.shard_size} "
                             f"on --nproc {self.world_size} makes {self.world_size / self.shard_size:g}")
        unknown = set(self.contenders) - set(CONTENDERS)
        if unknown:
            raise ValueError(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
        steps = self.steps or self.outer.every
        if steps % self.outer.every:
            raise ValueError(f"timed steps ({steps}) must be whole rounds of H = {self.outer.every}")
        object.__setattr__(self, "steps", steps)
        if any(not w > 0 for w in self.bandwidths) or self.latency < 0:
            raise ValueError("the simulated link needs positive bandwidths and a latency >= 0")


@dataclass
class Phase:
    """One contender at one bandwidth (None: this machine's link): per-step wall times, the
    outer loop's local time per step, and how long the link's throttle held the collectives."""

    bandwidth: float | None
    step_s: list[float] = field(default_factory=list)
    outer_local_s: float = 0.0  # per step, mean over the phase
    outer_steps: list[float] = field(default_factory=list)  # each step's outer work
    throttled_s: float = 0.0
    cross_wait_s: float = 0.0  # the host's waits for the cross-group collectives, over the phase
    cross_s: float = 0.0  # their durations, issue to end, over the phase

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.step_s) if self.step_s else 0.0


def round_median(step_s: list[float], every: int) -> float:
    """The median over the phase's rounds of the mean step of each round (H steps: a sync's cost
    shared out): robust to the spikes of a loaded machine, and a whole round's average."""
    rounds = [statistics.fmean(step_s[i:i + every]) for i in range(0, len(step_s) - every + 1, every)]
    return statistics.median(rounds) if rounds else 0.0


@dataclass
class ContenderRun:
    """What one contender measured on one rank: bytes per step, state, and a phase per bandwidth."""

    name: str
    cross_bytes: list[float] = field(default_factory=list)  # per step of the first phase
    intra_bytes: list[float] = field(default_factory=list)
    numel: int = 0  # Ψ as the planner takes it (padded flat numel)
    fragment_numels: list[int] = field(default_factory=list)
    outer_state_bytes: int = 0
    expected_outer_state_bytes: int = 0
    syncs: int = 0
    phases: list[Phase] = field(default_factory=list)

    @property
    def cross_bytes_per_step(self) -> float:
        return statistics.fmean(self.cross_bytes) if self.cross_bytes else 0.0


class _Late:
    """A launched collective on the simulated link (:class:`SlowLink`): it completes ``cost`` seconds
    after the real collective on this machine did. The simulated link is in series with this
    machine's own: a slow link's transfer begins when the peers have joined, so its time adds to
    the real one (the peers' arrival and the transfer on this machine's link) rather than hiding
    behind it. The real completion is taken from the collective's future when it has one (then a
    collective launched behind compute and waited for later — DDP's buckets in backward, a
    fragment's exchange under a delay τ — still hides what of the link the compute covered), else
    from when it is first seen complete."""

    def __init__(self, work, cost: float, link: "SlowLink"):
        self.work, self.cost, self.link = work, cost, link
        self.real_end: float | None = None
        future = None
        try:
            future = work.get_future()
        except (AttributeError, RuntimeError):  # the int8 collectives' own work objects have none
            pass
        if future is not None:
            future.add_done_callback(self._done)

    def _done(self, _future) -> None:
        if self.real_end is None:
            self.real_end = time.perf_counter()

    def _left(self) -> float:
        if self.real_end is None:
            self.real_end = time.perf_counter()
        return self.real_end + self.cost - time.perf_counter()

    def wait(self, timeout=None) -> bool:
        self.work.wait() if timeout is None else self.work.wait(timeout)
        left = self._left()
        if left > 0:
            time.sleep(left)
            self.link.slept += left
        return True

    def is_completed(self) -> bool:
        inner = getattr(self.work, "work", None)  # the int8 collectives' own transfer
        if not (inner if inner is not None else self.work).is_completed():
            return False
        return self._left() <= 0


class SlowLink:
    """The simulated link between replica groups, around one :class:`~zerodp.engine.comm.Collectives`
    (module docstring): each collective issued through it completes
    ``latency · ring steps + bytes sent per rank / bandwidth`` after its real completion on this
    machine (:class:`_Late`). ``bandwidth`` None: no throttle. The bench's own wrapper of the
    instance's issue method — the engine's classes are untouched."""

    def __init__(self, comm, bandwidth: float | None = None, latency: float = 0.0):
        from zerodp.engine.comm import ring_sent_bytes

        self.bandwidth, self.latency, self.slept = bandwidth, latency, 0.0
        issue = comm._issue
        n = comm.world_size

        def slow_issue(kind, label, nbytes, launch, after, async_op):
            def slow_launch():
                work = launch()
                if self.bandwidth is None:
                    return work
                cost = self.latency * ring_steps(kind, n) + ring_sent_bytes(kind, nbytes, n) / self.bandwidth
                return _Late(work, cost, self)
            return issue(kind, label, nbytes, slow_launch, after, async_op)

        comm._issue = slow_issue


def _build(name: str, spec: DiLoCoBenchSpec):
    import torch

    import zerodp
    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(spec.seed)
    cfg = dataclasses.replace(PRESETS[spec.model], seq_len=spec.seq_len or PRESETS[spec.model].seq_len)
    model = GPT(cfg)
    factory = lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)  # noqa: E731
    if name == "ddp":
        engine = zerodp.parallelize(model, factory, stage=0)
        return engine, cfg, engine.comm
    units = list(model.blocks) if spec.stage == 3 else None
    outer = spec.outer if name == "diloco" else None
    engine = zerodp.parallelize(model, factory, stage=spec.stage, shard_size=spec.shard_size, outer=outer,
                                units=units)
    return engine, cfg, engine.outer.replicas if outer is not None else engine.replica_comm


def _sent(engine, crosses_all: bool) -> tuple[float, float, float, float]:
    """This rank's last step: (cross-group bytes sent, intra-group bytes sent, the host's waits for the
    cross-group collectives, their durations from issue to end)."""
    cross = intra = waits = spans = 0.0
    for e in engine.recorder.step_events(engine.recorder.step - 1):
        if e.lane != "comm":
            continue
        leg = e.args.get("leg", "intra")
        if crosses_all or leg == "inter":
            cross += e.args["sent_bytes"]
            waits += float(e.args.get("wait_s", 0.0))
            spans += e.duration if e.end is not None else 0.0
        elif leg == "intra":
            intra += e.args["sent_bytes"]
    return cross, intra, waits, spans


def _outer_s(engine) -> float:
    return sum(e.duration for e in engine.recorder.step_events(engine.recorder.step - 1)
               if e.lane == "compute" and e.name == "outer" and e.end is not None)


def run_rank(rank: int, world: int, spec: DiLoCoBenchSpec) -> dict:
    """Every contender on this rank (module docstring): {name: ContenderRun as a dict}. The
    contenders are built side by side and take turns of one round (H steps) each, ``steps / H``
    turns per link, so that a machine whose load drifts slows them alike."""
    import torch

    torch.set_num_threads(1)
    built = {name: _Contender(name, spec, rank) for name in spec.contenders}
    for c in built.values():
        for _ in range(spec.warmup):
            c.step()
    for bandwidth in (None, *spec.bandwidths):
        for c in built.values():
            c.begin(bandwidth)
        for _ in range(spec.steps // spec.outer.every):
            for c in built.values():
                for _ in range(spec.outer.every):
                    c.timed_step(bandwidth is None)
        for c in built.values():
            c.end()
    return {name: dataclasses.asdict(c.finish()) for name, c in built.items()}


class _Contender:
    """One contender's engine on this rank, its simulated link and what it measured."""

    def __init__(self, name: str, spec: DiLoCoBenchSpec, rank: int):
        import torch

        self.name, self.spec = name, spec
        self.engine, self.cfg, comm = _build(name, spec)
        self.link = SlowLink(comm, latency=spec.latency)
        self.run = ContenderRun(name, numel=sum(d["padded_numel"] for d in self.engine.layout()))
        self.gen = torch.Generator().manual_seed(spec.seed + 1000 * rank)
        self.phase: Phase | None = None

    def step(self) -> float:
        import torch
        import torch.nn.functional as F

        x = torch.randint(0, self.cfg.vocab_size, (self.spec.micro_batch, self.cfg.seq_len + 1), generator=self.gen)
        t0 = time.perf_counter()
        F.cross_entropy(self.engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        self.engine.step()
        self.engine.zero_grad()
        return time.perf_counter() - t0

    def begin(self, bandwidth: float | None) -> None:
        self.link.bandwidth, self.link.slept = bandwidth, 0.0
        self.phase = Phase(bandwidth)

    def timed_step(self, count_bytes: bool) -> None:
        self.phase.step_s.append(self.step())
        cross, intra, waits, spans = _sent(self.engine, self.name == "ddp")
        self.phase.cross_wait_s += waits
        self.phase.cross_s += spans
        if self.name == "diloco":
            self.phase.outer_steps.append(max(0.0, _outer_s(self.engine) - waits))
            self.phase.outer_local_s += self.phase.outer_steps[-1]
        if count_bytes:
            self.run.cross_bytes.append(cross)
            self.run.intra_bytes.append(intra)

    def end(self) -> None:
        self.phase.outer_local_s /= len(self.phase.step_s)
        self.phase.throttled_s = self.link.slept
        self.run.phases.append(self.phase)

    def finish(self) -> ContenderRun:
        engine, run = self.engine, self.run
        if engine.outer is not None:
            d = engine.outer.describe()
            run.fragment_numels = d["fragment_numels"]
            run.outer_state_bytes = engine.stats().memory["outer_states"]
            run.expected_outer_state_bytes = d["expected_state_bytes"]
            run.syncs = self.spec.steps // self.spec.outer.every * self.spec.outer.fragments
        return run


def run(spec: DiLoCoBenchSpec) -> list[dict]:
    """The regime on ``spec.world_size`` local gloo ranks: every rank's :func:`run_rank`."""
    from zerodp.spawn import run_local

    return run_local(run_rank, spec.world_size, spec, timeout=3600)


def predicted_bytes(spec: DiLoCoBenchSpec, measured: dict) -> dict[str, float]:
    """The planner's cross-group bytes per step of each contender that ran
    (:func:`zerodp.plan.diloco.diloco_bytes`), each at its own Ψ as the engine padded it: DDP's
    buckets to a multiple of N, hybrid ZeRO's units to a multiple of g, DiLoCo's fragments to whole
    int8 chunks."""
    from zerodp.plan.diloco import diloco_bytes

    s = spec.outer.settings()
    out = {}
    for name, run in measured.items():
        numel = sum(run["fragment_numels"]) if name == "diloco" else run["numel"]
        b = diloco_bytes(numel, spec.world_size, spec.shard_size, s, spec.stage,
                         fragment_sizes=run["fragment_numels"] if name == "diloco" else None)
        out[name] = {"ddp": b.ddp_cross_bytes_per_step, "hybrid": b.hybrid_cross_bytes_per_step,
                     "diloco": b.cross_bytes_per_step}[name]
    return out


def table(spec: DiLoCoBenchSpec, ranks: list[dict]) -> str:
    """The regime's table (rank 0's clock; bytes are every rank's alike): cross-group bytes per step
    measured and planned, the ratio to DDP's, the outer state against 8Ψ/g, and the step time
    (:func:`round_median`) on this machine's link and at each simulated bandwidth."""
    from zerodp.plan._common import fmt_bytes, fmt_time
    from zerodp.plan._common import table as text_table

    r0 = ranks[0]
    planned = predicted_bytes(spec, r0)
    ddp = r0["ddp"]["cross_bytes"] if "ddp" in r0 else None
    ddp_mean = statistics.fmean(ddp) if ddp else None
    labels = {"ddp": "DDP (stage 0 over all N)", "hybrid": f"hybrid stage {spec.stage} (g = {spec.shard_size})",
              "diloco": f"DiLoCo over stage {spec.stage} ({spec.outer.settings().label()})"}
    links = [None, *spec.bandwidths]
    head = ["contender", "cross-group B/step", "planner", "DDP / this", "outer state (8Ψ/g)"] + [
        "step, this machine" if w is None else f"step @ {fmt_bytes(w)}/s" for w in links]
    rows = []
    for name, run in r0.items():
        mean = statistics.fmean(run["cross_bytes"])
        state = (f"{fmt_bytes(run['outer_state_bytes'])} ({fmt_bytes(run['expected_outer_state_bytes'])})"
                 if name == "diloco" else "-")
        rows.append([labels[name], fmt_bytes(mean), fmt_bytes(planned[name]),
                     f"{ddp_mean / mean:,.0f}x" if ddp_mean and mean else "-", state]
                    + [fmt_time(round_median(p["step_s"], spec.outer.every)) for p in run["phases"]])
    title = (f"DiLoCo regime (guide §16): {spec.model}, {spec.micro_batch} sequence(s) per rank per step, "
             f"{spec.world_size} ranks in {spec.world_size // spec.shard_size} groups of {spec.shard_size}; "
             f"{spec.steps} timed steps per link, simulated link latency {fmt_time(spec.latency)} per ring step")
    return text_table(head, rows, title=title)


def unthrottled_waits(r0: dict) -> dict[str, float]:
    """Per step of the unthrottled phase, how long hybrid ZeRO's and DiLoCo's steps waited for their
    cross-group collectives (rank 0's record)."""
    free = {n: [p for p in r0[n]["phases"] if p["bandwidth"] is None][0] for n in ("hybrid", "diloco")}
    return {n: p["cross_wait_s"] / len(p["step_s"]) for n, p in free.items()}


def own_link(r0: dict) -> float:
    """This machine's own link between the groups as the steps met it, in bytes/s (infinite when it
    cost nothing measurable): on the unthrottled phase, the difference of hybrid ZeRO's and
    DiLoCo's exposed waits for their cross-group collectives over the difference of their bytes
    per step — what the two share (the wait for the slowest peer, a collective's fixed cost)
    cancels, what grows with the bytes remains."""
    wait = unthrottled_waits(r0)
    sent = {n: statistics.fmean(r0[n]["cross_bytes"]) for n in wait}
    extra = wait["hybrid"] - wait["diloco"]
    return (sent["hybrid"] - sent["diloco"]) / extra if extra > 0 else float("inf")


def series(bandwidth: float, own: float) -> float:
    """Two links in series, as the bench runs the simulated one behind this machine's own
    (:class:`_Late`): 1/W = 1/W_sim + 1/W_own."""
    return 1 / (1 / bandwidth + 1 / own)


def crossover(spec: DiLoCoBenchSpec, ranks: list[dict]) -> dict:
    """The bandwidth where hybrid ZeRO's and DiLoCo's steps (:func:`round_median`) are equal,
    measured and planned, on two scales.

    *Measured*: a least-squares line through hybrid − DiLoCo against 1/W over the throttled phases
    (rank 0's clock), solved for zero. *Planned*: :func:`zerodp.plan.diloco.diloco_plan` given the
    measured compute and outer times and no overlap, as the throttle runs, on the link the steps ran
    on — the simulated one in series with this machine's own (:func:`own_link`).

    ``*_link_bytes_per_s``: the crossover as the bandwidth of that whole link between the groups,
    1/W_link = 1/W + 1/W_own — what a user's cluster has and gives the planner, and the scale the
    two are compared on; ``*_bytes_per_s``: as the simulated W alone, 1/W = 1/W_link − 1/W_own
    (None when W_link is not below W_own). Where this machine's own link is about as slow as the
    crossover, the second scale magnifies the noise of both figures (guide §16.4)."""
    from zerodp.plan.diloco import diloco_plan

    r0 = ranks[0]
    hyb = {p["bandwidth"]: round_median(p["step_s"], spec.outer.every) for p in r0["hybrid"]["phases"]}
    dil = {p["bandwidth"]: round_median(p["step_s"], spec.outer.every) for p in r0["diloco"]["phases"]}
    points = sorted((1 / w, hyb[w] - dil[w]) for w in spec.bandwidths)
    measured = None
    if len(points) >= 2:
        n = len(points)
        mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        icept = my - slope * mx
        measured = slope / -icept if icept < 0 < slope else None
    # compute + intra: DiLoCo's unthrottled non-sync steps are the inner step alone
    free = [p for p in r0["diloco"]["phases"] if p["bandwidth"] is None][0]
    # the outer work of a round (H steps), the median over every phase's rounds, per step
    o = spec.outer
    rounds = [sum(p["outer_steps"][i:i + o.every]) for p in r0["diloco"]["phases"]
              for i in range(0, len(p["outer_steps"]) - o.every + 1, o.every)]
    outer_local = statistics.median(rounds) / o.every
    inner = statistics.median(free["step_s"])
    numels = r0["diloco"]["fragment_numels"]
    own = own_link(r0)
    def plan_at(bandwidth: float):
        return diloco_plan(sum(numels), "H100", spec.world_size, spec.shard_size, spec.stage, every=o.every,
                           fragments=o.fragments, compress=o.compress or "none", delay=o.delay, precision="fp32",
                           compute_s=inner, intra_s=0.0, outer_s=outer_local * o.every, hidden_s=0.0,
                           inter_group_bw=series(bandwidth, own), inter_group_latency=spec.latency,
                           fragment_sizes=numels)

    def difference(plan) -> float:
        step = {m["method"]: m["step_s"] for m in plan.methods}
        return step["hybrid"] - step["diloco"]

    plan = plan_at(min(spec.bandwidths) if spec.bandwidths else 1e9)
    planned_points = [(x, difference(plan_at(1 / x))) for x, _ in points]
    link = plan.crossover_bandwidth_bytes_per_s
    return {"points": points, "planned_points": planned_points, "measured_bytes_per_s": measured,
            "own_link_bytes_per_s": own,
            "planned_bytes_per_s": 1 / (1 / link - 1 / own) if link and link < own else None,
            "measured_link_bytes_per_s": series(measured, own) if measured else None,
            "planned_link_bytes_per_s": link, "planner_crossover": plan.crossover,
            "outer_local_s_per_sync": outer_local * o.every / o.fragments, "inner_step_s": inner}


def crossover_lines(cross: dict) -> list[str]:
    """:func:`crossover`'s figures as the report prints them: the whole link's crossover, measured
    and planned, then the simulated bandwidth alone and this machine's own link."""
    def mb(x):
        return f"{x / 1e6:,.1f} MB/s" if x and x != float("inf") else "none"

    return [f"crossover (the link between the groups: simulated, in series with this machine's own): "
            f"DiLoCo's step is the shorter below {mb(cross['measured_link_bytes_per_s'])} measured, "
            f"{mb(cross['planned_link_bytes_per_s'])} planned (diloco_plan with the measured inner step "
            f"{cross['inner_step_s'] * 1e3:.1f} ms and outer work {cross['outer_local_s_per_sync'] * 1e3:.2f} ms "
            f"per sync)",
            f"  as the simulated bandwidth alone: {mb(cross['measured_bytes_per_s'])} measured, "
            f"{mb(cross['planned_bytes_per_s'])} planned; this machine's own link as the steps met it: "
            f"{mb(cross['own_link_bytes_per_s'])}"]
