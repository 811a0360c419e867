"""The guide's roofline on this machine: stage-0 step time against tokens per rank (guide §7).

Guide §7.1/§7.3/§7.4: backward computes 4·tokens·Ψ FLOPs per rank while the gradient AllReduce
moves 2(N−1)/N · b·Ψ bytes (b bytes per gradient element), so communication can hide under
backward only if

    tokens per rank  >  b/2 · C/W · (N−1)/N

— the guide's ``C/W · (N−1)/N`` for bf16 gradients (b = 2); the bench trains in fp32 (b = 4), which
doubles the knee. Below it the step is communication-bound and its time flattens at the
communication floor; above it the step approaches the no-communication floor, linear in tokens.

``zerodp bench --roofline`` sweeps tokens per rank, times our stage 0 and the no-communication
floor alternated in one spawned group (as :mod:`zerodp.bench.compare` does), and — with a
calibration profile — draws the prediction (:func:`zerodp.bench.predict.predict_step`) and marks
the predicted knee from the profile's C and AllReduce W.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from zerodp.bench.runner import make_batches, make_model_factory, prime, settle
from zerodp.bench.schedule import schedule, steps_per_contender, timed_rounds
from zerodp.bench.spec import Regime

DEFAULT_TOKENS = (32, 64, 128, 256, 512, 1024, 2048)
QUICK_TOKENS = (8, 32, 128)
CONTENDERS = ("floor", "ours0")


@dataclass(frozen=True)
class RooflineSpec:
    model: str = "small"
    world_size: int = 2
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    warmup: int = 2
    steps: int = 4
    turn: int = 3  # consecutive steps per turn, the first untimed (zerodp.bench.schedule.schedule)
    bucket_mb: float = 25.0
    seed: int = 0
    profile: str | None = None
    grad_bytes_per_param: int = 4  # fp32 gradients

    def __post_init__(self):
        if not self.tokens or any(t < 1 for t in self.tokens):
            raise ValueError(f"tokens per rank must be positive integers, got {list(self.tokens)}")
        if self.warmup < 1 or self.steps < 1 or self.turn < 1:
            raise ValueError(f"need warmup, steps and turn >= 1, got {self.warmup}, {self.steps}, {self.turn}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2, got {self.world_size}")


def regime_for(tokens: int, model_seq_len: int) -> Regime:
    """Whole sequences of the model's length when possible, else one shorter sequence."""
    from zerodp.bench.compute import split_tokens

    micro_batch, seq = split_tokens(tokens, model_seq_len)
    return Regime(f"{tokens}", micro_batch, seq)


@dataclass
class RooflinePoint:
    tokens: int
    micro_batch: int
    seq_len: int
    ours_s: float  # median step time, stage 0
    floor_s: float  # median step time, no communication
    predicted_s: float | None = None
    predicted_floor_s: float | None = None

    @property
    def overhead(self) -> float:
        return self.ours_s / self.floor_s


@dataclass
class RooflineResult:
    spec: RooflineSpec
    machine: dict
    points: list[RooflinePoint]
    knee_tokens: float | None = None  # predicted, b/2 · C/W · (N−1)/N
    flops: float | None = None
    bandwidth: float | None = None
    wall_s: float = 0.0
    times: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"spec": asdict(self.spec), "machine": self.machine, "knee_tokens": self.knee_tokens,
                "flops": self.flops, "bandwidth": self.bandwidth, "wall_s": self.wall_s,
                "points": [asdict(p) | {"overhead": p.overhead} for p in self.points]}


