"""``zerodp bench``: our engine side by side with its PyTorch peer, stage by stage, in two regimes.

What is measured (one spawned group of gloo ranks for all regimes; within a regime, stage after
stage, the floor and one stage's contenders alive at once — :func:`stage_groups`; where those
would not fit the machine's memory, ours and its peer alone, then the others):

- **step time**: every training step (forward, backward, optimizer, zero grad; for our engine
  also the wait for any in-flight parameter AllGather, so that no work leaks into the next
  contender's step) timed on each rank between barriers; a step takes as long as its slowest rank,
  so the figure per step is the max over ranks, and per contender the **median** over the timed
  steps. Contenders of a stage run **alternated**, in turns (:func:`schedule`): each contender
  in turn runs ``turn`` consecutive steps, of which the first is not timed — it finds the caches
  and TLBs the previous contender filled with its own 100+ MiB of states and pays to refill them,
  which a training job, stepping one model, never does; the order of the turns is shuffled each
  round (seeded, the same on every rank), so drift of a shared machine hits all alike and no
  contender always runs right after the same other one. The first ``warmup`` rounds (one step
  each) are not timed.
- **ratio** ours/peer of the medians, and **overhead** = median / the floor's median (the floor
  does the same per-rank work with no collectives; guide §7: ≈ 1 when compute-bound).
- **peak memory per rank**: the RSS growth while the contender is built and runs its first
  ``memory_steps`` steps, from ``VmHWM`` after a reset (:mod:`zerodp.bench.probe`) — model states +
  activations + buffers. The first step alone would miss the peak of training: its forward runs
  before any gradient or optimizer state exists (the states are born in its backward and
  optimizer step), so from the second step on every forward holds them all; and glibc's heap
  settles only after a few steps (its mmap threshold rises with the buffers the first steps free).
  By default (``memory="fresh"``) each contender is measured alone, in its own spawned group per
  regime (:func:`_rank_memory`): contenders built one after another in one process would each find
  the heap the earlier ones left (glibc keeps freed holes resident), and the figure would depend on
  the order. Before the reading the group builds the same contender once on the nano model and
  steps it (:func:`_warm_up_process`): what a process pays once (lazy imports, the optimizer
  machinery's first construction, ~70 MiB on CPU; gloo's first collectives; kernels) is paid
  before the peak is read. With glibc's heap, one reading moves by up to ±20 MiB from group to group
  (docs/benchmarks-memory.md): ``memory_repeats`` R > 1 measures every contender in R fresh groups,
  all contenders once before any twice, and takes the median per rank. ``memory="shared"`` reads it
  in the timing group instead (after the same warm-up of every contender, over the build and first
  step only), cheaper, for quick runs.
- **bucket sizes**: our stages 0-1 and DDP use ``bucket_mb`` (25 MiB, DDP's default); at stage 0-1
  gradients are kept at rest, so the size changes only how many collectives run. Our stage 2 keeps
  no gradients at rest: a bucket's full gradients live from its first gradient to the end of its
  ReduceScatter (guide §12.5), so its size is memory held during backward. Its peer reduces per
  ``fully_shard`` unit, one transformer block; by default (``stage2_bucket_mb="unit"``) our stage 2
  takes buckets of one block's parameter bytes (:func:`unit_mb`), the same size and number of
  gradient collectives as FSDP2's, so time and memory compare like with like. A number of MiB
  instead (``zerodp bench --stage2-bucket-mb 25``) shows the other trade-off.
- **model-state bytes** per rank: tensor storages of params, grads, optimizer state
  (:mod:`zerodp.bench.peers`).
- **bytes sent per step** per rank: growth of the process's ``wchar`` over the step, i.e. what
  gloo wrote to its sockets, measured identically for our engine and the peers; and for our
  engine also what its own trace says it sent (``sent_bytes`` of the step's collectives, by leg,
  :func:`trace_sent_bytes`). The two differ where gloo's algorithm is not the ring the trace
  counts (gloo's ReduceScatter sends as much as an AllReduce).

Two regimes (guide §7, guide §13): **compute-bound** — many tokens per rank (2048), where every
contender should sit near the floor — and **communication-bound** — few (32), where the
implementation's fixed costs decide. With a calibration profile the planner's prediction
(:func:`zerodp.bench.predict.predict_step`) is printed next to each measured median, and the
stage-0 row built with ``bucket_mb="auto"`` (the engine chooses from the profile,
:func:`zerodp.bench.auto.choose_bucket_mb`) is compared with the default 25 MB.

**Compressed and hybrid** (guide §14-§15; ``zerodp bench --compress none,bf16-reduce,int8
--shard-size G``, :attr:`BenchSpec.compress`, :attr:`BenchSpec.shard_size`): our engine with
``reduce_dtype="bf16"``, int8 ``quantize_params`` / ``quantize_grads``, and shard groups of G ranks
(stages 1-3), as extra contenders of ours in the stage group of their stage, built and timed
alternated with the rest (:data:`zerodp.bench.peers.VARIANTS`). :func:`compressed_rows` sets each
against our plain row of its stage: time, ×floor, bytes per leg from the trace and their ratio to
the plain row's next to the planner's (:func:`zerodp.plan.hybrid.wire_bytes`). Without these
options the bench is what it was.

On CUDA (``BenchSpec(device="cuda")``, what ``python -m zerodp.bench.gpu_check`` runs): NCCL, rank r
on ``cuda:r`` (one GPU per rank, so world 1 is allowed there: the comparison then measures fixed
costs), the device synchronized before each step's start and end time are read, peak memory from
``torch.cuda.max_memory_allocated`` instead of RSS, and no bytes-sent figure (NCCL writes no socket
the process's ``wchar`` would see). CPU runs are unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from zerodp.bench import probe
from zerodp.bench.peers import COMPARISONS, CONTENDERS, VARIANTS, variant_applies, variant_name
from zerodp.plan.units import MIB

RATIO_TARGET = 1.05  # ours/PyTorch median step time for stages 0 and 3
PREDICTION_TOLERANCE = 0.25  # predicted within ±25 % of measured
MAX_STEP_SCALE = 5  # a cheap regime times up to 5× the steps of the costliest (BenchSpec.steps_for)
UNIT = "unit"  # BenchSpec.stage2_bucket_mb: buckets as large as one FSDP2 unit (one block)


@dataclass(frozen=True)
class Regime:
    """Tokens per rank as ``micro_batch`` sequences of ``seq_len`` tokens."""

    name: str
    micro_batch: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


DEVICES = ("cpu", "cuda")
MEMORY_MODES = ("fresh", "shared")
REGIMES = {"compute": Regime("compute", 8, 256), "comm": Regime("comm", 1, 32)}
QUICK_REGIMES = {"compute": Regime("compute", 2, 64), "comm": Regime("comm", 1, 8)}


@dataclass(frozen=True)
class BenchSpec:
    model: str = "small"
    world_size: int = 2
    regimes: tuple[Regime, ...] = tuple(REGIMES.values())
    stages: tuple[int, ...] = (0, 1, 2, 3)
    warmup: int = 3
    steps: int = 6
    turn: int = 3  # consecutive steps per contender turn, the first not timed (module docstring)
    memory_steps: int = 3  # steps the fresh memory groups run while their peak is read
    memory_repeats: int = 1  # fresh memory groups per contender; the peak is their median per rank
    bucket_mb: float = 25.0
    # Our stage 2 (its gradient buffers are transient, so a bucket's size is memory held in
    # backward, guide §12.5): "unit" — buckets as large as one transformer block's parameters, the
    # unit its peer FSDP2 reduces at (module docstring, "bucket sizes"); or a number of MiB.
    stage2_bucket_mb: "float | str" = "unit"
    seed: int = 0
    profile: str | None = None  # calibration profile: predictions and the auto bucket row
    device: str = "cpu"  # "cuda": NCCL, rank r on cuda:r (module docstring)
    # Compressed and hybrid contenders of ours (guide §14-§15), beside ours at each stage: the
    # planner's compression names (zerodp.plan.hybrid.COMPRESSIONS; "none" adds nothing), and a
    # shard-group size g < world_size for hybrid sharding at stages 1-3 (None: no hybrid rows).
    compress: tuple[str, ...] = ("none",)
    shard_size: int | None = None
    # Peak memory: "fresh" — each contender built and stepped memory_steps times in its own spawned
    # group, alone (what a user's job sees); "shared" — inside the timing group, over the build and
    # first step of the contenders built one after another in the same processes (cheaper; the
    # allocator's state then depends on what ran before).
    memory: str = "fresh"
    # The fresh memory groups' allocator (zerodp.bench.probe.set_malloc): "default", glibc as a
    # user's job gets it; "mmap", its mmap threshold fixed, so that RSS follows the live tensors.
    malloc: str = "default"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        least = 1 if self.device == "cuda" else 2
        if self.world_size < least:
            raise ValueError(f"world_size must be >= {least} to compare data-parallel engines on "
                             f"{self.device}, got {self.world_size}")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {', '.join(MEMORY_MODES)}, got {self.memory!r}")
        if self.malloc not in probe.MALLOC_MODES:
            raise ValueError(f"malloc must be one of {', '.join(probe.MALLOC_MODES)}, got {self.malloc!r}")
        if self.memory_repeats < 1:
            raise ValueError(f"need memory_repeats >= 1, got {self.memory_repeats}")
        if self.memory_repeats > 1 and self.memory != "fresh":
            raise ValueError(f"memory_repeats={self.memory_repeats} repeats the fresh memory groups: use "
                             "memory='fresh'")
        if self.malloc != "default" and self.memory != "fresh":
            raise ValueError(f"malloc={self.malloc!r} applies to the fresh memory groups: use memory='fresh' "
                             "(the timing group keeps the default allocator)")
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"need warmup >= 1 and steps >= 1, got warmup={self.warmup}, steps={self.steps}")
        if self.turn < 1 or self.memory_steps < 1:
            raise ValueError(f"need turn >= 1 and memory_steps >= 1, got turn={self.turn}, "
                             f"memory_steps={self.memory_steps}")
        bad = [s for s in self.stages if s not in COMPARISONS]
        if bad or not self.stages:
            raise ValueError(f"stages must be a non-empty subset of {sorted(COMPARISONS)}, got {list(self.stages)}")
        if not self.regimes:
            raise ValueError("give at least one regime")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        b2 = self.stage2_bucket_mb
        if b2 != UNIT and (isinstance(b2, bool) or not isinstance(b2, (int, float)) or not b2 > 0):
            raise ValueError(f"stage2_bucket_mb must be {UNIT!r} (one transformer block, FSDP2's unit) or a "
                             f"positive number of MiB, got {b2!r}")
        from zerodp.plan.hybrid import COMPRESSIONS

        bad = [c for c in self.compress if c not in COMPRESSIONS]
        if bad or not self.compress:
            raise ValueError(f"compress must be a non-empty list of {', '.join(COMPRESSIONS)}, got "
                             f"{list(self.compress)}")
        g = self.shard_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1 or g >= self.world_size
                              or self.world_size % g):
            raise ValueError(f"shard_size must divide world_size ({self.world_size}) and be smaller (hybrid "
                             f"sharding: shard groups of g ranks, replicated world/g times), got {g}")

    def steps_for(self, regime: Regime) -> int:
        """Timed steps in ``regime``: ``steps`` for the most tokens per rank; a cheaper regime gets
        more, in proportion to its tokens, up to :data:`MAX_STEP_SCALE` times as many (short steps
        are the noisiest, and cost little to repeat)."""
        largest = max(r.tokens for r in self.regimes)
        return self.steps * max(1, min(MAX_STEP_SCALE, largest // regime.tokens))

    def rounds_for(self, regime: Regime) -> int:
        """Rounds of turns after the build step: ``warmup - 1`` untimed ones, then enough to time
        :meth:`steps_for` steps (:func:`schedule`)."""
        return self.warmup - 1 + timed_rounds(self.steps_for(regime), self.turn)

    def variants(self, stage: int) -> list[str]:
        """Our compressed and hybrid contenders at ``stage`` (:data:`zerodp.bench.peers.VARIANTS`)."""
        out = []
        for hybrid in (False, True) if self.shard_size is not None else (False,):
            for c in dict.fromkeys(self.compress):
                if (c != "none" or hybrid) and variant_applies(stage, c, hybrid):
                    out.append(variant_name(stage, c, hybrid))
        return out

    def contenders(self, with_auto: bool) -> list[str]:
        names = ["floor"]
        for s in self.stages:
            ours, peers = COMPARISONS[s]
            names += [ours, *peers, *self.variants(s)]
        if with_auto and 0 in self.stages:
            names.append("ours0_auto")
        return names


def timed_rounds(steps: int, turn: int) -> int:
    """Rounds of :func:`schedule` that time at least ``steps`` steps of each contender (a turn of
    ``turn`` > 1 steps times all but its first)."""
    return -(-steps // max(1, turn - 1))


def schedule(names: list[str], warmup: int, rounds: int, turn: int, seed: int):
    """The bench's order of steps after each contender's first (module docstring): yields
    ``(round, name, timed)``. Rounds ``1 .. warmup - 1`` are one untimed step per contender; each
    later round gives every contender a turn of ``turn`` consecutive steps, the first untimed
    when ``turn`` > 1; the order of the turns is shuffled per round, seeded, so every rank walks
    the same schedule."""
    for i in range(1, rounds + 1):
        order = list(names)
        random.Random(seed * 1_000_003 + i).shuffle(order)
        for name in order:
            if i < warmup:
                yield i, name, False
                continue
            for j in range(turn):
                yield i, name, turn == 1 or j > 0


def steps_per_contender(warmup: int, rounds: int, turn: int) -> int:
    """Steps each contender runs in :func:`schedule`, its first (build) step included."""
    return 1 + sum(1 if i < warmup else turn for i in range(1, rounds + 1))


@dataclass
class ContenderResult:
    name: str
    label: str
    stage: int | None
    role: str
    times_s: list[float]  # per timed step, max over ranks
    median_s: float
    peak_rss_bytes: list[int | None]  # per rank
    model_state_bytes: list[int]  # per rank
    sent_bytes_per_step: list[float | None]  # per rank, median over timed steps
    options: dict = field(default_factory=dict)
    own_comm: dict = field(default_factory=dict)  # ours: the engine's own accounting, rank 0
    first_loss: float = float("nan")
    predicted_s: float | None = None
    # ours: bytes this rank sent per step by leg ("intra", "inter"), summed over the step's
    # collectives in the engine's trace (``sent_bytes``), median over timed steps; rank 0
    wire_bytes: dict | None = None
    predicted_wire_bytes: dict | None = None  # the planner's, by leg (bench.predict)

    @property
    def wire_total(self) -> float | None:
        return None if self.wire_bytes is None else sum(self.wire_bytes.values())


@dataclass
class RegimeResult:
    regime: Regime
    contenders: dict[str, ContenderResult]
    wall_s: float


@dataclass
class Row:
    """One line of the summary: ours against one peer in one regime (ratios from the medians)."""

    regime: str
    tokens_per_rank: int
    stage: int
    ours: str
    peer: str
    ours_ms: float
    peer_ms: float
    ratio: float  # ours / peer
    floor_ms: float | None
    ours_overhead: float | None  # ours / floor
    peer_overhead: float | None
    predicted_ms: float | None = None
    predicted_error: float | None = None  # (predicted − measured) / measured, ours
    # Quartiles of the per-step ratios ours_i / peer_i (step i of both ran in the same round): how
    # far the ratio moves from step to step, i.e. how much of it is noise.
    paired_q1: float | None = None
    paired_q3: float | None = None

    @property
    def target(self) -> float | None:
        return RATIO_TARGET if self.stage in (0, 3) and self.peer in _REFERENCE_PEERS else None


SHORT_LABELS = {"floor": "floor", "ours0": "zerodp", "ddp": "DDP", "ddp_bucket_view": "DDP bucket view",
                "ours1": "zerodp", "zero_ddp": "ZeRO-opt + DDP", "ours2": "zerodp", "fsdp2_keep": "FSDP2 keep",
                "ours3": "zerodp", "fsdp2": "FSDP2", "ours0_auto": "zerodp auto bucket"}
_REFERENCE_PEERS = {peers[0] for _, peers in COMPARISONS.values()}


def display_label(c: "ContenderResult", bucket: bool = True) -> str:
    """A contender's label in the tables: the shard-group size of a hybrid one and, with
    ``bucket``, the bucket size where it is not the bench's ``bucket_mb`` (the auto row's choice,
    our stage 2's, :func:`contender_buckets`)."""
    label = c.label
    if "shard_size" in c.options:
        label = label.replace("hybrid", f"hybrid g={c.options['shard_size']}")
    if not bucket:
        return label
    if c.name == "ours0_auto":
        return label + f" ({c.options['bucket_mb']:.3g} MB)"
    if c.role == "ours" and c.stage == 2 and "bucket_mb" in c.options:
        return label + f" ({c.options['bucket_mb']:.3g} MiB buckets)"
    return label


