"""Step costs from a calibration profile, torch-free: compute per token, collective fits, overlap
efficiency, and the bucket size at the simulator's sweet spot (guide §4, §13).

A profile written by ``zerodp calibrate`` holds a ``calibration`` table: α-β fits per collective
(``fits``), forward/backward/optimizer times at several token counts (``compute``) and the
overlap measurement (``overlap``). Everything here reads such a table and does arithmetic — no
torch — so that the planner, the benchmarks and the engine's ``bucket_mb="auto"`` share one
implementation.

``bucket_mb="auto"`` (:func:`choose_bucket_mb`): small buckets pay the latency α once per bucket,
huge buckets leave the last bucket's whole collective exposed after backward; in between lies a
wide sweet spot. The planner's event simulation of one backward (:func:`zerodp.plan.timeline.
sweep_buckets`) over the model's layers prices each size: the exposed communication, plus — where
communication shares the processor with compute (overlap efficiency η < 1) — (1 − η) of the
communication it hid (:func:`step_costs`). η is measured on one pattern and moves by a tenth or so
from run to run, so the choice is the size whose worst relative excess over the best size, for any
η within :data:`ETA_UNCERTAINTY` of the measured one, is least (minimax regret,
:func:`worst_regrets`); among sizes within :data:`REGRET_TOLERANCE` of that, the largest (every
bucket also costs host work the simulator does not see).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from zerodp.plan._common import read_json
from zerodp.plan.collectives import RingCost
from zerodp.plan.roofline import FORWARD_FLOPS_PER_TOKEN_PARAM
from zerodp.plan.timeline import Layer, sweep_buckets
from zerodp.plan._common import MIB

ETA_UNCERTAINTY = 0.25  # η is measured on one pattern and varies run to run (bench.overlap)
REGRET_TOLERANCE = 0.01  # sizes whose worst regret is within 1 % of the least count as equal
SWEET_SPOT_SLACK_S = 1e-4  # absolute slack: differences below 0.1 ms are noise on any machine
_PARTS = ("forward_s", "backward_s", "optimizer_s")


# ---- the profile -------------------------------------------------------------------------------
def load_calibration(path: str) -> dict:
    """A profile written by ``zerodp calibrate`` (:func:`zerodp.bench.calibrate.write_profile`)."""
    data = read_json(path, "profile", f"run 'zerodp calibrate --out {path}' first", "re-run zerodp calibrate")
    if "calibration" not in data or "hardware" not in data:
        raise ValueError(f"{path}: not a zerodp calibration profile (no 'calibration'/'hardware' tables)")
    return data


def _calibration_table(profile) -> dict:
    """Accept a profile path, a whole profile dict, or its ``calibration`` table."""
    if isinstance(profile, (str, os.PathLike)):
        return load_calibration(os.fspath(profile))["calibration"]
    if isinstance(profile, dict) and "calibration" in profile:
        return profile["calibration"]
    if isinstance(profile, dict) and {"fits", "compute", "world_size"} <= set(profile):
        return profile
    raise ValueError("expected a calibration profile (a path written by 'zerodp calibrate', the "
                     "profile dict, or its 'calibration' table with 'fits', 'compute', 'world_size')")


def calibration_for(profile, world_size: int | None = None) -> dict:
    """The ``calibration`` table of ``profile`` (path, dict or table), checked for ``world_size``.

    α and W are fitted per world size (guide §2.4): a profile holds for its own group size only, so
    one measured on another number of ranks is a ``ValueError`` (when ``world_size`` is given).
    """
    cal = _calibration_table(profile)
    if world_size is not None and cal["world_size"] != world_size:
        raise ValueError(
            f"the calibration profile was measured on {cal['world_size']} ranks, but this process group "
            f"has {world_size}: its collective fits (α, W) do not hold here; calibrate on this many "
            f"ranks ('zerodp calibrate --nproc {world_size}') or give bucket_mb a number of MiB")
    return cal


# ---- compute per token -----------------------------------------------------------------------------
def _measured(compute: dict) -> list[tuple[int, dict]]:
    """(tokens, times) of every measured size, ascending; older profiles had one main size and an
    optional ``small_tokens`` one."""
    pts = {int(p["tokens"]): p for p in compute.get("points") or []}
    pts.setdefault(int(compute["tokens"]), compute)
    small = int(compute.get("small_tokens") or 0)
    if 0 < small < int(compute["tokens"]) and small not in pts:
        pts[small] = {"forward_s": compute["small_forward_s"], "backward_s": compute["small_backward_s"],
                      "optimizer_s": compute["optimizer_s"]}
    return sorted(pts.items())


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear through the measurements; outside them the end segment's line, its slope
    and its value at 0 kept ≥ 0 (a step never gets cheaper with more tokens, guide §7.1)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    slope = max(0.0, (y1 - y0) / (x1 - x0))
    if x0 <= x <= x1:
        return y0 + (x - x0) * (y1 - y0) / (x1 - x0)
    if x > x1:
        return y1 + slope * (x - x1)
    return max(0.0, y0 - slope * (x0 - x))


def compute_part(compute: dict, tokens: int, part: str) -> float:
    """``part`` (forward_s, backward_s or optimizer_s) at ``tokens`` per rank from a profile's
    ``compute`` table."""
    if part not in _PARTS:
        raise ValueError(f"part must be one of {_PARTS}, got {part!r}")
    pts = _measured(compute)
    return _interpolate([t for t, _ in pts], [float(p[part]) for _, p in pts], tokens)


def compute_times(compute: dict, tokens: int) -> tuple[float, float]:
    """(forward_s, backward_s) at ``tokens`` per rank from a profile's ``compute`` table."""
    return compute_part(compute, tokens, "forward_s"), compute_part(compute, tokens, "backward_s")


