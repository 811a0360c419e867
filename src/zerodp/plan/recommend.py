"""From estimates to a decision: the fastest configuration that fits (guide §6.1, §7, §9, §14).

:func:`recommend` searches stage × shard-group size g × micro-batch × recomputation ×
compression × bucket size for a model on ``nodes`` × ``gpus_per_node`` GPUs and a target global
batch in tokens, keeps everything that fits with the headroom of
:data:`~zerodp.plan.memory.HEADROOM`, and ranks it by predicted time per token: the first pick is
by construction the fastest the step model predicts. Being communication-bound (below the
roofline threshold of guide §7) is a column, not a rejection; configurations within
:data:`TIE` of the first pick say so in "why not first", with what makes them simpler. The
attention implementation (``attention``, guide §8: FlashAttention/SDPA by default) is an input,
not searched. Every figure of a candidate comes from one planner function:

* batch: :func:`~zerodp.plan.batch.plan_batch` (gbs rounded to a power of two, guide §6.1);
* memory: :func:`~zerodp.plan.memory.memory_plan` (states, ZeRO-3's gathered units, activations)
  with ``optimizer``: AdamW's k bytes per parameter, or for a per-tensor optimizer (adafactor,
  muon) what tensor ownership gives the fullest rank, slice padding included (guide §12.3), the
  figure ``zerodp plan memory --optimizer`` prints;
* communication: :func:`~zerodp.plan.hybrid.step_comm` (each collective by leg, guide §14) over
  the elements the step's collectives move: Ψ for an elementwise optimizer, the padded groups of
  tensor ownership (:func:`~zerodp.plan.ownership.ownership`'s ``padded_numel``) for a
  per-tensor one;
* roofline: :func:`~zerodp.plan.roofline.threshold` (communication-bound below it, guide §7).

The step model (docs/planner.md, "recommend"), per GPU, ``t`` = micro-batch × seq tokens:

* compute: :func:`~zerodp.plan.compute.step_compute`, the hardware's compute model (GEMMs at
  the part's sustained matmul rate for their shape, FlashAttention at its measured rate,
  memory-bound work at HBM bandwidth, per-layer overheads, the recomputation the mode runs, the
  optimizer step's HBM traffic); with ``efficiency`` given instead, the seed's model: forward
  FLOPs F = 2·A·t + 2·L·seq·q·t (A active parameters; the causal attention scores and their
  product with V), backward 2F, recomputation adds the attention core's forward (selective) or a
  whole forward (full), compute = FLOPs / (C · efficiency);
* gradient collectives of stages 0-2 run in buckets of ``bucket_mb`` MiB: each bucket pays the
  collective's latency again; stage 3 runs one AllGather per unit (L blocks, the root unit);
* what is hidden: stages 0-1 reduce once per step, behind the last micro-batch's backward;
  stage 2 ReduceScatters every micro-batch behind its backward; stage 3 gathers and reduces every
  micro-batch behind its forward and backward; the parameter AllGather after the optimizer step
  of stages 1-2 is exposed. A window's exposed time is max(comm − hidden compute, comm / buckets):
  the last bucket (unit) cannot start before the compute it waits for is done;
* step = grad_acc × compute + exposed communication; MFU = model FLOPs (forward + backward,
  no recomputation) / (step × C).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from zerodp.plan._common import InputError, ToDict, check_count, fmt_bytes, fmt_count, parse_quantity
from zerodp.plan.batch import plan_batch
from zerodp.plan.collectives import collective_time
from zerodp.plan.calibrated import calibration_for, compute_times, contention_s, optimizer_time
from zerodp.plan.calibrated import efficiency as efficiency_of
from zerodp.plan.compute import _block_matmuls, step_compute
from zerodp.plan.hardware import (COMPUTE, Hardware, get_hardware, hardware_from_dict,
                                   sustained)
from zerodp.plan.hybrid import step_comm
from zerodp.plan.defaults import DEFAULTS
from zerodp.plan.memory import HEADROOM, RECOMPUTE, RECOMPUTE_MODES, memory_plan
from zerodp.plan.models import get_model
from zerodp.plan.ownership import PER_TENSOR, check_optimizer
from zerodp.plan.roofline import threshold
from zerodp.plan._common import MIB
from zerodp.plan.units import STAGE_NAMES

#: the bucket sizes searched for stages 0-2, MiB (25: PyTorch DDP's bucket_cap_mb)
BUCKET_MB = (25, 100, 400)
#: compressions searched by default: every one that changes the wire in bf16
SEARCH_COMPRESSIONS = ("none", "int8-params", "int8-grads", "int8")
#: micro-batches searched: powers of two up to this
MAX_SEARCH_MICRO_BATCH = 64
#: configurations this close in time per token to the first pick are a tie: "why not first" says
#: so, and what makes them simpler (no compression, less recomputation, ...)
TIE = 0.01
#: fraction of peak FLOP/s a step's compute reaches when given (None: the hardware's compute
#: model, :func:`~zerodp.plan.compute.step_compute`; calibration measures it: ``zerodp
#: calibrate``); zerodp.plan.defaults
DEFAULT_EFFICIENCY = DEFAULTS["recommend"]["efficiency"]


@dataclass(frozen=True)
class Candidate(ToDict):
    """One configuration and its prediction. ``to_dict()`` keys: ``stage``, ``stage_name``,
    ``shard_size`` (g), ``replicas`` (n/g), ``micro_batch``, ``grad_acc``, ``recompute``,
    ``compress``, ``bucket_mb`` (stages 0-2; null at stage 3, whose units are the blocks),
    ``memory_bytes`` (per GPU, :func:`memory_plan`'s total for the optimizer: the fullest rank
    under tensor ownership), ``comm_elements`` (elements one step's collectives move: 2 per
    element of the padded groups at stages 0-2, 3 at stage 3), ``verdict``, ``compute_s`` (the
    step's compute), ``comm_s`` (its collectives, slower leg), ``exposed_comm_s``, ``step_s``,
    ``tokens_per_step`` (all GPUs), ``tokens_per_s_per_gpu``, ``mfu``, ``bottleneck`` (leg),
    ``comm_bound`` (tokens per GPU per window below the roofline threshold of guide §7; shown,
    not rejected), ``lost_because`` (for runners-up: why the first pick beats it, or that it
    ties with it) and ``outer`` (the DiLoCo outer loop it runs, guide §16: "" for none)."""

    stage: int
    stage_name: str
    shard_size: int
    replicas: int
    micro_batch: int
    grad_acc: int
    recompute: str
    compress: str
    bucket_mb: float | None
    memory_bytes: float
    verdict: str
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    tokens_per_step: int
    tokens_per_s_per_gpu: float
    mfu: float
    bottleneck: str
    comm_bound: bool
    lost_because: str = ""
    comm_elements: float = 0.0
    outer: str = ""

    @property
    def seconds_per_token(self) -> float:
        return self.step_s / self.tokens_per_step


@dataclass(frozen=True)
class Recommendation(ToDict):
    """The answer of :func:`recommend`. ``to_dict()`` keys: ``model`` (name), ``params``,
    ``active_params``, ``hardware``, ``nodes``, ``gpus_per_node``, ``n``, ``global_batch_tokens``
    (the target), ``seq``, ``samples`` (gbs), ``precision``, ``optimizer``, ``efficiency`` (the
    first pick's compute: model FLOPs over peak × compute time), ``efficiency_source`` (where the
    compute figures come from: the hardware's compute model and its sustained figures, a given
    ``efficiency``, or a calibration profile), ``headroom``
    (fraction of HBM kept free), ``hbm_bytes``, ``searched`` (configurations tried),
    ``candidates`` (the top ones, fastest first), ``fitting`` (how many configurations fit),
    ``rejected`` (one entry per reason: ``reason``, ``count``, ``example``), ``attention``,
    ``train_flags`` (the first pick as ``zerodp train`` options), ``notes``, ``elapsed_s``, and
    with an outer loop or an inter-group link (guide §16) ``diloco`` (its settings),
    ``inter_group`` (the link) and ``loss_note`` (its measured cost in loss, or that none was
    measured); null and "" otherwise."""

    model: str
    params: float
    active_params: float
    hardware: str
    nodes: int
    gpus_per_node: int
    n: int
    global_batch_tokens: float
    seq: int
    samples: int
    precision: str
    efficiency: float
    headroom: float
    hbm_bytes: float
    searched: int
    candidates: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    elapsed_s: float = 0.0
    fitting: int = 0
    attention: str = DEFAULTS["recommend"]["attention"]
    train_flags: str = ""
    optimizer: str = DEFAULTS["recommend"]["optimizer"]
    efficiency_source: str = ""
    diloco: dict | None = None
    inter_group: dict | None = None
    loss_note: str = ""

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def shard_sizes(n: int, gpus_per_node: int) -> list[int]:
    """g searched on n GPUs: n (flat), and past one node every power-of-two multiple of a node
    below n that divides it (guide §14: groups fill whole nodes)."""
    out = {n}
    g = gpus_per_node
    while g < n:
        if n % g == 0:
            out.add(g)
        g *= 2
    return sorted(out)


def flops_per_micro_batch(model, seq: int, micro_batch: int, recompute: str) -> tuple[float, float]:
    """(model FLOPs, FLOPs actually run) of one micro-batch's forward + backward per GPU (module
    docstring): 3F, and 3F plus what ``recompute`` runs again."""
    t = seq * micro_batch
    attn = 2.0 * model.layers * seq * (model.q_dim or model.hidden) * t
    fwd = 2.0 * model.active * t + attn
    if recompute == "op":  # every second matmul of each block (compute._block_matmuls)
        mats = _block_matmuls(model)
        extra = 2.0 * t * (model.active_block_params or 0) * model.layers * sum(mats[1::2]) / sum(mats)
    else:
        extra = {"none": 0.0, "selective": attn, "layer": fwd / 2, "full": fwd}[recompute]
    return 3 * fwd, 3 * fwd + extra


def _window(comm: float, hidden: float, pieces: int) -> float:
    """Exposed time of ``comm`` seconds of collectives behind ``hidden`` seconds of compute, in
    ``pieces`` buckets or units: the last one waits for the compute to end."""
    if comm <= 0:
        return 0.0
    return max(comm - hidden, comm / max(pieces, 1))


@dataclass(frozen=True)
class _Comm:
    """A step's collectives split by when they run: ``per_micro`` (every micro-batch),
    ``per_step`` (once, behind the last backward), ``after_step`` (the parameter AllGather after
    the optimizer of stages 1-2), each (intra, inter) seconds of bandwidth, and the latency of
    one gradient collective and one parameter collective."""

    per_micro: tuple
    per_step: tuple
    after_step: tuple
    grad_latency: float
    param_latency: float
    grad_bytes: float


def _split_comm(hw, n, stage, params, g, precision, compress) -> _Comm:
    full = step_comm(hw, n, stage, params, g, precision, compress, gathers_per_step=2)
    tiny = step_comm(hw, n, stage, 1.0, g, precision, compress, gathers_per_step=2)
    buckets = {"per_micro": [0.0, 0.0], "per_step": [0.0, 0.0], "after_step": [0.0, 0.0]}
    grad_lat = param_lat = 0.0
    for c, z in zip(full.collectives, tiny.collectives):
        lat = max(z["intra_s"], z["inter_s"]) / max(c["count"], 1)
        if c["kind"] == "all_gather":
            when = "per_micro" if stage == 3 else "after_step"
            param_lat = max(param_lat, lat)
        else:
            when = "per_micro" if stage >= 2 else "per_step"
            grad_lat += lat
        buckets[when][0] += c["intra_s"]
        buckets[when][1] += c["inter_s"]
    wire = full.wire
    return _Comm(tuple(buckets["per_micro"]), tuple(buckets["per_step"]),
                 tuple(buckets["after_step"]), grad_lat, param_lat,
                 params * wire["wire_grad_bytes"])


def recommend(model, hardware="H100", nodes: int = 1, gpus_per_node: int | None = None,
              global_batch_tokens: float | str = 4 * 2**20, seq: int = 4096,
              precision: str = "bf16", efficiency: float = DEFAULT_EFFICIENCY,
              stages=(0, 1, 2, 3), recompute=RECOMPUTE, compress=SEARCH_COMPRESSIONS,
              bucket_mb=BUCKET_MB, micro_batches=None, top: int = 5,
              headroom: float = HEADROOM, calibration=None,
              attention: str = DEFAULTS["recommend"]["attention"],
              shard_sizes_searched=None,
              optimizer: str = DEFAULTS["recommend"]["optimizer"], *, round_batch: bool = True,
              require_fit: bool = True, constants=None, diloco=None) -> Recommendation:
    """The fastest configurations that fit, ranked (module docstring; docs/planner.md).

    ``model``: a preset name or :class:`~zerodp.plan.Model` with a shape; ``hardware``: a preset,
    a file or :class:`~zerodp.plan.Hardware` (``gpus_per_node`` overrides its
    ``devices_per_node``); ``global_batch_tokens``: the target (a number or "4M"); ``seq``: the
    sequence length; ``attention``: "flash" or "eager" (the activation model, guide §8);
    ``shard_sizes_searched``: the g to try (default :func:`shard_sizes`); ``optimizer``: one of
    :data:`~zerodp.plan.ownership.OPTIMIZERS` (module docstring: memory and collectives as
    ``zerodp plan memory --optimizer`` prices them). Raises ValueError (one line naming the
    input) on bad input.

    ``calibration``: a profile written by ``zerodp calibrate`` (path, dict or its table) on this
    many ranks. The compute of a micro-batch is then the measured forward + backward at its token
    count (interpolated, :func:`~zerodp.plan.calibrated.compute_times`; scaled by active
    parameters when the profile measured another model), the optimizer step its measured time
    over the parameters a rank steps (Ψ at stage 0, Ψ/g above), and (1 − η) of the communication
    that hides behind compute is added back, η the measured overlap efficiency
    (:func:`~zerodp.plan.calibrated.efficiency`). ``efficiency`` is then 1 (C is measured).

    ``efficiency`` None (the default): the compute comes from the hardware's compute model
    (:func:`~zerodp.plan.compute.step_compute` with ``constants``, default
    :data:`~zerodp.plan.hardware.COMPUTE`). ``round_batch`` False keeps the global batch as given
    (default: the nearest power of two of samples, guide §6.1); ``require_fit`` False prices
    configurations that do not fit too (``zerodp plan validate`` prices published runs as they
    ran).

    ``diloco`` (a :class:`~zerodp.plan.diloco.DiLoCoSettings` or its fields as a dict, guide §16):
    every hybrid layout of stages 1-3 (g < n) is also priced as DiLoCo over that stage — the
    inner step's collectives inside the shard group only, plus the outer loop's exchange and
    update per inner step (:func:`~zerodp.plan.diloco.outer_step_seconds`), and θ_outer and the
    momentum (8Ψ/g) in its memory. The hardware's inter-group link (``inter_group_bw``,
    ``inter_group_alpha``; :func:`~zerodp.plan.hardware.with_inter_group`) is read as the network
    between nodes: every configuration's cross-node collectives are priced on it (a shard group
    of whole nodes is one replica group). What DiLoCo costs in loss is only quoted from
    :data:`~zerodp.plan.diloco.LOSS_TABLE`, never predicted.
    """
    start = time.perf_counter()
    cal = None
    if calibration is not None:
        cal = calibration_for(calibration)
        efficiency = 1.0
    modelled = efficiency is None
    m = get_model(model)
    owned = check_optimizer(optimizer) in PER_TENSOR
    if not (m.layers and m.hidden and m.heads):
        raise InputError(f"recommend needs the model's shape and {m.name} has none: give a "
                         "config.json (--config) or a preset with a shape", "model")
    if hardware is None and calibration is not None:
        hardware = (hardware_from_dict(calibration, "calibration profile")
                    if isinstance(calibration, dict) else calibration)
    hw = get_hardware(hardware)
    nodes = check_count("nodes", nodes)
    gpn = hw.devices_per_node if gpus_per_node is None else check_count("gpus_per_node", gpus_per_node)
    if gpn != hw.devices_per_node:
        hw = replace(hw, devices_per_node=gpn)
    n = nodes * gpn
    outer = link = None
    if hw.inter_group_bw is not None or hw.inter_group_alpha is not None:
        if nodes == 1:
            raise InputError("the inter-group link joins nodes: give two nodes or more, or drop "
                             "the inter-group bandwidth and latency", "nodes")
        hw = replace(hw, inter_bw=hw.inter_bw if hw.inter_group_bw is None else hw.inter_group_bw * gpn,
                     inter_alpha=hw.inter_alpha if hw.inter_group_alpha is None else hw.inter_group_alpha)
    if nodes > 1 and hw.inter_bw <= 0:
        raise InputError(f"{hw.name} has no inter-node network: use --nodes 1", "nodes")
    if diloco is not None:
        from zerodp.plan.diloco import DiLoCoSettings
        outer = diloco if isinstance(diloco, DiLoCoSettings) else DiLoCoSettings(**dict(diloco))
    target = parse_quantity(global_batch_tokens, "global_batch_tokens", count=True)
    seq = check_count("seq", seq)
    if not modelled and not 0 < efficiency <= 1:
        raise InputError(f"efficiency must be in (0, 1], got {efficiency!r}", "efficiency")
    bad_rc = [r for r in recompute if r not in RECOMPUTE_MODES]
    if bad_rc:
        raise InputError(f"recompute must be among {', '.join(RECOMPUTE_MODES)}; got {bad_rc[0]!r}",
                         "recompute")
    if not 0 <= headroom < 1:
        raise InputError(f"headroom must be a fraction of HBM in [0, 1), got {headroom!r}",
                         "headroom")
    bad = [s for s in stages if s not in STAGE_NAMES]
    if bad:
        raise InputError(f"stages must be among 0, 1, 2, 3; got {bad[0]!r}", "stages")
    if micro_batches is None:
        micro_batches = [2**i for i in range(int(math.log2(MAX_SEARCH_MICRO_BATCH)) + 1)]
    c_eff = hw.flops * (efficiency or 1.0)
    consts = COMPUTE if constants is None else constants
    compute_cache: dict = {}
    eta = efficiency_of(cal) if cal is not None else 1.0
    rejected: dict = {}
    kept: list[Candidate] = []
    searched = 0
    samples = None
    comm_cache: dict = {}
    thr_cache: dict = {}
    units = m.layers + (1 if m.embedding_params else 0)
    for mbs in micro_batches:
        b = plan_batch(target, seq, mbs, n, round_to_power_of_two=round_batch)
        samples = b.samples
        for g in (shard_sizes(n, gpn) if shard_sizes_searched is None else shard_sizes_searched):
            for rc in recompute:
                if b.gpu_rich:  # every (stage, compression, bucket) of this point
                    count = sum(len([c for c in compress if s > 0 or c == "none"])
                                * (len(bucket_mb) if s < 3 else 1)
                                * (2 if outer is not None and g < n else 1)
                                for s in stages if g == n or s > 0)
                    searched += count
                    r = rejected.setdefault("grad_acc < 1", {
                        "reason": "grad_acc < 1", "count": 0,
                        "example": f"micro-batch {mbs} on {n:,} GPUs needs {mbs * n:,} samples, "
                                   f"the global batch is {b.samples:,}"})
                    r["count"] += count
                    continue
                mp = memory_plan(m, n, hw, precision, seq=seq, micro_batch=mbs, recompute=rc,
                                 shard_size=g if g < n else None, headroom=headroom,
                                 attention=attention, optimizer=optimizer)
                for s in stages:
                    if s == 0 and g < n:
                        continue  # hybrid sharding changes nothing at stage 0
                    row = mp.stages[s]
                    comps = [c for c in compress if s > 0 or c == "none"]
                    bks = list(bucket_mb) if s < 3 else [None]
                    twins = outer is not None and g < n
                    searched += len(comps) * len(bks) * (2 if twins else 1)
                    label = (f"{STAGE_NAMES[s]}, g {g}, micro-batch {mbs}, recompute {rc}: "
                             f"{fmt_bytes(row['total_bytes'])} of {fmt_bytes(hw.hbm_bytes)}")
                    if row["verdict"] != "fits" and require_fit:
                        reason = ("does not fit in HBM" if row["verdict"] == "no" else
                                  f"tight: within the {headroom:.0%} headroom of HBM")
                        r = rejected.setdefault(reason, {"reason": reason, "count": 0,
                                                         "example": label})
                        r["count"] += len(comps) * len(bks) * (2 if twins else 1)
                        continue
                    model_flops, run_flops = flops_per_micro_batch(m, seq, mbs, rc)
                    opt_s = 0.0
                    if cal is None and modelled:
                        if (mbs, rc) not in compute_cache:
                            compute_cache[(mbs, rc)] = step_compute(m, hw, seq, mbs, rc, 0.0, consts,
                                                                    attention)
                        ct = compute_cache[(mbs, rc)]
                        fwd_s, micro_s = ct.forward_s, ct.forward_s + ct.backward_s
                        opt_s = (consts.optimizer_bytes * m.params / (g if s > 0 else 1)
                                 / sustained(hw)["hbm_bw"])
                    elif cal is None:
                        micro_s = run_flops / c_eff
                        fwd_s = micro_s / 3 if rc == "none" else (model_flops / 3) / c_eff
                    else:
                        f_s, b_s = compute_times(cal["compute"], mbs * seq)
                        scale = m.active / cal["compute"]["params"]
                        fwd_s = f_s * scale
                        micro_s = (f_s + b_s) * scale * run_flops / model_flops
                        opt_s = optimizer_time(cal["compute"], mbs * seq,
                                               m.params / (g if s > 0 else 1))
                    bwd_s = micro_s - fwd_s
                    # the elements each collective moves: Ψ, or tensor ownership's padded groups
                    elements = row["ownership"]["padded_numel"] if owned else m.params
                    # stage 3's owner exchange (guide §12.3): fp32 all-to-alls in the shard group at
                    # the step, priced as a ReduceScatter whose ring sends the same bytes per rank
                    sent = 4 * row["ownership"].get("max_exchange_elements", 0) if owned else 0
                    exchange_s = collective_time("reduce_scatter", sent * g / (g - 1), g, hw).time_s \
                        if sent and g > 1 else 0.0
                    for cp in comps:
                        key = (s, g, cp)
                        if key not in comm_cache:
                            comm_cache[key] = _split_comm(hw, n, s, elements, g if g < n else None,
                                                          precision, cp)
                        cm = comm_cache[key]
                        tkey = (g, cp)
                        if tkey not in thr_cache:
                            thr_cache[tkey] = threshold(
                                hw, n, model=m, shard_size=g if g < n else None,
                                compress=cp).threshold_tokens
                        window_tokens = mbs * seq * (1 if s == 3 else b.grad_acc)
                        # padding moves more per token: the threshold grows with it
                        bound = window_tokens < thr_cache[tkey] * (elements / m.params)
                        for bk in bks:
                            pieces = units if bk is None else max(
                                1, math.ceil(cm.grad_bytes / (bk * MIB)))
                            lat = (pieces - 1) * (cm.param_latency * 2 + cm.grad_latency
                                                  if s == 3 else cm.grad_latency)
                            per_micro = max(cm.per_micro) + (lat if s >= 2 else 0.0)
                            per_step = max(cm.per_step) + (lat if s < 2 else 0.0)
                            after = max(cm.after_step) + exchange_s
                            hide = (fwd_s + bwd_s) if s == 3 else bwd_s
                            exposed = (b.grad_acc * _window(per_micro, hide, pieces)
                                       + _window(per_step, bwd_s, pieces) + after)
                            comm = b.grad_acc * per_micro + per_step + after
                            compute = b.grad_acc * micro_s + opt_s
                            if cal is not None:  # what hid still shared the processor
                                exposed += contention_s(comm - exposed, eta)
                            step = compute + exposed
                            tokens = b.effective_samples * seq
                            legs = [sum(x) for x in zip(cm.per_micro, cm.per_step, cm.after_step)]
                            cand = Candidate(
                                stage=s, stage_name=STAGE_NAMES[s], shard_size=g, replicas=n // g,
                                micro_batch=mbs, grad_acc=b.grad_acc, recompute=rc, compress=cp,
                                bucket_mb=bk, memory_bytes=row["total_bytes"],
                                verdict=row["verdict"], compute_s=compute, comm_s=comm,
                                exposed_comm_s=exposed, step_s=step, tokens_per_step=tokens,
                                tokens_per_s_per_gpu=tokens / n / step,
                                mfu=b.grad_acc * model_flops / (step * hw.flops),
                                bottleneck="inter" if legs[1] > legs[0] else "intra",
                                comm_bound=bound, comm_elements=row["comm_elements_per_step"])
                            kept.append(cand)
                            if twins:
                                twin = _diloco_twin(
                                    cand, outer, hw, n, g, s, elements, precision, cp, bk, pieces,
                                    units, b.grad_acc, micro_s, fwd_s, opt_s, exchange_s, m,
                                    row, headroom, comm_cache, thr_cache, mbs * seq,
                                    eta if cal is not None else None)
                                if twin.verdict == "fits" or not require_fit:
                                    kept.append(twin)
                                else:
                                    reason = ("DiLoCo (outer state 8Ψ/g added): does not fit in "
                                              "HBM" if twin.verdict == "no" else
                                              "DiLoCo (outer state 8Ψ/g added): tight")
                                    r = rejected.setdefault(reason, {"reason": reason, "count": 0,
                                                                     "example": label})
                                    r["count"] += 1
    notes = []
    if kept and all(c.comm_bound for c in kept):
        notes.append("every configuration that fits is communication-bound (below the roofline "
                     "threshold of guide §7): a larger global batch or fewer GPUs would help")
    # fastest first, by construction; exact ties: the simpler, then the smaller
    kept.sort(key=lambda c: (c.seconds_per_token, _complexity(c), c.memory_bytes))
    best = kept[0] if kept else None
    ranked = [best] if best else []
    seen = {_shape(best)} if best else set()
    if best is not None and top > 1:  # the simplest tie is always shown: a stated preference
        ties = [c for c in kept if c.seconds_per_token <= best.seconds_per_token * (1 + TIE)]
        simplest = min(ties, key=lambda c: (_complexity(c), c.seconds_per_token))
        if _shape(simplest) not in seen:
            seen.add(_shape(simplest))
            ranked.append(replace(simplest, lost_because=lost_because(simplest, best)))
    for c in kept[1:]:
        if len(ranked) >= top:
            break
        if _shape(c) in seen:
            continue
        seen.add(_shape(c))
        ranked.append(replace(c, lost_because=lost_because(c, best)))
    ranked.sort(key=lambda c: (c.seconds_per_token, _complexity(c), c.memory_bytes))
    if not kept:
        notes.append("nothing fits: more GPUs, a shorter sequence, recomputation or a smaller "
                     "model")
    elif best.comm_bound:
        notes.append("the first pick is communication-bound (guide §7): its exposed "
                     "communication is in its step time; a larger global batch would hide it")
    if samples is not None and abs(samples * seq - target) > 0.01 * target:
        notes.append(f"global batch rounded to {samples:,} samples of {seq:,} tokens "
                     f"({fmt_count(samples * seq)} tokens; guide §6.1)")
    if cal is not None:
        source = "calibration profile (measured forward, backward and optimizer times)"
    elif not modelled:
        source = f"given: {efficiency:.0%} of peak for every configuration"
    else:
        rate = sustained(hw)
        source = (f"{hw.name} compute model: matmul {rate['matmul_efficiency']:.0%} of peak "
                  f"sustained (MAMF), FlashAttention {rate['attention_efficiency']:.0%}, HBM "
                  f"{rate['hbm_bw'] / 1e12:.3g} TB/s"
                  + (f", clock x{rate['clock_factor']:.2f} at {hw.power_limit_w:g} W"
                     if rate["clock_factor"] < 1 else "")
                  + (f"; assumed: {', '.join(rate['assumed'])}" if rate["assumed"] else "")
                  + " (docs/planner.md, \"The compute model\")")
    loss_note = ""
    if outer is not None:
        from zerodp.plan.diloco import loss_figure
        _, loss_note = loss_figure(m.name, outer, None)
        twins = [c for c in kept if c.outer]
        plain = [c for c in kept if not c.outer]
        if best is not None and best.outer:
            notes.append(f"the first pick runs DiLoCo over hybrid sharding ({outer.label()}; guide "
                         f"§16), priced per inner step; loss: {loss_note}")
            if plain:
                other = min(plain, key=lambda c: c.seconds_per_token)
                notes.append(f"without an outer loop the fastest ({other.stage_name}, g "
                             f"{other.shard_size}) is {_pct(other, best)} slower per token")
        elif twins:
            fast = min(twins, key=lambda c: c.seconds_per_token)
            notes.append(f"DiLoCo ({outer.label()}) is at best {_pct(fast, best)} per token "
                         f"slower than the first pick ({fast.stage_name}, g {fast.shard_size}); "
                         f"loss: {loss_note}")
        else:
            notes.append(f"DiLoCo ({outer.label()}) needs a hybrid layout of stages 1-3 (g < N) "
                         "that fits: none here")
    if modelled:
        efficiency = best.mfu * best.step_s / best.compute_s if best else 0.0
    if hw.inter_group_bw is not None or hw.inter_group_alpha is not None:
        from zerodp.plan.diloco import group_link
        link = group_link(hw, n, gpn).to_dict()
    return Recommendation(
        model=m.name, params=m.params, active_params=m.active, hardware=hw.name, nodes=nodes,
        gpus_per_node=gpn, n=n, global_batch_tokens=target, seq=seq, samples=samples or 0,
        precision=precision, efficiency=efficiency, headroom=headroom, hbm_bytes=hw.hbm_bytes,
        searched=searched, candidates=ranked,
        rejected=sorted(rejected.values(), key=lambda r: -r["count"]), notes=notes,
        elapsed_s=time.perf_counter() - start, fitting=len(kept), attention=attention,
        train_flags=train_flags(best, nodes, gpn, samples * seq, seq, precision, outer) if best else "",
        optimizer=optimizer, efficiency_source=source,
        diloco=outer.to_dict() if outer is not None else None, inter_group=link,
        loss_note=loss_note)


def _pct(c: Candidate, best: Candidate) -> str:
    return f"{100 * (c.seconds_per_token / best.seconds_per_token - 1):.2f}%"


def _diloco_twin(cand: Candidate, outer, hw, n, g, s, elements, precision, cp, bk, pieces, units,
                 grad_acc, micro_s, fwd_s, opt_s, exchange_s, m, row, headroom, comm_cache,
                 thr_cache, micro_tokens, eta) -> Candidate:
    """``cand`` (a hybrid layout, g < n) as DiLoCo over its stage (guide §16; :func:`recommend`):
    the inner step's collectives inside the shard group, exposed as the hybrid step's are, plus
    the outer loop's exchange and update per inner step; θ_outer and the momentum in memory."""
    from zerodp.plan.diloco import group_link, outer_state_bytes, outer_step_seconds
    from zerodp.plan.memory import verdict

    key = (s, g, cp, "inner")
    if key not in comm_cache:
        comm_cache[key] = _split_comm(hw, g, s, elements, None, precision, cp)
    cm = comm_cache[key]
    lat = (pieces - 1) * (cm.param_latency * 2 + cm.grad_latency if s == 3 else cm.grad_latency)
    per_micro = max(cm.per_micro) + (lat if s >= 2 else 0.0)
    per_step = max(cm.per_step) + (lat if s < 2 else 0.0)
    after = max(cm.after_step) + exchange_s
    bwd_s = micro_s - fwd_s
    hide = micro_s if s == 3 else bwd_s
    exposed = (grad_acc * _window(per_micro, hide, pieces) + _window(per_step, bwd_s, pieces)
               + after)
    comm = grad_acc * per_micro + per_step + after
    compute = grad_acc * micro_s + opt_s
    if eta is not None:
        exposed += contention_s(comm - exposed, eta)
    link = group_link(hw, n, g)
    outer_avg, _ = outer_step_seconds(elements, n, g, outer, link, compute,
                                      hbm_bw=sustained(hw)["hbm_bw"], stage=s, hardware=hw)
    exposed += outer_avg
    step = compute + exposed
    tkey = (g, cp, "inner")
    if tkey not in thr_cache:
        thr_cache[tkey] = threshold(hw, g, model=m, compress=cp).threshold_tokens
    window = micro_tokens * (1 if s == 3 else grad_acc)
    memory = row["total_bytes"] + outer_state_bytes(elements, g, outer.momentum)
    tokens = cand.tokens_per_step
    legs = [sum(x) for x in zip(cm.per_micro, cm.per_step, cm.after_step)]
    return replace(cand, memory_bytes=memory, verdict=verdict(memory, hw.hbm_bytes, headroom),
                   compute_s=compute, comm_s=comm, exposed_comm_s=exposed, step_s=step,
                   tokens_per_s_per_gpu=tokens / n / step,
                   mfu=cand.mfu * cand.step_s / step,
                   bottleneck="inter" if legs[1] > legs[0] else "intra",
                   comm_bound=window < thr_cache[tkey] * (elements / m.params),
                   outer="DiLoCo " + outer.label())