def short_label(name: str) -> str:
    """A bar's label: :data:`SHORT_LABELS`, or "zerodp int8", "zerodp hybrid bf16" for the variants."""
    if name in SHORT_LABELS:
        return SHORT_LABELS[name]
    return "zerodp " + " ".join(name.split("_")[1:])


@dataclass
class BenchResult:
    spec: BenchSpec
    machine: dict
    regimes: list[RegimeResult]
    auto_bucket_mb: dict[str, float] = field(default_factory=dict)
    params: int = 0

    def rows(self) -> list[Row]:
        return summary_rows(self)

    def to_dict(self) -> dict:
        return {
            "spec": asdict(self.spec),
            "machine": self.machine,
            "params": self.params,
            "auto_bucket_mb": self.auto_bucket_mb,
            "regimes": [{"regime": asdict(r.regime), "tokens_per_rank": r.regime.tokens, "wall_s": r.wall_s,
                         "contenders": {k: asdict(c) for k, c in r.contenders.items()}} for r in self.regimes],
            "rows": [asdict(row) | {"target": row.target} for row in self.rows()],
            "compressed_rows": [asdict(row) for row in compressed_rows(self)],
        }


def result_from_dict(d: dict) -> BenchResult:
    """A :class:`BenchResult` back from its JSON (``bench.json``): re-render without re-measuring."""
    spec_d = dict(d["spec"])
    spec_d["regimes"] = tuple(Regime(**r) for r in spec_d["regimes"])
    spec_d["stages"] = tuple(spec_d["stages"])
    spec_d["compress"] = tuple(spec_d.get("compress", ("none",)))
    spec_d.setdefault("stage2_bucket_mb", spec_d.get("bucket_mb", BenchSpec.bucket_mb))  # older: bucket_mb
    spec = BenchSpec(**spec_d)
    regimes = [RegimeResult(Regime(**r["regime"]), {k: ContenderResult(**c) for k, c in r["contenders"].items()},
                            r["wall_s"]) for r in d["regimes"]]
    return BenchResult(spec, d["machine"], regimes, d.get("auto_bucket_mb", {}), d.get("params", 0))