def optimizer_time(compute: dict, tokens: int, params: int | None = None) -> float:
    """The optimizer's step over ``params`` parameters (default: the measured model's) when the
    step runs at ``tokens`` per rank: its cost per parameter is measured at each size, because
    ranks in lock-step contend for memory bandwidth differently when the step is short."""
    t = compute_part(compute, tokens, "optimizer_s")
    return t if params is None else t * params / compute["params"]


# ---- overlap efficiency -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Overlap:
    """One overlap measurement: medians over iterations of the slowest rank (seconds)."""

    bytes: int  # the AllReduce's buffer V
    tokens: int  # tokens per rank of the forward + backward
    compute_s: float
    comm_s: float
    both_s: float

    @property
    def efficiency(self) -> float:
        """η (module docstring): the share of the shorter activity that hid behind the longer."""
        shorter = min(self.compute_s, self.comm_s)
        if shorter <= 0:
            return 1.0
        hidden = self.compute_s + self.comm_s - self.both_s
        return min(1.0, max(0.0, hidden / shorter))

    @classmethod
    def of(cls, cal: dict) -> "Overlap | None":
        """The measurement in a profile's ``calibration`` table (None in profiles without one)."""
        o = cal.get("overlap")
        return cls(**{k: o[k] for k in ("bytes", "tokens", "compute_s", "comm_s", "both_s")}) if o else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["efficiency"] = self.efficiency
        return d

    def describe(self) -> str:
        return (f"overlap: AllReduce of {self.bytes / 2**20:.1f} MiB alone {self.comm_s * 1e3:.1f} ms, "
                f"forward+backward ({self.tokens} tokens/rank) alone {self.compute_s * 1e3:.1f} ms, "
                f"both at once {self.both_s * 1e3:.1f} ms -> overlap efficiency "
                f"η = {self.efficiency:.2f} (1: communication hides, 0: it serializes with compute)")


def efficiency(cal: dict) -> float:
    """η of a profile's ``calibration`` table; 1.0, the simulator's assumption, when it has none."""
    o = Overlap.of(cal)
    return 1.0 if o is None else o.efficiency


def contention_s(hidden_s: float, eta: float) -> float:
    """Extra step time from ``hidden_s`` of communication the simulator overlapped with compute."""
    return (1.0 - eta) * max(0.0, hidden_s)


# ---- layers and collective costs ------------------------------------------------------------------
@dataclass(frozen=True)
class LayerShape:
    name: str
    params: int  # parameters whose gradients this layer communicates
    matmul_params: int  # parameters used in a matmul per token (0 for an embedding lookup)
    attn_flops_per_token: float = 0.0


def gpt_layer_shapes(cfg, seq_len: int) -> list[LayerShape]:
    """Embedding, blocks and head of :class:`zerodp.train.model.GPT`, from its config alone."""
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.ffn_mult * cfg.d_model
    bias = 1 if cfg.bias else 0
    ln = 2 * d if cfg.bias else d
    block_matmul = 4 * d * d + 2 * d * f
    block = block_matmul + bias * (3 * d + d + f + d) + 2 * ln
    attn = 4 * seq_len * d / 2  # QK^T and AV, causal half, per token: 2·(2·T·d)/2
    emb = v * d + cfg.seq_len * d
    head = 0 if cfg.tie_weights else v * d
    layers = [LayerShape("embedding", emb, 0)]
    layers += [LayerShape(f"block{i}", block, block_matmul, attn) for i in range(cfg.n_layer)]
    layers.append(LayerShape("head", head + ln, v * d))
    return layers


def split_compute(shapes: list[LayerShape], tokens: int, forward_s: float, backward_s: float,
                  grad_bytes_per_param: int) -> list[Layer]:
    """Planner layers whose forward/backward times add up to the measured ones, by FLOP share."""
    flops = [FORWARD_FLOPS_PER_TOKEN_PARAM * s.matmul_params + s.attn_flops_per_token for s in shapes]
    total = sum(flops)
    if total <= 0:
        raise ValueError("the model has no matmul FLOPs to share the measured time by")
    return [Layer(s.name, float(grad_bytes_per_param * s.params),
                  backward_s * fl / total, forward_s * fl / total) for s, fl in zip(shapes, flops)]


