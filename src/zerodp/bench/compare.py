"""``zerodp bench``: our engine side by side with its PyTorch peer, stage by stage, in two regimes.

What is measured (one spawned group of gloo ranks for all regimes; within a regime, stage after
stage, the floor and one stage's contenders alive at once — :func:`zerodp.bench.schedule.stage_groups`; where those
would not fit the machine's memory, ours and its peer alone, then the others):

- **step time**: every training step (forward, backward, optimizer, zero grad; for our engine
  also the wait for any in-flight parameter AllGather, so that no work leaks into the next
  contender's step) timed on each rank between barriers; a step takes as long as its slowest rank,
  so the figure per step is the max over ranks, and per contender the **median** over the timed
  steps. Contenders of a stage run **alternated**, in turns (:func:`zerodp.bench.schedule.schedule`): each contender
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
  regime (:func:`zerodp.bench.runner.rank_memory`): contenders built one after another in one process would each find
  the heap the earlier ones left (glibc keeps freed holes resident), and the figure would depend on
  the order. Before the reading the group builds the same contender once on the nano model and
  steps it (:func:`zerodp.bench.runner.rank_memory`): what a process pays once (lazy imports, the optimizer
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
  counts (stage 1's gradient ReduceScatter, an in-place AllReduce on CPU, sends as much as an
  AllReduce; gloo's own ReduceScatter, which FSDP2 calls, too).

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
alternated with the rest (:class:`zerodp.bench.contenders.Variant`).
:func:`zerodp.bench.results.compressed_rows` sets each
against our plain row of its stage: time, ×floor, bytes per leg from the trace and their ratio to
the plain row's next to the planner's (:func:`zerodp.plan.hybrid.wire_bytes`). Without these
options the bench is what it was.

**Compiled** (``zerodp bench --compile``, :attr:`BenchSpec.compile`): beside the eager rows, ours
and each stage's reference peer on a model compiled in place before it is wrapped
(:func:`zerodp.engine.compiled.compile_in_place`, what ``zerodp train --compile`` calls: aot_eager
on CPU, inductor on CUDA), in the same stage group, alternated with the rest. Compilation happens in
the build step, which is never timed (its duration is kept, ``first_step_s``, the max over ranks);
:func:`zerodp.bench.results.compiled_rows` sets compiled against eager and ours against the peer.

**Muon** (``zerodp bench --optimizer muon``, :attr:`BenchSpec.optimizer`): every contender steps
``torch.optim.Muon`` over the blocks' 2-D weights and AdamW over the rest
(:func:`zerodp.bench.peers.optimizers_for`); ours at each stage is compared with one peer, DDP with
the same stock optimizers and their state replicated (``ddp_muon``). All of them live in one group
where it fits (:func:`zerodp.bench.schedule.stage_groups`). Each contender's optimizer state per
rank and its last step's loss are kept, and :func:`zerodp.bench.results.muon_rows` sets each against
the peer's. Nothing else in the bench changes.

On CUDA (``BenchSpec(device="cuda")``, what ``python -m zerodp.bench.gpu_check`` runs): NCCL, rank r
on ``cuda:r`` (one GPU per rank, so world 1 is allowed there: the comparison then measures fixed
costs), the device synchronized before each step's start and end time are read, peak memory from
``torch.cuda.max_memory_allocated`` instead of RSS, and no bytes-sent figure (NCCL writes no socket
the process's ``wchar`` would see). CPU runs are unchanged.

The code, one step per module: what to run (:mod:`~zerodp.bench.spec`; the contenders' names and
variants, :mod:`~zerodp.bench.contenders`; their builders, :mod:`~zerodp.bench.peers`), when each
steps (:mod:`~zerodp.bench.schedule`), whether it fits the memory (:mod:`~zerodp.bench.budget`), the
measurement on every rank (:mod:`~zerodp.bench.runner`), the results and their rows
(:mod:`~zerodp.bench.results`), the tables and the plot (:mod:`~zerodp.bench.tables`). This module
drives them: :func:`run_bench`, and the bucket sizes and predictions it hands the contenders.
"""

from __future__ import annotations

import statistics

from zerodp.bench import probe
from zerodp.bench.budget import check_memory
from zerodp.bench.contenders import CONTENDERS, variant_of
from zerodp.bench.results import BenchResult, ContenderResult, RegimeResult
from zerodp.bench.runner import rank_bench, rank_memory
from zerodp.bench.spec import UNIT, BenchSpec, Device, Memory, Regime
from zerodp.plan._common import MIB


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
    if spec.device is Device.CUDA:  # the GPUs' memory, not this host's, holds the contenders
        import torch

        if torch.cuda.device_count() < spec.world_size:
            raise ValueError(f"a CUDA bench on {spec.world_size} ranks needs as many GPUs; "
                             f"{torch.cuda.device_count()} visible")
        backend, groups = "nccl", None
    else:
        groups = check_memory(spec, names)
    buckets = contender_buckets(spec, names)
    bucket = {r.name: buckets for r in spec.regimes}
    per_rank = run_local(rank_bench, spec.world_size, spec, names, bucket, groups, timeout=timeout, backend=backend)
    if spec.memory is Memory.FRESH:
        peaks = _fresh_peaks(spec, names, bucket, timeout, backend)
        for j, regime in enumerate(spec.regimes):
            for name in names:
                for rank, r in enumerate(per_rank):
                    r[j][0][name]["peak"] = peaks[regime.name, name][rank]
    results = [_regime_result(spec, cal, regime, [r[j][0] for r in per_rank], per_rank[0][j][1], names)
               for j, regime in enumerate(spec.regimes)]
    auto = {rr.regime.name: rr.contenders["ours0_auto"].options["bucket_mb"] for rr in results
            if "ours0_auto" in rr.contenders}
    import torch

    torch.manual_seed(0)
    params = GPT(PRESETS[spec.model]).num_params()
    return BenchResult(spec, machine, results, auto, params)