# ---- the measurement, on every rank ------------------------------------------------------------
def _rank_device(device: str):
    """This rank's device: the CPU, or the current CUDA device (``_rank_bench`` sets it)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _make_model_factory(model: str, seed: int, device: str = "cpu"):
    def make():
        import torch

        from zerodp.train.model import GPT, PRESETS

        torch.manual_seed(seed)
        m = GPT(PRESETS[model])
        return m if device == "cpu" else m.to(_rank_device(device))
    return make


def _batches(regime: Regime, vocab: int, count: int, rank: int, world: int, seed: int, device: str = "cpu"):
    import torch

    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i * world + rank)
        tok = torch.randint(0, vocab, (regime.micro_batch, regime.seq_len + 1), generator=g)
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        if device != "cpu":
            x, y = x.to(_rank_device(device)), y.to(_rank_device(device))
        out.append((x, y))
    return out


def _device_sync(device: str) -> None:
    """On CUDA the host only enqueues: wait for the device before reading a clock."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class _CudaPeak:
    """``with _CudaPeak() as m: work()`` then ``m.bytes``: the allocator's peak growth over the work."""

    def __enter__(self) -> "_CudaPeak":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._base = torch.cuda.memory_allocated()
        self.bytes = None
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.synchronize()
        self.bytes = torch.cuda.max_memory_allocated() - self._base