def _fit_cost(cal: dict, kind: str) -> RingCost:
    for f in cal["fits"]:
        if f["kind"] == kind:
            return RingCost(alpha=f["alpha_s"], bandwidth=f["bandwidth"], n=f["world_size"])
    raise ValueError(f"the profile has no fit for {kind}; re-run zerodp calibrate")


def gradient_reduce_kind(cal: dict, int8_grads: bool = False, keeps_full: bool = False) -> str:
    """The collective that prices a gradient ReduceScatter on the calibrated backend: on gloo,
    where full gradients stay at rest (``keeps_full``: stage 1), the engine runs it as an
    in-place AllReduce of the group's buffer (guide §12.5), so it costs an AllReduce of the same
    bytes; otherwise — stages 2-3 on gloo (an all-to-all of the slices, timed as the calibration's
    ``reduce_scatter``), int8 gradients, NCCL — a ReduceScatter."""
    gloo_in_place = cal.get("backend") == "gloo" and keeps_full and not int8_grads
    return "all_reduce" if gloo_in_place else "reduce_scatter"


class PerKindCost:
    """The simulator's cost protocol, with each collective priced by its own measured fit (a
    gradient ReduceScatter by the collective the engine runs for it, :func:`gradient_reduce_kind`)."""

    def __init__(self, cal: dict, keeps_full: bool = False):
        self.costs = {k: _fit_cost(cal, k) for k in ("all_reduce", "reduce_scatter", "all_gather")}
        self.reduce_scatter_as = gradient_reduce_kind(cal, keeps_full=keeps_full)

    def time(self, kind: str, nbytes: float) -> float:
        if kind == "reduce_scatter":
            kind = self.reduce_scatter_as
        return self.costs[kind].time(kind, nbytes)


# ---- bucket_mb="auto" ------------------------------------------------------------------------------
def bucket_sweep(profile, shapes: list[LayerShape], tokens_per_rank: int, grad_bytes_per_param: int = 4,
                 collective: str = "all_reduce", world_size: int | None = None, keeps_full: bool = False):
    """The simulator's bucket sweep (:class:`zerodp.plan.timeline.BucketSweep`) for layers
    ``shapes`` at ``tokens_per_rank``, priced by the fits and compute times of ``profile`` (a path,
    a profile dict or its table, :func:`calibration_for`, checked for ``world_size``);
    ``keeps_full``: full gradients stay at rest (stage 1, :func:`gradient_reduce_kind`)."""
    cal = calibration_for(profile, world_size)
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) or tokens_per_rank < 1:
        raise ValueError(f"tokens_per_rank must be a positive integer, got {tokens_per_rank!r}")
    layers = split_compute(shapes, tokens_per_rank, *compute_times(cal["compute"], tokens_per_rank),
                           grad_bytes_per_param)
    return sweep_buckets(layers, PerKindCost(cal, keeps_full), collective=collective, split_layers=False)


def choose_bucket_mb(profile, shapes: list[LayerShape], tokens_per_rank: int, grad_bytes_per_param: int = 4,
                     collective: str = "all_reduce", world_size: int | None = None,
                     keeps_full: bool = False) -> float:
    """Bucket size in MiB at the simulated sweet spot (module docstring, guide §4): what
    ``bucket_mb="auto"`` resolves to, here and nowhere else (the engine's
    :func:`zerodp.engine.config.resolve_auto_bucket` and ``python -m zerodp.bench.auto`` call it)."""
    cal = calibration_for(profile, world_size)
    sweep = bucket_sweep(cal, shapes, tokens_per_rank, grad_bytes_per_param, collective, keeps_full=keeps_full)
    regret = worst_regrets(sweep, efficiency(cal))
    limit = min(regret) + REGRET_TOLERANCE
    return max(p.bucket_bytes for p, r in zip(sweep.points, regret) if r <= limit) / MIB


def eta_band(eta: float, points: int = 9) -> list[float]:
    """Overlap efficiencies within :data:`ETA_UNCERTAINTY` of the measured one, clipped to [0, 1]."""
    lo, hi = max(0.0, eta - ETA_UNCERTAINTY), min(1.0, eta + ETA_UNCERTAINTY)
    return [lo + (hi - lo) * i / (points - 1) for i in range(points)]


def worst_regrets(sweep, eta: float = 1.0) -> list[float]:
    """Per swept size, its worst relative excess over the best size, over :func:`eta_band`:
    max over η of (cost + slack) / (best cost + slack) − 1."""
    regret = [0.0] * len(sweep.points)
    for e in eta_band(eta):
        cost = step_costs(sweep, e)
        best = min(cost) + SWEET_SPOT_SLACK_S
        regret = [max(r, (c + SWEET_SPOT_SLACK_S) / best - 1) for r, c in zip(regret, cost)]
    return regret


def step_costs(sweep, eta: float = 1.0) -> list[float]:
    """What each swept bucket size adds to the step: the exposed communication, plus (1 − η) of
    the hidden part where communication shares the processor with compute (bench.overlap)."""
    return [p.exposed_comm_s + contention_s(p.comm_s - p.exposed_comm_s, eta) for p in sweep.points]