def _regime_result(spec: BenchSpec, cal: dict | None, regime: Regime, ranks: list[dict], wall: float,
                   names: list[str]) -> RegimeResult:
    """One regime's :class:`RegimeResult` from every rank's measurements: a step takes as long as
    its slowest rank (the max over ranks), a contender as long as its median step."""
    contenders = {}
    for name in names:
        stage, role, label = CONTENDERS[name]
        times = [max(s) for s in zip(*(r[name]["times"] for r in ranks))]
        r0 = ranks[0][name]
        c = ContenderResult(name, label, stage, role, times, statistics.median(times),
                            [r[name]["peak"] for r in ranks], [r[name]["states"] for r in ranks],
                            [r[name]["sent"] for r in ranks], r0["options"], r0["own_comm"],
                            r0["first_loss"], wire_bytes=r0.get("wire"),
                            first_step_s=max(r[name]["first_step_s"] for r in ranks),
                            timed_compiles=max(r[name]["timed_compiles"] for r in ranks),
                            optimizer_state_bytes=[r[name]["optimizer_states"] for r in ranks],
                            last_loss=r0["last_loss"])
        if role == "ours":
            c.predicted_wire_bytes = planner_wire_bytes(spec, regime, name)
        if cal is not None:
            c.predicted_s, _ = _predict(cal, spec, regime, name, c.options.get("bucket_mb", spec.bucket_mb))
        contenders[name] = c
    return RegimeResult(regime, contenders, wall)


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
            run_local(rank_memory, spec.world_size, spec, regime, name, mb, timeout=timeout, backend=backend))
    per_rank = {key: [[reading[r] for reading in readings] for r in range(spec.world_size)]
                for key, readings in samples.items()}
    # The lower middle reading (a measured byte count); missing where any reading is (no /proc).
    return {key: [None if None in values else statistics.median_low(values) for values in ranks]
            for key, ranks in per_rank.items()}


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


def unit_mb(model: str) -> float:
    """MiB of one transformer block's parameters (fp32) of preset ``model``: the unit FSDP2 reduces
    at, one ``fully_shard`` per block (:func:`zerodp.bench.peers.build`)."""
    import torch

    from zerodp.train.model import GPT, PRESETS

    with torch.device("meta"):
        block = GPT(PRESETS[model]).blocks[0]
    return sum(p.numel() * p.element_size() for p in block.parameters()) / MIB


def check_profile(profile: str, model: str, world_size: int) -> dict:
    """The profile's calibration table, if it was measured for this model and world size."""
    from zerodp.plan.calibrated import load_calibration

    cal = load_calibration(profile)["calibration"]
    measured = cal["compute"]["model"]
    if measured != model:
        raise ValueError(f"profile {profile} measured the compute of model {measured!r}, the bench runs "
                         f"{model!r}: re-run 'zerodp calibrate --model {model}' (or bench --calibrate)")
    if cal["world_size"] != world_size:
        raise ValueError(f"profile {profile} was calibrated on {cal['world_size']} ranks, the bench "
                         f"runs {world_size}: re-run 'zerodp calibrate --nproc {world_size}'")
    return cal


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
        v = variant_of(name)
        p = predict_step(cal, cfg, stage, regime.micro_batch, regime.seq_len, bucket_mb, compress=v.compress,
                         shard_size=spec.shard_size if v.hybrid else None)
        return p.step_s, p.wire_bytes
    return None, None


def planner_wire_bytes(spec: BenchSpec, regime: Regime, name: str) -> dict[str, float]:
    """The planner's bytes per rank per step by leg for our contender ``name`` (no calibration
    needed: :func:`zerodp.bench.predict.predicted_wire_bytes`, guide §14-§15)."""
    from zerodp.bench.predict import predicted_wire_bytes, root_share
    from zerodp.plan.calibrated import gpt_layer_shapes
    from zerodp.train.model import PRESETS

    v = variant_of(name)
    shapes = gpt_layer_shapes(PRESETS[spec.model], regime.seq_len)
    params = sum(x.params for x in shapes)
    return predicted_wire_bytes(v.stage, params, spec.world_size, v.compress, spec.shard_size if v.hybrid else None,
                                kept_last_share=root_share(shapes))