def _rank_roofline(rank: int, world: int, spec: RooflineSpec) -> dict:
    import torch.distributed as dist

    from zerodp.bench.peers import build
    from zerodp.train.model import PRESETS

    cfg = PRESETS[spec.model]
    make = make_model_factory(spec.model, spec.seed)
    regimes = [regime_for(t, cfg.seq_len) for t in spec.tokens]
    prime(make, make_batches(regimes[0], cfg.vocab_size, 1, rank, world, spec.seed)[0])
    contenders = {n: build(n, make, world, spec.bucket_mb) for n in CONTENDERS}
    # No build step per token count: the first spec.warmup rounds of the schedule are the warm-up.
    rounds = spec.warmup + timed_rounds(spec.steps, spec.turn)
    total = steps_per_contender(spec.warmup + 1, rounds, spec.turn) - 1  # per contender and token count
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total * len(CONTENDERS) * len(regimes), desc="roofline", unit="step", leave=False)
    out = {}
    for regime in regimes:
        batches = make_batches(regime, cfg.vocab_size, total, rank, world, spec.seed)
        times = {n: [] for n in CONTENDERS}
        done = dict.fromkeys(CONTENDERS, 0)
        for _, name, timed in schedule(list(CONTENDERS), spec.warmup + 1, rounds, spec.turn, spec.seed):
            c = contenders[name]
            dist.barrier()
            t0 = time.perf_counter()
            c.step(*batches[done[name]])
            settle(c)
            done[name] += 1
            if timed:
                times[name].append(time.perf_counter() - t0)
            if bar is not None:
                bar.update()
        out[regime.tokens] = times
    if bar is not None:
        bar.close()
    return out


def knee(profile: str, grad_bytes_per_param: int = 4, world_size: int | None = None) -> tuple[float, float, float]:
    """Predicted knee in tokens per rank, with the profile's C (FLOP/s) and AllReduce W (B/s)."""
    from zerodp.plan.calibrated import load_calibration

    cal = load_calibration(profile)["calibration"]
    n = world_size or cal["world_size"]
    flops = cal["compute"]["flops"]
    bw = next(f["bandwidth"] for f in cal["fits"] if f["kind"] == "all_reduce")
    return grad_bytes_per_param / 2 * flops / bw * (n - 1) / n, flops, bw


def run_roofline(spec: RooflineSpec, timeout: float = 1800.0) -> RooflineResult:
    """Measure the sweep on ``spec.world_size`` local ranks (one spawned group) and aggregate it."""
    from zerodp.spawn import run_local
    from zerodp.train.model import PRESETS

    if spec.model not in PRESETS:
        raise ValueError(f"unknown model preset {spec.model!r}; use one of {', '.join(PRESETS)}")
    for t in spec.tokens:  # validate before spawning
        regime_for(t, PRESETS[spec.model].seq_len)
    if spec.profile:
        from zerodp.bench.compare import check_profile

        check_profile(spec.profile, spec.model, spec.world_size)
    t0 = time.perf_counter()
    per_rank = run_local(_rank_roofline, spec.world_size, spec, timeout=timeout)
    return aggregate(spec, per_rank, time.perf_counter() - t0)


def aggregate(spec: RooflineSpec, per_rank: list[dict], wall: float = 0.0) -> RooflineResult:
    """Medians (of the per-step max over ranks) and predictions from the ranks' raw step times."""
    from zerodp.bench import probe
    from zerodp.train.model import PRESETS

    cfg = PRESETS[spec.model]
    regimes = [regime_for(t, cfg.seq_len) for t in spec.tokens]
    cal = None
    if spec.profile:
        from zerodp.plan.calibrated import load_calibration

        cal = load_calibration(spec.profile)["calibration"]
    for rank, out in enumerate(per_rank):
        if not isinstance(out, dict) or set(out) != {g.tokens for g in regimes}:
            raise RuntimeError(f"roofline: rank {rank} returned {type(out).__name__}, expected one entry "
                               f"per token count {[g.tokens for g in regimes]}")
    points = []
    for regime in regimes:
        med = {}
        for name in CONTENDERS:
            steps = zip(*(r[regime.tokens][name] for r in per_rank))
            med[name] = statistics.median(max(s) for s in steps)
        p = RooflinePoint(regime.tokens, regime.micro_batch, regime.seq_len, med["ours0"], med["floor"])
        if cal is not None:
            from zerodp.bench.predict import predict_step

            pred = predict_step(cal, cfg, 0, regime.micro_batch, regime.seq_len, spec.bucket_mb,
                                spec.grad_bytes_per_param, spec.world_size)
            p.predicted_s = pred.step_s
            p.predicted_floor_s = pred.forward_s + pred.backward_s + pred.optimizer_s
        points.append(p)
    result = RooflineResult(spec, probe.machine(), points, wall_s=wall)
    if spec.profile:
        result.knee_tokens, result.flops, result.bandwidth = knee(spec.profile, spec.grad_bytes_per_param,
                                                                  spec.world_size)
    return result