def _settle(c) -> None:
    """Our engine may leave a parameter AllGather in flight after step(): wait for it."""
    if c.engine is not None:
        c.engine.module  # noqa: B018 — the property waits for in-flight parameter collectives


def _own_comm(c) -> dict:
    if c.engine is None:
        return {}
    s = c.engine.stats()
    return {k: {"count": v.count, "bytes": v.bytes, "sent_bytes": v.sent_bytes}
            for k, v in s.collectives.items()}


def trace_sent_bytes(engine) -> dict[str, float]:
    """Bytes this rank sent in the engine's last completed step, by leg: ``sent_bytes`` of every
    collective in its trace (``args["leg"]``: "intra" in the shard group, "inter" across replicas,
    guide §14). Compressed collectives record the bytes they put on the wire (guide §15)."""
    from zerodp.engine.trace import COMM

    rec = engine.recorder
    out = {"intra": 0.0, "inter": 0.0}
    for e in rec.step_events(rec.step - 1):
        if e.lane == COMM:
            leg = e.args.get("leg", "intra")
            out[leg] = out.get(leg, 0.0) + float(e.args.get("sent_bytes", 0.0))
    return out


def median_legs(per_step: list[dict[str, float]]) -> dict[str, float] | None:
    """Per leg, the median over steps (None when nothing was recorded)."""
    if not per_step:
        return None
    return {k: statistics.median(d.get(k, 0.0) for d in per_step) for k in per_step[0]}


def _prime(make, batch) -> None:
    """One untimed step of a throwaway model: lazy library set-up is nobody's peak memory."""
    import torch

    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    model(*batch).backward()
    opt.step()
    del model, opt


def stage_groups(names: list[str], fits: Callable[[list[str]], bool] | None = None) -> list[list[str]]:
    """The contenders alive at the same time: the floor with each stage's own (ours + peers + the
    auto row). Stages run one after the other, so the memory needed is the largest group's, not
    the sum over every contender (a 124M-parameter model at four stages would not fit otherwise).

    ``fits``: whether a group fits the machine's memory. A stage group that does not is split:
    ours with its reference peer alone (the comparison stays alternated step by step), then the
    floor and the stage's other contenders in as few groups as fit; the floor's times are pooled
    over the groups it runs in."""
    by_stage: dict[int, list[str]] = {}
    for name in names:
        stage = CONTENDERS[name][0]
        if stage is not None:
            by_stage.setdefault(stage, []).append(name)
    out = []
    for stage, group in sorted(by_stage.items()):
        whole = ["floor", *group]
        if fits is None or fits(whole):
            out.append(whole)
            continue
        ours, peers = COMPARISONS[stage]
        pair = [n for n in (ours, peers[0]) if n in group]
        out.append(pair)
        current: list[str] = []
        for name in ["floor", *(n for n in group if n not in pair)]:
            if current and not fits(current + [name]):
                out.append(current)
                current = []
            current.append(name)
        out.append(current)
    return out or [["floor"]]


def _run_regime(rank: int, world: int, spec: BenchSpec, regime: Regime, names: list[str],
                bucket_mb: dict[str, "float | str"], groups: list[list[str]] | None = None) -> dict:
    """Per stage group: build its contenders (memory measured), time them alternated, free them
    (module docstring). The floor runs in every group; its times are pooled."""
    import gc

    from zerodp.train.model import PRESETS

    cfg = PRESETS[spec.model]
    if regime.seq_len > cfg.seq_len:
        raise ValueError(f"regime {regime.name}: seq_len {regime.seq_len} > the model's {cfg.seq_len}")
    make = _make_model_factory(spec.model, spec.seed, spec.device)
    rounds = spec.rounds_for(regime)
    total = steps_per_contender(spec.warmup, rounds, spec.turn)
    batches = _batches(regime, cfg.vocab_size, total, rank, world, spec.seed, spec.device)
    _prime(make, batches[0])
    groups = [[n for n in g if n in names] for g in (groups or stage_groups(names))]
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=(total - 1) * sum(len(g) for g in groups), unit="step", leave=False,
                   desc=f"bench {regime.name} ({regime.tokens} tok/rank)")
    out: dict = {}
    for group in groups:
        res = _run_group(rank, world, spec, regime, group, bucket_mb, make, batches, bar)
        for name, r in res.items():
            if name in out:  # the floor of another group: pool its times
                out[name]["times"] += r["times"]
            else:
                out[name] = r
        gc.collect()
    if bar is not None:
        bar.close()
    return out


def _run_group(rank, world, spec, regime, names, bucket_mb, make, batches, bar) -> dict:
    import torch.distributed as dist

    from zerodp.bench.peers import build

    contenders, peak, first_loss, states = {}, {}, {}, {}
    for name in names:  # one at a time: its RSS peak while built and stepped once
        dist.barrier()
        with (_CudaPeak() if spec.device == "cuda" else probe.PeakMemory()) as mem:
            c = build(name, make, world, bucket_mb.get(name, spec.bucket_mb), spec.profile, regime.tokens,
                      spec.shard_size)
            first_loss[name] = float(c.step(*batches[0]))
            _settle(c)
        contenders[name], peak[name] = c, mem.bytes
    times = {n: [] for n in names}
    sent = {n: [] for n in names}
    wire = {n: [] for n in names}
    done = {n: 1 for n in names}  # steps each contender ran: its first, above
    for _, name, timed in schedule(names, spec.warmup, spec.rounds_for(regime), spec.turn, spec.seed):
        c = contenders[name]
        k = done[name]
        done[name] += 1
        # Model states are counted once, after backward of the second step, when grads and
        # optimizer states both exist; the count's own time is taken out of the step's.
        hook_s = [0.0]

        def count_states(c=c, name=name, hook_s=hook_s):
            h0 = time.perf_counter()
            states[name] = c.model_state_bytes()
            hook_s[0] = time.perf_counter() - h0
        dist.barrier()
        _device_sync(spec.device)
        w0 = probe.bytes_written() if spec.device == "cpu" else None
        t0 = time.perf_counter()
        c.step(*batches[k], on_backward=count_states if k == 1 else None)
        _settle(c)
        _device_sync(spec.device)
        t1 = time.perf_counter()
        w1 = probe.bytes_written() if spec.device == "cpu" else None
        if timed:
            times[name].append(t1 - t0 - hook_s[0])
            sent[name].append(None if w0 is None else w1 - w0)
            if c.engine is not None:
                wire[name].append(trace_sent_bytes(c.engine))
        if bar is not None:
            bar.update()
    out = {}
    for name in names:
        c = contenders[name]
        s = [v for v in sent[name] if v is not None]
        out[name] = {"times": times[name], "peak": peak[name], "states": states[name],
                     "sent": statistics.median(s) if s else None, "options": c.options,
                     "own_comm": _own_comm(c) if rank == 0 else {}, "first_loss": first_loss[name],
                     "wire": median_legs(wire[name])}
    contenders.clear()
    dist.barrier()
    return out