def train_flags(c: Candidate, nodes: int, gpus_per_node: int, global_batch_tokens: int, seq: int,
                precision: str, outer=None) -> str:
    """Candidate ``c`` as ``zerodp train`` options (the same names: docs/planner.md, "one
    vocabulary"); paste them after ``zerodp train --model ...`` (on each node under torchrun past
    one). Recomputation and attention are the activation model's, not options of the trainer."""
    flags = [f"--nproc {gpus_per_node}", f"--stage {c.stage}", f"--micro-batch {c.micro_batch}",
             f"--global-batch-tokens {int(global_batch_tokens)}", f"--seq-len {seq}",
             f"--mixed-precision {precision}"]
    if c.bucket_mb is not None:
        flags.append(f"--bucket-mb {c.bucket_mb:g}")
    if c.stage > 0 and c.shard_size != gpus_per_node:
        flags.append(f"--shard-size {c.shard_size}")
    if c.compress != "none":
        flags.append(f"--compress {c.compress}")
    if c.outer and outer is not None:  # guide §16: the replica groups are the shard groups
        if not (c.stage > 0 and c.shard_size != gpus_per_node):
            flags.append(f"--shard-size {c.shard_size}")
        flags.append(f"--diloco-every {outer.every}")
        if outer.fragments > 1:
            flags.append(f"--diloco-fragments {outer.fragments}")
        if outer.compress != "none":
            flags.append(f"--diloco-compress {outer.compress}")
        if outer.delay:
            flags.append(f"--diloco-delay {outer.delay}")
    return " ".join(flags)


