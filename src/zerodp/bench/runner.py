"""``zerodp bench`` on every rank: build each contender, step it in its turns, time and measure it.

:func:`rank_bench` runs every regime of a spec in one spawned group (the timing group);
:func:`rank_memory` runs one contender alone in a fresh group for its peak memory. What is measured
and why (barriers, untimed first steps of a turn, the warm-up before a peak) is
:mod:`zerodp.bench.compare`'s docstring.

Compiled contenders (``zerodp bench --compile``) compile in their build step, the first step of
each regime (untimed, its time kept as ``first_step_s``): the process warm-up builds their eager
form instead (the nano model's graphs would not serve the bench's model), and every timed step
comes after the build step, the ``warmup - 1`` untimed rounds and the untimed first step of its
turn, with the shapes of the regime fixed, so no compilation falls in a timed step.
"""

from __future__ import annotations

import statistics
import time

from zerodp.bench import probe
from zerodp.bench.contenders import eager_form, is_compiled
from zerodp.bench.schedule import schedule, stage_groups, steps_per_contender
from zerodp.bench.spec import BenchSpec, Device, Regime


def rank_bench(rank: int, world: int, spec: BenchSpec, names: list[str],
                bucket_mb: dict[str, dict[str, "float | str"]],
                groups: list[list[str]] | None = None) -> list[tuple[dict, float]]:
    """Every regime in one spawned group (a spawn costs seconds): results and wall time each."""
    import gc

    _set_rank_device(spec, rank)
    _allow_recompiles(names)
    _warm_up_process(rank, world, spec, names)
    out = []
    for regime in spec.regimes:
        t0 = time.perf_counter()
        res = _run_regime(rank, world, spec, regime, names, bucket_mb.get(regime.name, {}), groups)
        gc.collect()
        out.append((res, time.perf_counter() - t0))
    return out


def _set_rank_device(spec: BenchSpec, rank: int) -> None:
    """On CUDA, rank r runs on cuda:r (zerodp.bench.compare)."""
    if spec.device is Device.CUDA:
        import torch

        torch.cuda.set_device(rank)


def _allow_recompiles(names: list[str]) -> None:
    """Every compiled contender is a fresh model per regime, each compiled once: lift dynamo's
    per-code recompile limit (8) so that none falls back to eager after the eighth."""
    if any(is_compiled(n) for n in names):
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def _warm_up_process(rank: int, world: int, spec: BenchSpec, names: list[str]) -> None:
    """Build every contender once on the nano model, step it, drop it: the process's one-time
    costs (imports, first optimizer construction, gloo's first collectives, kernels) are paid
    before any peak is read (zerodp.bench.compare, "peak memory per rank")."""
    import gc

    from zerodp.bench.peers import build

    make = make_model_factory("nano", spec.seed, spec.device)
    regime = Regime("warm-up", 1, 8)
    x, y = make_batches(regime, 256, 1, rank, world, spec.seed, spec.device)[0]
    for name in dict.fromkeys(eager_form(n) for n in names):  # compiled ones compile in their build step
        c = build(name, make, world, 25.0, None, regime.tokens, spec.shard_size, spec.optimizer)
        c.step(x, y)
        del c
        gc.collect()