def _rank_bench(rank: int, world: int, spec: BenchSpec, names: list[str],
                bucket_mb: dict[str, dict[str, "float | str"]],
                groups: list[list[str]] | None = None) -> list[tuple[dict, float]]:
    """Every regime in one spawned group (a spawn costs seconds): results and wall time each."""
    import gc

    _set_rank_device(spec, rank)
    _warm_up_process(rank, world, spec, names)
    out = []
    for regime in spec.regimes:
        t0 = time.perf_counter()
        res = _run_regime(rank, world, spec, regime, names, bucket_mb.get(regime.name, {}), groups)
        gc.collect()
        out.append((res, time.perf_counter() - t0))
    return out


def _set_rank_device(spec: BenchSpec, rank: int) -> None:
    """On CUDA, rank r runs on cuda:r (module docstring)."""
    if spec.device == "cuda":
        import torch

        torch.cuda.set_device(rank)


def _rank_memory(rank: int, world: int, spec: BenchSpec, regime: Regime, name: str,
                 bucket_mb: "float | str") -> int | None:
    """One contender alone in a fresh group: warm up, then its peak growth while built and stepped
    ``memory_steps`` times (module docstring, "peak memory per rank")."""
    from zerodp.bench.peers import build
    from zerodp.train.model import PRESETS

    _set_rank_device(spec, rank)
    if not probe.set_malloc(spec.malloc):
        raise RuntimeError(f"malloc={spec.malloc!r}: glibc's mallopt is not available on this machine")
    _warm_up_process(rank, world, spec, [name])
    make = _make_model_factory(spec.model, spec.seed, spec.device)
    batches = _batches(regime, PRESETS[spec.model].vocab_size, spec.memory_steps, rank, world, spec.seed,
                       spec.device)
    with (_CudaPeak() if spec.device == "cuda" else probe.PeakMemory()) as mem:
        c = build(name, make, world, bucket_mb, spec.profile, regime.tokens, spec.shard_size)
        for x, y in batches:
            c.step(x, y)
            _settle(c)
    return mem.bytes


def _warm_up_process(rank: int, world: int, spec: BenchSpec, names: list[str]) -> None:
    """Build every contender once on the nano model, step it, drop it: the process's one-time
    costs (imports, first optimizer construction, gloo's first collectives, kernels) are paid
    before any peak is read (module docstring, "peak memory per rank")."""
    import gc

    from zerodp.bench.peers import build

    make = _make_model_factory("nano", spec.seed, spec.device)
    regime = Regime("warm-up", 1, 8)
    x, y = _batches(regime, 256, 1, rank, world, spec.seed, spec.device)[0]
    for name in names:
        c = build(name, make, world, 25.0, None, regime.tokens, spec.shard_size)
        c.step(x, y)
        del c
        gc.collect()


# ---- the driver, in the parent ----------------------------------------------------------------
def _predict(cal: dict, spec: BenchSpec, regime: Regime, name: str, bucket_mb: float):
    """Predicted step time (s) and the planner's bytes per leg (or None) of contender ``name``."""
    from zerodp.bench.predict import predict_step
    from zerodp.train.model import PRESETS

    stage, role, _ = CONTENDERS[name]
    cfg = PRESETS[spec.model]
    if role == "floor":
        p = predict_step(cal, cfg, 0, regime.micro_batch, regime.seq_len, bucket_mb)
        return p.forward_s + p.backward_s + p.optimizer_s, None
    if role == "ours":
        _, compress, hybrid = VARIANTS.get(name, (stage, "none", False))
        p = predict_step(cal, cfg, stage, regime.micro_batch, regime.seq_len, bucket_mb, compress=compress,
                         shard_size=spec.shard_size if hybrid else None)
        return p.step_s, p.wire_bytes
    return None, None


def planner_wire_bytes(spec: BenchSpec, regime: Regime, name: str) -> dict[str, float]:
    """The planner's bytes per rank per step by leg for our contender ``name`` (no calibration
    needed: :func:`zerodp.bench.predict.predicted_wire_bytes`, guide §14-§15)."""
    from zerodp.bench.predict import predicted_wire_bytes, root_share
    from zerodp.plan.calibrated import gpt_layer_shapes
    from zerodp.train.model import PRESETS

    stage = CONTENDERS[name][0]
    _, compress, hybrid = VARIANTS.get(name, (stage, "none", False))
    shapes = gpt_layer_shapes(PRESETS[spec.model], regime.seq_len)
    params = sum(x.params for x in shapes)
    return predicted_wire_bytes(stage, params, spec.world_size, compress, spec.shard_size if hybrid else None,
                                kept_last_share=root_share(shapes))


def unit_mb(model: str) -> float:
    """MiB of one transformer block's parameters (fp32) of preset ``model``: the unit FSDP2 reduces
    at, one ``fully_shard`` per block (:func:`zerodp.bench.peers.build`)."""
    import torch

    from zerodp.train.model import GPT, PRESETS

    with torch.device("meta"):
        block = GPT(PRESETS[model]).blocks[0]
    return sum(p.numel() * p.element_size() for p in block.parameters()) / MIB


