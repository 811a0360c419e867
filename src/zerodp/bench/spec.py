"""What ``zerodp bench`` is asked to run: the regimes (tokens per rank) and :class:`BenchSpec`, checked
when built. How the bench measures is :mod:`zerodp.bench.compare`'s docstring."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zerodp.bench.contenders import COMPARISONS, Compression, Optimizer, comparisons, compiled_peer, variants_for
from zerodp.bench.probe import Malloc
from zerodp.bench.schedule import timed_rounds
from zerodp.train.config import Mode

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


class Device(Mode):
    """Where the ranks run: gloo on the CPU, or NCCL with rank r on cuda:r."""

    CPU = "cpu"
    CUDA = "cuda"


class Memory(Mode):
    """How peak memory is read (:attr:`BenchSpec.memory`)."""

    FRESH = "fresh"
    SHARED = "shared"


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
    turn: int = 3  # consecutive steps per contender turn, the first not timed (zerodp.bench.schedule)
    memory_steps: int = 3  # steps the fresh memory groups run while their peak is read
    memory_repeats: int = 1  # fresh memory groups per contender; the peak is their median per rank
    bucket_mb: float = 25.0
    # Our stage 2 (its gradient buffers are transient, so a bucket's size is memory held in
    # backward, guide §12.5): "unit" — buckets as large as one transformer block's parameters, the
    # unit its peer FSDP2 reduces at (zerodp.bench.compare, "bucket sizes"); or a number of MiB.
    stage2_bucket_mb: "float | str" = "unit"
    seed: int = 0
    profile: str | None = None  # calibration profile: predictions and the auto bucket row
    device: Device = Device.CPU  # cuda: NCCL, rank r on cuda:r (zerodp.bench.compare)
    # Compressed and hybrid contenders of ours (guide §14-§15), beside ours at each stage: the
    # planner's compression names (zerodp.plan.hybrid.COMPRESSIONS; "none" adds nothing), and a
    # shard-group size g < world_size for hybrid sharding at stages 1-3 (None: no hybrid rows).
    compress: tuple[Compression, ...] = (Compression.NONE,)
    shard_size: int | None = None
    # Peak memory: "fresh" — each contender built and stepped memory_steps times in its own spawned
    # group, alone (what a user's job sees); "shared" — inside the timing group, over the build and
    # first step of the contenders built one after another in the same processes (cheaper; the
    # allocator's state then depends on what ran before).
    memory: Memory = Memory.FRESH
    # The fresh memory groups' allocator (zerodp.bench.probe.set_malloc): "default", glibc as a
    # user's job gets it; "mmap", its mmap threshold fixed, so that RSS follows the live tensors.
    malloc: Malloc = Malloc.DEFAULT
    # zerodp bench --compile: beside the eager rows, ours and each stage's reference peer with the
    # model compiled in place first (zerodp.engine.compiled.compile_in_place: aot_eager on CPU,
    # inductor on CUDA). Compilation runs in the untimed build step (zerodp.bench.runner).
    compile: bool = False
    # zerodp bench --optimizer: what every contender steps with (zerodp.bench.contenders.Optimizer).
    # "muon": Muon on the blocks' matrices + AdamW on the rest, ours at each stage against one peer,
    # DDP + Muon/AdamW with replicated state (zerodp.bench.contenders.MUON_COMPARISONS).
    optimizer: Optimizer = Optimizer.ADAMW

    def __post_init__(self):
        self._parse_modes()
        if self.optimizer is Optimizer.MUON:
            extra = [flag for flag, on in (("compress", self.compress != (Compression.NONE,)),
                                           ("shard_size", self.shard_size is not None), ("compile", self.compile),
                                           ("profile", self.profile is not None)) if on]
            if extra:
                raise ValueError(f"optimizer='muon' benches ours at each stage against DDP + Muon only: "
                                 f"{', '.join(extra)} (variants, compiled peers, the planner's AdamW predictions) "
                                 "apply to optimizer='adamw'")
        least = 1 if self.device is Device.CUDA else 2
        if self.world_size < least:
            raise ValueError(f"world_size must be >= {least} to compare data-parallel engines on "
                             f"{self.device}, got {self.world_size}")
        if self.memory_repeats < 1:
            raise ValueError(f"need memory_repeats >= 1, got {self.memory_repeats}")
        if self.memory_repeats > 1 and self.memory is not Memory.FRESH:
            raise ValueError(f"memory_repeats={self.memory_repeats} repeats the fresh memory groups: use "
                             "memory='fresh'")
        if self.malloc is not Malloc.DEFAULT and self.memory is not Memory.FRESH:
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
        if not self.compress:
            raise ValueError(f"compress must be a non-empty list of {', '.join(m.value for m in Compression)}, "
                             "got []")
        g = self.shard_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1 or g >= self.world_size
                              or self.world_size % g):
            raise ValueError(f"shard_size must divide world_size ({self.world_size}) and be smaller (hybrid "
                             f"sharding: shard groups of g ranks, replicated world/g times), got {g}")

    def _parse_modes(self) -> None:
        """The settings given as words (flags, or ``bench.json`` read back), as members."""
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        put("device", Device.parse(self.device, "device", optional=False))
        put("memory", Memory.parse(self.memory, "memory", optional=False))
        put("malloc", Malloc.parse(self.malloc, "malloc", optional=False))
        put("optimizer", Optimizer.parse(self.optimizer, "optimizer", optional=False))
        try:
            put("compress", tuple(Compression.parse(c, "compress", optional=False) for c in self.compress))
        except ValueError:
            raise ValueError(f"compress must be a non-empty list of {', '.join(m.value for m in Compression)}, "
                             f"got {list(self.compress)}") from None

    def steps_for(self, regime: Regime) -> int:
        """Timed steps in ``regime``: ``steps`` for the most tokens per rank; a cheaper regime gets
        more, in proportion to its tokens, up to :data:`MAX_STEP_SCALE` times as many (short steps
        are the noisiest, and cost little to repeat)."""
        largest = max(r.tokens for r in self.regimes)
        return self.steps * max(1, min(MAX_STEP_SCALE, largest // regime.tokens))

    def rounds_for(self, regime: Regime) -> int:
        """Rounds of turns after the build step: ``warmup - 1`` untimed ones, then enough to time
        :meth:`steps_for` steps (:func:`zerodp.bench.schedule.schedule`)."""
        return self.warmup - 1 + timed_rounds(self.steps_for(regime), self.turn)

    def variants(self, stage: int) -> list[str]:
        """Our compressed, hybrid and compiled contenders at ``stage``
        (:func:`zerodp.bench.contenders.variants_for`)."""
        return [v.name for v in variants_for(stage, self.compress, self.shard_size is not None, self.compile)]

    @property
    def comparisons(self) -> dict[int, tuple[str, tuple[str, ...]]]:
        """stage → (ours, peers) for this bench's optimizer (:func:`zerodp.bench.contenders.comparisons`)."""
        return comparisons(self.optimizer)

    def contenders(self, with_auto: bool) -> list[str]:
        names = ["floor"]
        for s in self.stages:
            ours, peers = self.comparisons[s]
            names += [ours, *(p for p in peers if p not in names), *self.variants(s),
                      *([compiled_peer(s)] if self.compile else [])]
        if with_auto and 0 in self.stages and self.optimizer is Optimizer.ADAMW:
            names.append("ours0_auto")
        return names



def quick_spec(**overrides) -> BenchSpec:
    """A tiny model and two short regimes: seconds, for tests (``zerodp bench --quick``)."""
    base = BenchSpec(model="nano", regimes=tuple(QUICK_REGIMES.values()), warmup=1, steps=2)
    return dataclasses.replace(base, **overrides)