#: recomputations from the least recomputed to the most (the order "simpler" reads)
_RC_ORDER = ("none", "selective", "op", "layer", "full")


def _complexity(c: Candidate) -> tuple:
    """What a configuration asks of the run beyond plain training: an outer loop (changes the
    optimization, guide §16), compression (changes the numbers, guide §15), recomputation (more
    compute), hybrid sharding, a higher stage."""
    return (c.outer != "", c.compress != "none", _RC_ORDER.index(c.recompute),
            c.shard_size < c.replicas * c.shard_size, c.stage)


def _shape(c: Candidate) -> tuple:
    """Runners-up differ from each other in more than the bucket size."""
    return (c.stage, c.shard_size, c.micro_batch, c.recompute, c.compress, c.outer)


def lost_because(c: Candidate, best: Candidate) -> str:
    """Why ``best`` beats ``c``, per token: the larger of the compute and exposed-communication
    differences; within :data:`TIE`, "a tie" and what ``c`` asks less of the run, if anything."""
    if c.seconds_per_token <= best.seconds_per_token * (1 + TIE):
        simpler = [why for why, yes in (
            ("no outer loop", c.outer == "" != best.outer),
            ("no compression", c.compress == "none" != best.compress),
            ("less recomputation", _RC_ORDER.index(c.recompute) < _RC_ORDER.index(best.recompute)),
            ("a lower stage", c.stage < best.stage)) if yes]
        gap = 100 * (c.seconds_per_token / best.seconds_per_token - 1)
        return (f"tie: +{gap:.2f}% per token (within {TIE:.0%})"
                + (f"; simpler: {', '.join(simpler)}" if simpler else ""))
    per = best.tokens_per_step / c.tokens_per_step
    d_compute = c.compute_s * per - best.compute_s
    d_exposed = c.exposed_comm_s * per - best.exposed_comm_s
    if d_compute >= d_exposed:
        why = ("recomputation" if c.recompute != best.recompute else
               "smaller micro-batches" if c.micro_batch < best.micro_batch else
               "larger micro-batches" if c.micro_batch > best.micro_batch else
               "the optimizer steps all of Ψ on every GPU" if c.stage == 0 < best.stage else
               "the optimizer step")
        return f"+{d_compute * 1e3:.3g} ms of compute ({why})"
    return f"+{d_exposed * 1e3:.3g} ms of exposed communication"