def contender_buckets(spec: BenchSpec, names: list[str]) -> dict[str, "float | str"]:
    """The ``bucket_mb`` of each contender that does not take ``spec.bucket_mb`` (module docstring,
    "bucket sizes"): the auto row's ``"auto"`` (the engine chooses from the profile when built),
    and our stage-2 contenders' ``spec.stage2_bucket_mb`` (``"unit"``: :func:`unit_mb`)."""
    stage2 = [n for n in names if CONTENDERS[n][:2] == (2, "ours")]
    out: dict[str, float | str] = {"ours0_auto": "auto"} if "ours0_auto" in names else {}
    if stage2:
        b2 = spec.stage2_bucket_mb
        out.update(dict.fromkeys(stage2, unit_mb(spec.model) if b2 == UNIT else float(b2)))
    return out


def check_profile(profile: str, model: str, world_size: int) -> dict:
    """The profile's calibration table, if it was measured for this model and world size."""
    from zerodp.bench.calibrate import load_calibration

    cal = load_calibration(profile)["calibration"]
    measured = cal["compute"]["model"]
    if measured != model:
        raise ValueError(f"profile {profile} measured the compute of model {measured!r}, the bench runs "
                         f"{model!r}: re-run 'zerodp calibrate --model {model}' (or bench --calibrate)")
    if cal["world_size"] != world_size:
        raise ValueError(f"profile {profile} was calibrated on {cal['world_size']} ranks, the bench "
                         f"runs {world_size}: re-run 'zerodp calibrate --nproc {world_size}'")
    return cal


#: per rank and contender, bytes per parameter of fp32 training with AdamW, unsharded: params 4 +
#: grads 4 + Adam m, v 8, plus the transients of a step (gathered or staged copies, the optimizer's
#: temporaries) — measured peaks stay below this (docs/benchmarks.md).
BYTES_PER_PARAM_BUDGET = 24
#: what a stage's sharding takes off that budget, times (1 − 1/N): Adam's 8 B at stage 1, its
#: gradients' 4 more at stage 2, its parameters' 4 more at stage 3 (guide §9)
SHARDED_BYTES_PER_PARAM = {0: 0, 1: 8, 2: 12, 3: 16}
RANK_BASELINE_BYTES = 600 * MIB  # a rank's Python, torch and gloo before any model


def contender_budget(name: str, world_size: int) -> float:
    """Bytes per parameter a contender may hold per rank: the unsharded budget less its stage's
    sharded share (the floor and stage 0 shard nothing)."""
    stage = CONTENDERS[name][0] if name in CONTENDERS else VARIANTS[name][0]
    return BYTES_PER_PARAM_BUDGET - SHARDED_BYTES_PER_PARAM[stage or 0] * (1 - 1 / world_size)


def memory_needed(spec: BenchSpec, names: list[str], params: int,
                  groups: list[list[str]] | None = None) -> float:
    """Bytes the bench needs at its peak: every rank holds the costliest group at once."""
    largest = max(_group_budget(spec, g, names) for g in (groups or stage_groups(names)))
    return spec.world_size * (RANK_BASELINE_BYTES + largest * params)


def _group_budget(spec: BenchSpec, group: list[str], names: list[str]) -> float:
    return sum(contender_budget(n, spec.world_size) for n in group if n in names)


def available_bytes() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(spec: BenchSpec, names: list[str]) -> list[list[str]]:
    """The groups of contenders alive at once that fit this machine's memory (:func:`stage_groups`,
    split where a stage's whole group would not fit); refuse, in one line, a bench that would not
    fit even with ours and its peer alone."""
    from zerodp.train.model import GPT, PRESETS

    import torch

    with torch.device("meta"):
        params = GPT(PRESETS[spec.model]).num_params()
    have = available_bytes()
    if have is None:
        return stage_groups(names)
    groups = stage_groups(names, lambda g: memory_needed(spec, names, params, [g]) <= have)
    need = memory_needed(spec, names, params, groups)
    if need > have:
        raise ValueError(
            f"zerodp bench needs about {need / 2**30:.1f} GiB for model {spec.model} ({params / 1e6:.0f}M "
            f"parameters) on {spec.world_size} ranks (ours and its peer alive at once, each up to "
            f"{BYTES_PER_PARAM_BUDGET} B/param less what its stage shards), and "
            f"{have / 2**30:.1f} GiB are available: use a smaller --model or fewer --nproc")
    return groups


def _fresh_peaks(spec: BenchSpec, names: list[str], bucket: dict, timeout: float,
                 backend: str) -> dict[tuple[str, str], list[int | None]]:
    """Each contender's peak memory per rank, alone in a fresh spawned group per regime; the median
    per rank over ``memory_repeats`` such groups, every contender measured once before any twice
    (module docstring, "peak memory per rank")."""
    from tqdm import tqdm

    from zerodp.spawn import run_local

    samples: dict[tuple[str, str], list[list[int | None]]] = {}
    jobs = [(regime, name) for _ in range(spec.memory_repeats) for regime in spec.regimes for name in names]
    for regime, name in tqdm(jobs, desc="peak memory, each contender alone", unit="contender", leave=False):
        mb = bucket.get(regime.name, {}).get(name, spec.bucket_mb)
        samples.setdefault((regime.name, name), []).append(
            run_local(_rank_memory, spec.world_size, spec, regime, name, mb, timeout=timeout, backend=backend))
    per_rank = {key: [[reading[r] for reading in readings] for r in range(spec.world_size)]
                for key, readings in samples.items()}
    # The lower middle reading (a measured byte count); missing where any reading is (no /proc).
    return {key: [None if None in values else statistics.median_low(values) for values in ranks]
            for key, ranks in per_rank.items()}