def _run_regime(rank: int, world: int, spec: BenchSpec, regime: Regime, names: list[str],
                bucket_mb: dict[str, "float | str"], groups: list[list[str]] | None = None) -> dict:
    """Per stage group: build its contenders (memory measured), time them alternated, free them
    (zerodp.bench.compare). The floor runs in every group; its times are pooled."""
    import gc

    from zerodp.train.model import PRESETS

    cfg = PRESETS[spec.model]
    if regime.seq_len > cfg.seq_len:
        raise ValueError(f"regime {regime.name}: seq_len {regime.seq_len} > the model's {cfg.seq_len}")
    make = make_model_factory(spec.model, spec.seed, spec.device)
    rounds = spec.rounds_for(regime)
    total = steps_per_contender(spec.warmup, rounds, spec.turn)
    batches = make_batches(regime, cfg.vocab_size, total, rank, world, spec.seed, spec.device)
    prime(make, batches[0])
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

    contenders, peak, first_loss, states, first_s = {}, {}, {}, {}, {}
    opt_states, last_loss = {}, {}
    for name in names:  # one at a time: its RSS peak while built and stepped once
        dist.barrier()
        with (_CudaPeak() if spec.device is Device.CUDA else probe.PeakMemory()) as mem:
            c = build(name, make, world, bucket_mb.get(name, spec.bucket_mb), spec.profile, regime.tokens,
                      spec.shard_size, spec.optimizer)
            t0 = time.perf_counter()  # the first step, untimed: a compiled contender compiles in it
            first_loss[name] = float(c.step(*batches[0]))
            settle(c)
            _device_sync(spec.device)
            first_s[name] = time.perf_counter() - t0
        contenders[name], peak[name] = c, mem.bytes
    times = {n: [] for n in names}
    sent = {n: [] for n in names}
    wire = {n: [] for n in names}
    compiles = {n: 0 for n in names}  # graphs dynamo compiled during this contender's timed steps
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
            opt_states[name] = None if c.optimizer_state_bytes is None else c.optimizer_state_bytes()
            hook_s[0] = time.perf_counter() - h0
        dist.barrier()
        _device_sync(spec.device)
        w0 = probe.bytes_written() if spec.device is Device.CPU else None
        g0 = compiled_graphs()
        t0 = time.perf_counter()
        loss = c.step(*batches[k], on_backward=count_states if k == 1 else None)
        settle(c)
        _device_sync(spec.device)
        t1 = time.perf_counter()
        w1 = probe.bytes_written() if spec.device is Device.CPU else None
        if timed:
            compiles[name] += compiled_graphs() - g0
            times[name].append(t1 - t0 - hook_s[0])
            sent[name].append(None if w0 is None else w1 - w0)
            if c.engine is not None:
                wire[name].append(trace_sent_bytes(c.engine))
        last_loss[name] = loss  # every contender runs the same batches in the same number of steps
        if bar is not None:
            bar.update()
    out = {}
    for name in names:
        c = contenders[name]
        s = [v for v in sent[name] if v is not None]
        out[name] = {"times": times[name], "peak": peak[name], "states": states[name],
                     "sent": statistics.median(s) if s else None, "options": c.options,
                     "own_comm": _own_comm(c) if rank == 0 else {}, "first_loss": first_loss[name],
                     "wire": median_legs(wire[name]), "first_step_s": first_s[name],
                     "timed_compiles": compiles[name], "optimizer_states": opt_states.get(name),
                     "last_loss": float(last_loss[name]) if name in last_loss else float("nan")}
    contenders.clear()
    dist.barrier()
    return out


def rank_memory(rank: int, world: int, spec: BenchSpec, regime: Regime, name: str,
                 bucket_mb: "float | str") -> int | None:
    """One contender alone in a fresh group: warm up, then its peak growth while built and stepped
    ``memory_steps`` times (zerodp.bench.compare, "peak memory per rank")."""
    from zerodp.bench.peers import build
    from zerodp.train.model import PRESETS

    _set_rank_device(spec, rank)
    _allow_recompiles([name])
    if not probe.set_malloc(spec.malloc):
        raise RuntimeError(f"malloc={spec.malloc!r}: glibc's mallopt is not available on this machine")
    _warm_up_process(rank, world, spec, [name])
    make = make_model_factory(spec.model, spec.seed, spec.device)
    batches = make_batches(regime, PRESETS[spec.model].vocab_size, spec.memory_steps, rank, world, spec.seed,
                       spec.device)
    with (_CudaPeak() if spec.device is Device.CUDA else probe.PeakMemory()) as mem:
        c = build(name, make, world, bucket_mb, spec.profile, regime.tokens, spec.shard_size, spec.optimizer)
        for x, y in batches:
            c.step(x, y)
            settle(c)
    return mem.bytes


# ---- the pieces: models, batches, clocks, counters ----------------------------------------------

def _rank_device(device: Device):
    """This rank's device: the CPU, or the current CUDA device (``_rank_bench`` sets it)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device is Device.CUDA else torch.device("cpu")


def make_model_factory(model: str, seed: int, device: Device = Device.CPU):
    def make():
        import torch

        from zerodp.train.model import GPT, PRESETS

        torch.manual_seed(seed)
        m = GPT(PRESETS[model])
        return m if device is Device.CPU else m.to(_rank_device(device))
    return make


def make_batches(regime: Regime, vocab: int, count: int, rank: int, world: int, seed: int,
                 device: Device = Device.CPU):
    import torch

    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i * world + rank)
        tok = torch.randint(0, vocab, (regime.micro_batch, regime.seq_len + 1), generator=g)
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        if device is not Device.CPU:
            x, y = x.to(_rank_device(device)), y.to(_rank_device(device))
        out.append((x, y))
    return out


def _device_sync(device: Device) -> None:
    """On CUDA the host only enqueues: wait for the device before reading a clock."""
    if device is Device.CUDA:
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


def settle(c) -> None:
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


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (0 before anything imported it): read
    around each timed step, so that a compilation in a timed step shows (``timed_compiles``)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def median_legs(per_step: list[dict[str, float]]) -> dict[str, float] | None:
    """Per leg, the median over steps (None when nothing was recorded)."""
    if not per_step:
        return None
    return {k: statistics.median(d.get(k, 0.0) for d in per_step) for k in per_step[0]}


def prime(make, batch) -> None:
    """One untimed step of a throwaway model: lazy library set-up is nobody's peak memory."""
    import torch

    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    model(*batch).backward()
    opt.step()
    del model, opt