#: the columns of the ranked table (the CLI's and the page's)
COLUMNS = ["#", "stage", "G", "micro-batch", "grad_acc", "recompute", "compress", "bucket-mb",
           "GB/GPU", "step", "exposed", "tok/s/GPU", "MFU", "comm-bound", "why not first"]


def _outer_column(r: Recommendation) -> bool:
    """The "outer" column shows when a candidate runs DiLoCo (guide §16)."""
    return any(c.outer for c in r.candidates)


def columns(r: Recommendation) -> list[str]:
    """:data:`COLUMNS`, with "outer" after "compress" when a candidate runs DiLoCo."""
    if not _outer_column(r):
        return list(COLUMNS)
    i = COLUMNS.index("compress") + 1
    return COLUMNS[:i] + ["outer"] + COLUMNS[i:]


def rows(r: Recommendation) -> list[list[str]]:
    """The ranked table's cells as the CLI prints them (the page shows the same strings)."""
    from zerodp.plan._common import fmt_time

    out = []
    outer = _outer_column(r)
    for i, c in enumerate(r.candidates, 1):
        out.append([str(i), c.stage_name, str(c.shard_size), str(c.micro_batch), str(c.grad_acc),
                    c.recompute, c.compress] + ([c.outer or "-"] if outer else []) + [
                    "unit" if c.bucket_mb is None else f"{c.bucket_mb:g}",
                    f"{c.memory_bytes / 1e9:.1f}", fmt_time(c.step_s), fmt_time(c.exposed_comm_s),
                    f"{c.tokens_per_s_per_gpu:,.0f}", f"{100 * c.mfu:.1f}%",
                    "yes" if c.comm_bound else "no",
                    "first pick: fastest" if i == 1 else c.lost_because])
    return out