def run_bench(spec: BenchSpec, timeout: float = 1800.0) -> BenchResult:
    """Measure every regime of ``spec`` (one spawned group each) and return the results."""
    from zerodp.spawn import run_local
    from zerodp.train.model import GPT, PRESETS

    if spec.model not in PRESETS:
        raise ValueError(f"unknown model preset {spec.model!r}; use one of {', '.join(PRESETS)}")
    cal = check_profile(spec.profile, spec.model, spec.world_size) if spec.profile else None
    machine = probe.machine()
    names = spec.contenders(with_auto=bool(spec.profile))
    backend = "gloo"
    if spec.device == "cuda":  # the GPUs' memory, not this host's, holds the contenders
        import torch

        if torch.cuda.device_count() < spec.world_size:
            raise ValueError(f"a CUDA bench on {spec.world_size} ranks needs as many GPUs; "
                             f"{torch.cuda.device_count()} visible")
        backend, groups = "nccl", None
    else:
        groups = check_memory(spec, names)
    buckets = contender_buckets(spec, names)
    bucket = {r.name: buckets for r in spec.regimes}
    per_rank = run_local(_rank_bench, spec.world_size, spec, names, bucket, groups, timeout=timeout, backend=backend)
    if spec.memory == "fresh":
        peaks = _fresh_peaks(spec, names, bucket, timeout, backend)
        for j, regime in enumerate(spec.regimes):
            for name in names:
                for rank, r in enumerate(per_rank):
                    r[j][0][name]["peak"] = peaks[regime.name, name][rank]
    results, auto = [], {}
    for j, regime in enumerate(spec.regimes):
        ranks = [r[j][0] for r in per_rank]
        wall = per_rank[0][j][1]
        contenders = {}
        for name in names:
            stage, role, label = CONTENDERS[name]
            times = [max(s) for s in zip(*(r[name]["times"] for r in ranks))]
            r0 = ranks[0][name]
            c = ContenderResult(name, label, stage, role, times, statistics.median(times),
                                [r[name]["peak"] for r in ranks], [r[name]["states"] for r in ranks],
                                [r[name]["sent"] for r in ranks], r0["options"], r0["own_comm"],
                                r0["first_loss"], wire_bytes=r0.get("wire"))
            if role == "ours":
                c.predicted_wire_bytes = planner_wire_bytes(spec, regime, name)
            if cal is not None:
                c.predicted_s, _ = _predict(cal, spec, regime, name, c.options.get("bucket_mb", spec.bucket_mb))
            contenders[name] = c
        results.append(RegimeResult(regime, contenders, wall))
        if "ours0_auto" in contenders:
            auto[regime.name] = contenders["ours0_auto"].options["bucket_mb"]
    import torch

    torch.manual_seed(0)
    params = GPT(PRESETS[spec.model]).num_params()
    return BenchResult(spec, machine, results, auto, params)


def summary_rows(result: BenchResult) -> list[Row]:
    """ours vs each peer, per regime and stage, ratios from the medians; plus auto vs 25 MB."""
    rows = []
    for rr in result.regimes:
        cs = rr.contenders
        floor = cs.get("floor")
        floor_ms = floor.median_s * 1e3 if floor else None
        pairs = [(s, COMPARISONS[s][0], p) for s in result.spec.stages for p in COMPARISONS[s][1]]
        if "ours0_auto" in cs:
            pairs.append((0, "ours0_auto", "ours0"))
        for stage, ours, peer in pairs:
            o, p = cs[ours], cs[peer]
            pred = o.predicted_s * 1e3 if o.predicted_s is not None else None
            q1, q3 = paired_quartiles(o.times_s, p.times_s)
            rows.append(Row(
                rr.regime.name, rr.regime.tokens, stage, ours, peer, o.median_s * 1e3, p.median_s * 1e3,
                o.median_s / p.median_s, floor_ms,
                o.median_s / floor.median_s if floor else None, p.median_s / floor.median_s if floor else None,
                pred, (pred - o.median_s * 1e3) / (o.median_s * 1e3) if pred is not None else None, q1, q3))
    return rows


def paired_quartiles(ours: list[float], peer: list[float]) -> tuple[float | None, float | None]:
    """First and third quartiles of ours_i / peer_i over the timed steps (None under 2 steps)."""
    ratios = [a / b for a, b in zip(ours, peer) if b > 0]
    if len(ratios) < 2:
        return None, None
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[2]


# ---- output -------------------------------------------------------------------------------------
def _mib(v) -> str:
    return "n/a" if v is None else f"{v / MIB:.1f}"


def contenders_table(result: BenchResult) -> str:
    """Every contender of every regime: median, overhead, memory, bytes, prediction."""
    spec = result.spec
    ranks = "NCCL ranks (one GPU each)" if spec.device == "cuda" else "gloo ranks × 1 thread"
    lines = [f"model {spec.model} ({result.params / 1e6:.2f}M params, fp32, AdamW), {spec.world_size} {ranks}, "
             f"{spec.warmup} warm-up steps, then turns of {spec.turn} steps alternated, the first untimed; "
             "times: median of the per-step max over ranks; memory, states, sent: rank 0"
             + ("; peak RSS with glibc's mmap threshold fixed at 128 KiB (--malloc mmap)"
                if spec.malloc == "mmap" else "")]
    peak = "peak GPU MiB" if spec.device == "cuda" else "peak RSS MiB"
    width = max([38] + [len(display_label(c)) + 1 for rr in result.regimes for c in rr.contenders.values()])
    head = (f"{'stage':>5}  {'contender':<{width}}{'median ms':>10}{'/floor':>8}{peak:>13}"
            f"{'states MiB':>11}{'sent MiB/step':>14}{'trace MiB/step':>15}")
    if spec.profile:
        head += f"{'predicted ms':>13}{'error':>8}"
    for rr in result.regimes:
        r = rr.regime
        lines += ["", f"[{r.name}] {r.tokens} tokens per rank ({r.micro_batch} × {r.seq_len}), "
                      f"{spec.steps_for(r)} timed steps, {rr.wall_s:.0f} s", head]
        floor = rr.contenders.get("floor")
        for c in rr.contenders.values():
            stage = "-" if c.stage is None else str(c.stage)
            label = display_label(c)
            over = f"{c.median_s / floor.median_s:.2f}" if floor else "n/a"
            trace = "" if c.wire_bytes is None else _mib(c.wire_total)
            line = (f"{stage:>5}  {label:<{width}}{c.median_s * 1e3:>10.1f}{over:>8}{_mib(c.peak_rss_bytes[0]):>13}"
                    f"{_mib(c.model_state_bytes[0]):>11}{_mib(c.sent_bytes_per_step[0]):>14}{trace:>15}")
            if spec.profile:
                if c.predicted_s is None:
                    line += f"{'':>13}{'':>8}"
                else:
                    err = (c.predicted_s - c.median_s) / c.median_s
                    line += f"{c.predicted_s * 1e3:>13.1f}{err * 100:>+7.0f}%"
            lines.append(line)
    return "\n".join(lines)


@dataclass
class CompressedRow:
    """One compressed or hybrid contender of ours against ``ours{stage}`` of the same run (guide
    §14-§15): times, ×floor, bytes per rank per step by leg from the trace and the planner's."""

    regime: str
    tokens_per_rank: int
    stage: int
    name: str
    label: str
    ms: float
    over_floor: float | None
    vs_plain: float  # median / ours{stage}'s median
    peak_rss_bytes: int | None
    wire_intra: float | None
    wire_inter: float | None
    bytes_vs_plain: float | None  # traced bytes / ours{stage}'s traced bytes
    planner_bytes: float | None  # the planner's bytes per rank per step, both legs
    planner_vs_plain: float | None  # the planner's ratio to its own uncompressed flat figure
    predicted_ms: float | None
    predicted_error: float | None