def table(result: RooflineResult) -> str:
    pred = result.spec.profile is not None
    lines = [f"stage-0 roofline, model {result.spec.model}, {result.spec.world_size} ranks, "
             f"median of {result.spec.steps}+ steps after {result.spec.warmup} warm-up, "
             f"in turns of {result.spec.turn} (the first untimed)"]
    if result.knee_tokens is not None:
        lines.append(f"predicted knee b/2·C/W·(N−1)/N = {result.knee_tokens:.0f} tokens per rank "
                     f"(C = {result.flops / 1e9:.2f} GFLOP/s, W = {result.bandwidth / 1e9:.3f} GB/s, "
                     f"b = {result.spec.grad_bytes_per_param} B)")
    head = f"{'tokens/rank':>11} {'batch×seq':>10} {'ours ms':>9} {'floor ms':>9} {'ours/floor':>10}"
    if pred:
        head += f" {'pred ms':>9} {'pred floor':>10} {'error':>7}"
    lines.append(head)
    for p in result.points:
        line = (f"{p.tokens:>11} {f'{p.micro_batch}×{p.seq_len}':>10} {p.ours_s * 1e3:>9.1f} "
                f"{p.floor_s * 1e3:>9.1f} {p.overhead:>10.2f}")
        if pred:
            line += (f" {p.predicted_s * 1e3:>9.1f} {p.predicted_floor_s * 1e3:>10.1f} "
                     f"{(p.predicted_s - p.ours_s) / p.ours_s * 100:>+6.0f}%")
        lines.append(line)
    return "\n".join(lines)


def plot(result: RooflineResult, path: str) -> str:
    """Step time and overhead against tokens per rank, measured and predicted, knee marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.points
    x = [p.tokens for p in pts]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    a.plot(x, [p.ours_s * 1e3 for p in pts], "o-", color="#1f77b4", label="measured: zerodp stage 0")
    a.plot(x, [p.floor_s * 1e3 for p in pts], "s-", color="gray", label="measured: no communication")
    b.plot(x, [p.overhead for p in pts], "o-", color="#1f77b4", label="measured")
    if result.spec.profile:
        a.plot(x, [p.predicted_s * 1e3 for p in pts], "--", color="#d62728", label="predicted: stage 0")
        a.plot(x, [p.predicted_floor_s * 1e3 for p in pts], ":", color="#d62728", label="predicted: compute only")
        b.plot(x, [p.predicted_s / p.predicted_floor_s for p in pts], "--", color="#d62728", label="predicted")
    if result.knee_tokens is not None:
        for ax in (a, b):
            ax.axvline(result.knee_tokens, color="black", linestyle="-.", linewidth=1)
        a.text(result.knee_tokens, a.get_ylim()[1], f" knee {result.knee_tokens:.0f}", va="top", fontsize=8)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_ylabel("median step time (ms)")
    a.legend(fontsize=8)
    a.set_title(f"guide §7 roofline: model {result.spec.model}, {result.spec.world_size} ranks, "
                f"{result.machine.get('cores')} cores", fontsize=10)
    b.axhline(1.0, color="gray", linewidth=0.8)
    b.set_xlabel("tokens per rank")
    b.set_ylabel("step / compute-only")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