def text(r: Recommendation, hardware: Hardware | None = None) -> str:
    """The ranked table, the rejected regions and the notes, as the CLI prints them."""
    from zerodp.plan._common import table
    head = (("Configurations that fit, fastest first: " if r.candidates else "Searched: ")
            + f"{r.model} (Ψ = {fmt_count(r.params)}"
            + (f", {fmt_count(r.active_params)} active" if r.active_params != r.params else "")
            + f") on {r.nodes} × {r.gpus_per_node} {r.hardware} = {r.n:,} GPUs, global batch "
            f"{r.samples:,} × {r.seq:,} tokens, {r.precision}, {r.optimizer} optimizer, {r.attention} attention, "
            f"compute at "
            f"{r.efficiency:.0%} of peak (#1); fits: ≤ {1 - r.headroom:.0%} of {r.hbm_bytes / 1e9:.3g} "
            f"GB (1 GB = 1e9 B)")
    if r.candidates:
        align = "rllrrllllrrrrrll" if _outer_column(r) else "rllrrlllrrrrrll"
        out = [table(columns(r), rows(r), title=head, align=align),
               f"{r.fitting:,} configurations fit; shown: the fastest of each layout (bucket sizes "
               f"folded); ties: within {TIE:.0%} per token",
               f"zerodp train {r.train_flags}  (#1; recompute and attention are the activation "
               "model's, not zerodp train options"
               + ("" if r.optimizer == "adamw" else f"; zerodp train steps AdamW: run {r.optimizer} "
                  "through zerodp.parallelize(optimizer=...)") + ")"]
    else:
        out = [head, f"Nothing fits: none of the {r.searched:,} configurations searched fits in "
                     f"{1 - r.headroom:.0%} of HBM (reasons below)."]
    if r.rejected:
        out.append("")
        out.append(f"rejected ({r.searched:,} configurations searched):")
        for x in r.rejected:
            out.append(f"  {x['count']:>6,}  {x['reason']}" + (f" — e.g. {x['example']}"
                                                              if x["example"] else ""))
    out += [f"note: {x}" for x in r.notes]
    if r.efficiency_source:
        out.append(f"compute: {r.efficiency_source}")
    out.append(f"searched in {r.elapsed_s:.2f} s")
    return "\n".join(out)