def compressed_rows(result: BenchResult) -> list[CompressedRow]:
    """Every :data:`~zerodp.bench.peers.VARIANTS` contender measured, with ours of its stage."""
    rows = []
    for rr in result.regimes:
        cs = rr.contenders
        floor = cs.get("floor")
        for c in cs.values():
            if c.name not in VARIANTS:
                continue
            plain = cs.get(f"ours{c.stage}")
            ms = c.median_s * 1e3
            w = c.wire_bytes or {}
            pw, pp = c.predicted_wire_bytes, plain.predicted_wire_bytes if plain else None
            pred = c.predicted_s * 1e3 if c.predicted_s is not None else None
            rows.append(CompressedRow(
                rr.regime.name, rr.regime.tokens, c.stage, c.name, display_label(c, bucket=False), ms,
                c.median_s / floor.median_s if floor else None,
                c.median_s / plain.median_s if plain else float("nan"), c.peak_rss_bytes[0],
                w.get("intra") if c.wire_bytes else None, w.get("inter") if c.wire_bytes else None,
                c.wire_total / plain.wire_total if plain and plain.wire_total and c.wire_total is not None else None,
                sum(pw.values()) if pw else None,
                sum(pw.values()) / sum(pp.values()) if pw and pp and sum(pp.values()) else None,
                pred, (pred - ms) / ms if pred is not None else None))
    return rows


def compressed_table(result: BenchResult) -> str:
    """The compressed and hybrid rows: ms, ×floor, ×ours, MiB per leg, ×fp32 bytes, predicted."""
    rows = compressed_rows(result)
    if not rows:
        return ""
    lines = [f"{'regime':<8}{'tok/rank':>9}{'stage':>6}  {'contender':<40}{'median ms':>10}{'×floor':>8}"
             f"{'×ours':>7}{'peak RSS MiB':>13}{'intra MiB':>10}{'inter MiB':>10}{'×fp32 bytes':>12}"
             f"{'planner ×':>10}{'predicted ms':>13}{'error':>7}"]

    def f(v, fmt, width):
        return f"{'':>{width}}" if v is None else f"{v:>{width}{fmt}}"
    for r in rows:
        lines.append(f"{r.regime:<8}{r.tokens_per_rank:>9}{r.stage:>6}  {r.label:<40}{r.ms:>10.1f}"
                     f"{f(r.over_floor, '.2f', 8)}{r.vs_plain:>7.2f}"
                     f"{_mib(r.peak_rss_bytes):>13}{f(None if r.wire_intra is None else r.wire_intra / MIB, '.2f', 10)}"
                     f"{f(None if r.wire_inter is None else r.wire_inter / MIB, '.2f', 10)}"
                     f"{f(r.bytes_vs_plain, '.3f', 12)}{f(r.planner_vs_plain, '.3f', 10)}"
                     f"{f(r.predicted_ms, '.1f', 13)}"
                     f"{'' if r.predicted_error is None else f'{r.predicted_error * 100:+.0f}%':>7}")
    lines.append("×ours: median / zerodp's uncompressed flat row of the same stage; ×fp32 bytes: traced bytes "
                 "sent per rank per step / that row's; planner ×: the same ratio from zerodp.plan.hybrid")
    return "\n".join(lines)


def summary_table(result: BenchResult) -> str:
    """ours/peer per stage and regime, with the issue's targets where they apply."""
    lines = [f"{'regime':<8}{'tok/rank':>9}{'stage':>6}  {'ours vs peer':<60}{'ours ms':>9}{'peer ms':>9}"
             f"{'ours/peer':>10}{'per-step IQR':>14}{'target':>8}"]
    for row in result.rows():
        o, p = CONTENDERS[row.ours][2], CONTENDERS[row.peer][2]
        target = row.target
        verdict = "" if target is None else ("ok" if row.ratio <= target else "MISSED")
        iqr = "" if row.paired_q1 is None else f"{row.paired_q1:.2f}-{row.paired_q3:.2f}"
        lines.append(f"{row.regime:<8}{row.tokens_per_rank:>9}{row.stage:>6}  {o + ' vs ' + p:<60}"
                     f"{row.ours_ms:>9.1f}{row.peer_ms:>9.1f}{row.ratio:>10.3f}{iqr:>14}"
                     f"{'' if target is None else f'≤{target:.2f}':>8} {verdict}")
    lines.append("per-step IQR: quartiles of ours/peer taken step by step (both ran in the same round): "
                 "the spread of the ratio")
    return "\n".join(lines)


def write_json(result: BenchResult, path: str) -> str:
    with open(path, "w") as f:
        json.dump(result.to_dict(), f, indent=2)
    return path


def plot(result: BenchResult, path: str) -> str:
    """Bars of step time / floor per stage, ours next to its peers, one panel per regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(result.regimes)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.8), squeeze=False)
    colors = {"ours": "#1f77b4", "peer": "#ff7f0e"}
    for ax, rr in zip(axes[0], result.regimes):
        floor = rr.contenders["floor"].median_s
        x = 0.0
        ticks, tick_labels = [], []
        for stage in result.spec.stages:
            ours, peers = COMPARISONS[stage]
            group = [ours, *peers] + (["ours0_auto"] if stage == 0 and "ours0_auto" in rr.contenders else [])
            group += [n for n in result.spec.variants(stage) if n in rr.contenders]
            for name in group:
                c = rr.contenders[name]
                h = c.median_s / floor
                ax.bar(x, h, width=0.8, color=colors[c.role], alpha=0.55 if name == "ours0_auto" else 1.0,
                       edgecolor="black", linewidth=0.4, hatch="//" if name in VARIANTS else None)
                ax.text(x, h, f"{c.median_s * 1e3:.0f}", ha="center", va="bottom", fontsize=7)
                ticks.append(x)
                tick_labels.append(f"{stage}: {short_label(name)}")
                x += 1
            x += 0.6
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(ticks, tick_labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("median step time / no-communication floor")
        ax.set_title(f"{rr.regime.name}-bound: {rr.regime.tokens} tokens/rank, floor {floor * 1e3:.0f} ms "
                     "(bar labels: ms)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in ("ours", "peer")]
    fig.legend(handles, ["zerodp", "PyTorch"], loc="upper right")
    fig.suptitle(f"zerodp vs PyTorch, model {result.spec.model}, {result.spec.world_size} ranks "
                 f"({result.machine.get('cores')} cores, torch {result.machine.get('torch')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def quick_spec(**overrides) -> BenchSpec:
    """A tiny model and two short regimes: seconds, for tests (``zerodp bench --quick``)."""
    base = BenchSpec(model="nano", regimes=tuple(QUICK_REGIMES.values()), warmup=1, steps=2)
    return dataclasses.replace(base, **overrides)