#: the English this module writes (cells, examples, notes) in Chinese, pattern by pattern, in
#: order; terms as the guide's Chinese (重计算, 微批次, 暴露通信, 屋顶线)
_ZH = [
    (r"^first pick: fastest$", "首选：最快"),
    (r"^tie: \+(\S+)% per token \(within (\S+)%\)", r"并列：每 token 慢 \1%（在 \2% 以内）"),
    (r"; simpler: ", "；优点："), (r"no outer loop", "不用 DiLoCo"), (r"no compression", "不压缩"),
    (r"less recomputation", "重计算少"), (r"a lower stage", "阶段低"), (r", ", "、"),
    (r"^\+(\S+ \S+) of compute \((.*)\)$", r"计算多 \1（\2）"),
    (r"^\+(\S+ \S+) of exposed communication$", r"暴露通信多 \1"),
    (r"（recomputation）", "（重计算）"), (r"smaller micro-batches", "微批次小"),
    (r"larger micro-batches", "微批次大"),
    (r"the optimizer steps all of Ψ on every GPU", "每张卡的优化器都处理全部 Ψ"),
    (r"the optimizer step", "优化器的一步"),
    (r"^yes$", "是"), (r"^no$", "否"), (r"^none$", "无"), (r"^selective$", "选择性"),
    (r"^full$", "完全"), (r"^unit$", "按单元"),
    (r"^(\S+)、g (\d+)、micro-batch (\d+)、recompute (\w+): (.+) of (.+)$",
     r"\1，分片组 \2，微批次 \3，重计算 \4：\5（显存 \6）"),
    (r"^micro-batch (\d+) on ([\d,]+) GPUs needs ([\d,]+) samples、the global batch is ([\d,]+)$",
     r"微批次 \1 × \2 张卡需要 \3 个样本，而全局批次只有 \4 个"),
    (r"^every configuration that fits is communication-bound .*$",
     "放得下的配置全都受通信限制（低于指南 §7 的屋顶线阈值）：可以加大全局批次或减少卡数"),
    (r"^nothing fits: .*$", "都放不下：加卡、缩减序列长度、重计算，或用小的模型"),
    (r"^the first pick is communication-bound .*$",
     "首选受通信限制（指南 §7）：其暴露通信已计入每步时间；加大全局批次可以隐藏"),
    (r"^global batch rounded to ([\d,]+) samples of ([\d,]+) tokens \((\S+) tokens; guide §6.1\)$",
     r"全局批次取整为 \1 个样本 × \2 token（\3 token；指南 §6.1）"),
]


def zh(text: str) -> str:
    """One of this module's English strings in Chinese (:data:`_ZH`); unknown text unchanged."""
    import re

    for pattern, repl in _ZH:
        text = re.sub(pattern, repl, text)
    return text
