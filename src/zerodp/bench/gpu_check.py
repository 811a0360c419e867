"""``make gpu-check``: the GPU path of zerodp, every phase a check with a stated bound, on CUDA or CPU (guide §12, §13).

``python -m zerodp.bench.gpu_check [--device cuda|cpu] [--world N] [--out PATH]``. On CUDA
(default) with N ≥ 1 GPUs: one rank per GPU, NCCL, world N (``--world`` fewer); without a GPU it
prints one line saying so and exits 0 having run nothing. ``--device cpu``: the same phases on gloo
at world 2 (``--world N``), small (preset ``nano``, a few matrix cases per stage, the quick bench),
so that ``make test`` runs the harness itself and a GPU run is never its first run. Every phase is a
check that fails outside the bound it states, and the report states it:

1. **matrix** — the differential matrix of ``tests/_matrix.py`` (engine against a single-process
   reference, dtype-derived tolerances, guide §12.3): on CUDA the pairwise table with world sizes
   above N brought down to N (resharding cases needing more ranks left out); on CPU one case per
   stage and usage drawn from it (:func:`cpu_cases`);
2. **trace** — a few steps at every stage with the engine's trace (:mod:`zerodp.engine.trace`):
   every closed event on the device clock (CUDA events; on CPU the host clock), ``wait_s`` within
   its collective, the compute spans and the exposed communication within the step's time;
3. **memory** — the memory ledger per stage, each row in a clean state
   (:mod:`zerodp.bench.memory`): the engine's own count against the planner's model states
   (:mod:`zerodp.plan.memory`), and on CUDA ``torch.cuda.memory_allocated`` at rest and
   ``max_memory_allocated`` over a step against both; ``--memory-skew engine:5`` is the test seam
   that must make it fail;
4. **bench** — ``zerodp bench`` (:mod:`zerodp.bench.compare`): stages 0-1 and 2-3 in two groups so that
   one failing peer does not take the other figures with it; every contender timed for its steps
   with finite times, every first loss equal, ours' last loss equal to its peers'. A failure keeps
   every rank's error text.

It prints the torch, CUDA and NCCL versions (on CPU: torch and the backend), writes a report (default
``docs/gpu.md`` on CUDA, ``out/gpu-check-cpu.md`` on CPU: a CPU run never writes ``docs/gpu.md``
unless ``--out`` says so) with the figures, the bounds and what this machine could not check, and
exits 1 if any phase failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/zerodp/bench/ → ../../..)
DEFAULT_OUT = ROOT / "docs" / "gpu.md"
DEFAULT_CPU_OUT = ROOT / "out" / "gpu-check-cpu.md"
COMMAND = "make gpu-check  (python -m zerodp.bench.gpu_check)"
PHASES = ("matrix", "trace", "memory", "bench")
#: seconds per phase: on CUDA together under six minutes with the spawns and CUDA/NCCL start-up;
#: on CPU generous, as the time boxes of a shared two-core machine
LIMITS = {"cuda": {"matrix": 110, "trace": 40, "memory": 50, "bench": 100},
          "cpu": {"matrix": 120, "trace": 60, "memory": 90, "bench": 150}}
PRESETS = {"cuda": "small", "cpu": "nano"}
TRACE_STEPS = 4
TRACE_SLACK_S = 50e-6  # device timestamps resolve to ~0.5 µs; the anchor to a few µs
#: bench: every contender's first loss (same initial model, same batch) equal within this relative
#: difference (fp32 forward; kernels may sum in another order), ours' last loss equal to each peer's
#: at the same stage within LAST_LOSS_RTOL (fp32 AdamW over the same batches: the summation orders of
#: the engines differ, each step's rounding ~1e-7 relative; a wrong gradient moves it by far more)
FIRST_LOSS_RTOL = 1e-4
LAST_LOSS_RTOL = 1e-3
ERROR_CHARS = 6000  # per failure: the whole text of every rank, trimmed to this many characters


def no_gpu_line() -> str:
    return ("gpu-check: no CUDA GPU present (torch.cuda.device_count() = 0), nothing run; on N GPUs it runs "
            "the differential matrix on NCCL at world N, the CUDA-event trace checks, the memory ledger per "
            "stage (torch.cuda.memory_allocated / max_memory_allocated vs the engine and zerodp.plan.memory) "
            "and zerodp bench vs DDP/FSDP2, and writes docs/gpu.md; --device cpu runs the same phases on gloo")


def gpu_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


@dataclass(frozen=True)
class Setup:
    """Where the phases run: ``device`` (cuda: NCCL, rank r on cuda:r; cpu: gloo), ``world`` ranks."""

    device: str
    world: int
    preset: str
    memory_skew: tuple[str, float] | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def limit(self, phase: str) -> float:
        return LIMITS[self.device][phase]


@dataclass
class Phase:
    name: str
    ok: bool = False
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)  # markdown for the report
    error: str | None = None
    skipped: str | None = None  # why the phase was not run (then ok is True: nothing failed)


def _progress(text: str) -> None:
    print(f"[gpu-check] {text}", flush=True)


def error_text(e: BaseException, limit: int = ERROR_CHARS) -> str:
    """The whole text of an error (a RankFailure holds every failing rank's traceback), trimmed in
    the middle to ``limit`` characters so that its start and its cause both remain."""
    text = f"{type(e).__name__}: {e}".rstrip()
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit:,} characters left out ...]\n{text[-half:]}"


def _run_phase(name: str, index: int, total: int, run: Setup, fn) -> Phase:
    _progress(f"phase {index}/{total} {name}: started (time box {run.limit(name):.0f} s)")
    t = time.perf_counter()
    phase = Phase(name)
    try:
        result = fn(run)
        if isinstance(result, str):  # not run here: why
            phase.ok, phase.skipped = True, result
        else:
            phase.ok, phase.lines = result
    except Exception as e:  # noqa: BLE001 - a phase's failure is reported, the others still run
        phase.error = error_text(e)
        phase.lines = ["```", traceback.format_exc(limit=6).rstrip()[-ERROR_CHARS:], "```"]
    phase.seconds = time.perf_counter() - t
    if phase.skipped:
        verdict = f"not run: {phase.skipped}"
    else:
        verdict = "ok" if phase.ok else ("FAILED: " + (phase.error or "outside its bound").splitlines()[0][:200])
    _progress(f"phase {index}/{total} {name}: {verdict} ({phase.seconds:.0f} s)")
    return phase


# ---- phase 1: the differential matrix -----------------------------------------------------
def _matrix_module():
    tests = ROOT / "tests"
    if not (tests / "_matrix.py").is_file():
        raise FileNotFoundError(f"{tests / '_matrix.py'} not found: run from a checkout of the repository")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))  # spawned ranks inherit sys.path, and import it by name
    import _matrix

    return _matrix


def gpu_cases(matrix, n: int) -> list:
    """The pairwise table with world sizes above ``n`` brought down to ``n``; cases needing more
    than ``n`` ranks (resharding to a larger world) left out."""
    out = set()
    for c in matrix.pairwise_cases():
        case = dataclasses.replace(c, world=min(c.world, n))  # its mesh, compression, optimizer kept
        if case.ranks_needed <= n:
            out.add(case)
    return sorted(out, key=str)


def cpu_cases(matrix, n: int, per_stage: int = 1) -> list:
    """A handful of :func:`gpu_cases` for the CPU run: ``per_stage`` cases per stage, each of a
    usage not yet taken (bf16 first: the precision of every real run), at world ``n`` where the
    table has one."""
    pool = gpu_cases(matrix, n)
    order = ["bf16"] + [u for u in matrix.USAGES if u != "bf16"]
    taken, out = set(), []
    for stage in sorted({c.stage for c in pool}):
        mine = sorted((c for c in pool if c.stage == stage),
                      key=lambda c: (c.usage in taken, order.index(c.usage) if c.usage in order else 99,
                                     c.world != n, str(c)))
        for c in mine[:per_stage]:
            out.append(c)
            taken.add(c.usage)
    return out


def phase_matrix(run: Setup) -> tuple[bool, list[str]]:
    from zerodp.spawn import run_local

    matrix = _matrix_module()
    n = min(run.world, max(matrix.WORLDS))  # the matrix's largest world: more ranks would sit idle
    cuda = run.device == "cuda"
    cases = gpu_cases(matrix, n) if cuda else cpu_cases(matrix, n)
    t = time.perf_counter()
    results = run_local(matrix.run_cases, n, cases, run.device, backend=run.backend, timeout=run.limit("matrix"))
    wall = time.perf_counter() - t
    failures = []
    for i, case in enumerate(cases):
        errors = sorted({rank[i][1] for rank in results if rank[i][1]})
        if errors:
            failures.append((str(case), errors[0].strip()[:ERROR_CHARS // 4]))
    by_stage = {s: sum(1 for c in cases if c.stage == s) for s in sorted({c.stage for c in cases})}
    which = (f"the pairwise table with world sizes above {n} brought down to {n}; resharding cases needing more "
             "ranks left out" if cuda else f"one case per stage drawn from the pairwise table at world ≤ {n}, "
             "bf16 first, then a usage per stage not yet taken")
    lines = [f"{len(cases)} cases on {n} {'GPU(s)' if cuda else 'CPU rank(s), gloo'} ({which}), {wall:.0f} s. "
             "Bound: each case's differences within the matrix's dtype-derived tolerances (tests/_matrix.py); "
             "0 failed cases.", "", "| stage | cases | failed |", "|---:|---:|---:|"]
    for s, k in by_stage.items():
        lines.append(f"| {s} | {k} | {sum(1 for f, _ in failures if f.startswith(f'stage={s} '))} |")
    lines.append(f"| all | {len(cases)} | {len(failures)} |")
    if not cuda:
        lines += ["", "Cases:", ""] + [f"- `{c}`" for c in cases]
    if failures:
        env = "ZERODP_MATRIX_DEVICE=cuda " if cuda else ""
        lines += ["", f"Failures (rerun one with `{env}python tests/_matrix.py \"<case>\"`):", ""]
        for case, err in failures:
            lines += [f"- `{case}`:", "", "```", err, "```", ""]
    return not failures, lines


# ---- phase 2: the trace ---------------------------------------------------------------------
def _trace_rank(rank: int, world: int, preset: str, steps: int, device: str = "cuda") -> list[dict]:
    import zerodp
    from zerodp.engine.trace import COMM, COMPUTE
    from zerodp.train.model import GPT, PRESETS

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    clock = "cuda" if cuda else "host"
    out = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(PRESETS[preset]).to(dev)
        engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage)
        cfg = model.cfg
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device=dev)
        host_step = []
        for _ in range(steps):
            sync()
            t = time.perf_counter()
            engine(x, x).backward()
            engine.step()
            engine.zero_grad()
            sync()
            host_step.append(time.perf_counter() - t)
        events = engine.recorder.step_events()  # resolves the device events
        s = engine.stats()
        problems = []
        clocks = {e.args.get("clock") for e in events if e.end is not None}  # open ones resolve later
        if cuda and clocks != {"cuda"}:
            problems.append(f"closed events on clocks {sorted(map(str, clocks))}, expected only cuda")
        if not cuda and (engine.recorder.clock_name != "host" or not clocks <= {None, "host"}):
            problems.append(f"recorder on the {engine.recorder.clock_name} clock, closed events on clocks "
                            f"{sorted(map(str, clocks))}: expected the host clock only")
        for e in events:
            if e.end is not None and e.duration < 0:
                problems.append(f"{e.name}: negative duration {e.duration:.3g} s")
            if e.lane == COMM and e.end is not None and e.args.get("wait_s", 0.0) > e.duration + TRACE_SLACK_S:
                problems.append(f"{e.name} {e.args.get('label')}: wait_s {e.args['wait_s']:.3g} s > its duration "
                                f"{e.duration:.3g} s")
        top = [e for e in events if e.lane == COMPUTE and e.name in ("forward", "backward", "step") and e.end]
        if not top:
            problems.append("no closed forward/backward/step span in the last step")
        busy = sum(e.duration for e in top)
        if top:
            span = max(e.end for e in top) - min(e.start for e in top)
            if span > host_step[-1] + TRACE_SLACK_S:
                problems.append(f"the step's compute spans cover {span * 1e3:.3f} ms on the {clock} clock, more "
                                f"than the synchronized host time of the step {host_step[-1] * 1e3:.3f} ms")
        if s.exposed_comm_s > host_step[-1] + TRACE_SLACK_S:
            problems.append(f"exposed comm {s.exposed_comm_s * 1e3:.3f} ms > step {host_step[-1] * 1e3:.3f} ms")
        out.append({"stage": stage, "events": len(events), "host_step_s": host_step[-1], "busy_s": busy,
                    "compute_s": dict(s.compute_s), "exposed_s": s.exposed_comm_s,
                    "collectives": {k: (c.count, c.bytes, c.seconds, c.wait_s) for k, c in s.collectives.items()},
                    "problems": problems[:5], "table": s.table()})
        del engine, model, x
    return out


def phase_trace(run: "Setup") -> tuple[bool, list[str]]:
    from zerodp.spawn import run_local

    n, cuda = run.world, run.device == "cuda"
    results = run_local(_trace_rank, n, run.preset, TRACE_STEPS, run.device, backend=run.backend,
                        timeout=run.limit("trace"))
    clock = ("the engine's CUDA-event trace (every closed event on the device clock)" if cuda else
             "the engine's host-clock trace (every closed event on the host clock; the CUDA-clock check "
             "applies on CUDA only)")
    lines = [f"GPT `{run.preset}`, fp32, AdamW, 4 sequences per rank, {n} rank(s); figures of the last of "
             f"{TRACE_STEPS} steps on rank 0, from {clock} (`engine.stats()`). Host step: the step between two "
             f"{'`torch.cuda.synchronize()`' if cuda else 'reads of the host clock'}.", "",
             f"Bounds, per rank and stage: every closed event on the {'cuda' if cuda else 'host'} clock, no negative "
             f"duration; a collective's `wait_s` ≤ its duration + {TRACE_SLACK_S * 1e6:.0f} µs; the step's compute "
             f"spans and its exposed communication within the host step + {TRACE_SLACK_S * 1e6:.0f} µs.", "",
             "| stage | events | host step (ms) | forward (ms) | backward (ms) | step (ms) | collectives "
             "(count) | collective time (ms) | exposed comm (ms) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    problems = []
    for r in results[0]:
        cs = r["compute_s"]
        coll = r["collectives"].values()
        lines.append(f"| {r['stage']} | {r['events']} | {r['host_step_s'] * 1e3:.3f} | "
                     f"{cs.get('forward', 0) * 1e3:.3f} | {cs.get('backward', 0) * 1e3:.3f} | "
                     f"{cs.get('step', 0) * 1e3:.3f} | "
                     f"{sum(c[0] for c in coll)} | {sum(c[2] for c in coll) * 1e3:.3f} | {r['exposed_s'] * 1e3:.3f} |")
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            problems += [f"rank {rank} stage {r['stage']}: {p}" for p in r["problems"]]
    if problems:
        lines += ["", "Problems:", ""] + [f"- {p}" for p in problems]
    return not problems, lines


# ---- phase 3: the memory ledger -----------------------------------------------------------
def phase_memory(run: Setup) -> tuple[bool, list[str]]:
    from zerodp.bench.memory import BOUNDS, CUDA_ONLY, MICRO_BATCH, as_stats, evaluate, row_ok
    from zerodp.bench.memory import run as memory_run

    mib = 2 ** 20
    cuda = run.device == "cuda"
    rows = memory_run(run.world, run.preset, run.device, timeout=run.limit("memory"))
    lines = [f"GPT `{run.preset}`, bf16 mixed precision + AdamW (k = 12), {MICRO_BATCH} sequences, rank 0 of "
             f"{run.world}, each row in a clean state (`zerodp.bench.memory`). Planner: "
             "`zerodp.plan.memory.model_states`; engine: the distinct storages it holds (`engine.stats().memory`, "
             "gradients at their step maximum); held at rest: the storages the engine and the module hold after "
             "`zero_grad()`, and the batch" + ("; allocator: `torch.cuda.memory_allocated` at rest and "
                                              "`max_memory_allocated` over the second step, over the baseline."
                                              if cuda else "."), "", "Bounds, per row:", ""]
    lines += [f"- **{name}**: {bound}" + (" (CUDA only: not on CPU, which has no allocator counter)"
                                          if name in CUDA_ONLY and not cuda else "")
              for name, bound in BOUNDS.items()]
    if run.memory_skew:
        lines += ["", f"**Test seam on: the {run.memory_skew[0]} figure inflated by {run.memory_skew[1]:g}% "
                      "(`--memory-skew`); these figures are not a measurement.**"]
    head = ("| fp32 grad acc | stage | planner model states (MiB) | engine model states (MiB) | residual (B) | "
            "held at rest (MiB) | outside the engine (B) |")
    sep = "|---|---:|---:|---:|---:|---:|---:|"
    if cuda:
        head += " allocator at rest − held (B) | allocator peak (MiB) |"
        sep += "---:|---:|"
    lines += ["", head + " result |", sep + "---|"]
    failed = []
    for row in rows:
        s = as_stats(row["stats"])
        checks = evaluate(row, run.world, run.preset, cuda, run.memory_skew)
        by = {c.name: c for c in checks}
        held = row["held"]
        from zerodp.engine.stats import formula_by_kind

        want = formula_by_kind(s.stage, s.num_params, run.world, row["fp32_accum"])["total"]
        resid = by["engine vs planner"].detail.split("residual ")[1].split(" ")[0]
        cells = [("yes" if row["fp32_accum"] else "no"), str(s.stage), f"{want / mib:.3f}",
                 f"{s.model_state_bytes / mib:.3f}", resid, f"{(held['engine'] + held['batch']) / mib:.3f}",
                 f"{held['outside']:,}"]
        if cuda:
            cells += [f"{row['at_rest'] - held['engine'] - held['outside'] - held['batch']:+,}",
                      f"{row['peak'] / mib:.3f}"]
        bad = [c for c in checks if c.ok is False]
        cells.append("ok" if row_ok(checks) else "FAILED: " + ", ".join(c.name for c in bad))
        lines.append("| " + " | ".join(cells) + " |")
        failed += [f"fp32 acc {'yes' if row['fp32_accum'] else 'no'}, stage {s.stage}, {c.name}: {c.detail}"
                   for c in bad]
    lines += ["", "Each check of the first row, as measured:", ""]
    lines += [f"- {c.name}: {'ok' if c.ok else ('FAILED' if c.ok is False else 'not run')} — {c.detail}"
              for c in evaluate(rows[0], run.world, run.preset, cuda, run.memory_skew)]
    if failed:
        lines += ["", "Failed:", ""] + [f"- {f}" for f in failed]
    return not failed, lines


# ---- phase 4: zerodp bench against DDP / FSDP2 ---------------------------------------------
def bench_problems(result) -> list[str]:
    """The bench phase's bounds (module constants): every contender timed for its steps with finite
    positive times; every first loss equal; ours' last loss equal to its peers' at the same stage."""
    problems = []
    spec = result.spec
    for reg in result.regimes:
        cs = reg.contenders
        want = spec.steps_for(reg.regime)
        first = {n: c.first_loss for n, c in cs.items()}
        ref_name = next(iter(first))
        ref = first[ref_name]
        for name, c in cs.items():
            times = c.times_s
            if len(times) < want or not all(math.isfinite(t) and t > 0 for t in times):
                problems.append(f"{reg.regime.name} {name}: {len(times)} timed steps (want ≥ {want}), "
                                f"finite and positive: {all(math.isfinite(t) and t > 0 for t in times)}")
            if not (math.isfinite(c.first_loss) and abs(c.first_loss - ref) <= FIRST_LOSS_RTOL * abs(ref)):
                problems.append(f"{reg.regime.name} {name}: first loss {c.first_loss:.7g} vs {ref_name} {ref:.7g} "
                                f"(bound: relative {FIRST_LOSS_RTOL:g})")
        for stage in spec.stages:
            ours, peers = spec.comparisons[stage]
            if ours not in cs:
                continue
            mine = cs[ours].last_loss
            for peer in peers:
                if peer in cs and not (abs(mine - cs[peer].last_loss) <= LAST_LOSS_RTOL * abs(cs[peer].last_loss)):
                    problems.append(f"{reg.regime.name} stage {stage}: ours' last loss {mine:.7g} vs {peer} "
                                    f"{cs[peer].last_loss:.7g} (bound: relative {LAST_LOSS_RTOL:g})")
    return problems


def phase_bench(run: Setup) -> tuple[bool, list[str]] | str:
    from zerodp.bench.compare import run_bench
    from zerodp.bench.spec import REGIMES, BenchSpec, quick_spec
    from zerodp.bench.tables import contenders_table, summary_table

    cuda = run.device == "cuda"
    try:
        make = ((lambda st: BenchSpec(model=run.preset, world_size=run.world, regimes=tuple(REGIMES.values()),
                                      stages=st, warmup=3, steps=10, device="cuda")) if cuda else
                (lambda st: quick_spec(model=run.preset, world_size=run.world, stages=st, memory="shared")))
        make((0, 1))
    except ValueError as e:  # the bench's own world-size rule (zerodp.bench.spec.BenchSpec)
        return f"zerodp bench cannot run here: {e}"
    ok = True
    cpu_note = (" CPU: the quick bench (`zerodp.bench.spec.quick_spec`), peak memory read in the timing group "
                "(`memory=\"shared\"`).")
    lines = [f"Bounds: every contender timed for at least its steps, times finite and positive; every "
             f"contender's first loss equal within {FIRST_LOSS_RTOL:g} relative (same model, same batch); "
             f"ours' last loss equal to each peer's at the same stage within {LAST_LOSS_RTOL:g} relative. "
             "A failure keeps every rank's error text." + ("" if cuda else cpu_note), ""]
    if run.world == 1:
        lines += ["At world 1 nothing is communicated: the times compare the engines' overheads, not their "
                  "collectives, and the sent bytes are 0.", ""]
    for stages in ((0, 1), (2, 3)):
        spec = make(stages)
        t = time.perf_counter()
        try:
            result = run_bench(spec, timeout=run.limit("bench") / 2)
        except Exception as e:  # noqa: BLE001 - the other group still runs
            ok = False
            lines += [f"Stages {stages}: FAILED — every rank's error:", "", "```", error_text(e), "```", ""]
            continue
        problems = bench_problems(result)
        ok &= not problems
        lines += [f"Stages {stages} ({time.perf_counter() - t:.0f} s): "
                  f"{'ok' if not problems else 'FAILED'}", "", "```", summary_table(result), "",
                  contenders_table(result), "```", ""]
        lines += [f"- {p}" for p in problems] + ([""] if problems else [])
    return ok, lines


# ---- the report -----------------------------------------------------------------------------
def machine_lines(run: Setup) -> list[str]:
    py = f"Python {sys.version.split()[0]}"
    if run.device != "cuda":
        return [f"- CPU: {os.cpu_count()} cores, {run.world} rank(s) on gloo (no GPU used)",
                f"- torch {torch.__version__}, backend gloo, {py}"]
    n = run.world
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - said, not hidden
        nccl = f"unknown ({type(e).__name__})"
    mem = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return [f"- GPUs: {n} × {', '.join(names)} ({mem:.0f} GiB each), {n} rank(s) on NCCL",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {py}"]


def not_checked(run: Setup) -> list[str]:
    """What this run cannot check, and why."""
    out = []
    if run.device != "cuda":
        out += ["the CUDA-event clock of the trace (a CPU run's events are on the host clock)",
                "the allocator's figures of the memory phase (`torch.cuda.memory_allocated` at rest, "
                "`max_memory_allocated`): the CPU has no allocator counter; its rows compare the engine's count with "
                "the planner and with the storages held",
                "NCCL: the ranks use gloo",
                "the whole pairwise table: a handful of its cases, one per stage"]
    if run.world == 1:
        out += ["collectives between ranks: at world 1 every collective is local, and the matrix's resharding "
                "cases (which need more ranks) are left out"]
        if run.device != "cuda":
            out += ["zerodp bench: it needs 2 ranks on CPU (zerodp.bench.spec.BenchSpec)"]
    return out


def write_report(path: Path, run: Setup, phases: list[Phase], total_s: float, machine: list[str],
                 command: str = COMMAND) -> Path:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = "# zerodp on GPU" if run.device == "cuda" else "# zerodp's GPU check, run on CPU"
    lines = [title, "",
             f"Produced by `{command}` on {when}, {total_s:.0f} s in all; "
             "see `src/zerodp/bench/gpu_check.py` for what each phase checks (guide §12-§13).", ""] + machine
    lines += ["", "| phase | result | time (s) |", "|---|---|---:|"]
    for p in phases:
        res = f"not run: {p.skipped}" if p.skipped else ("ok" if p.ok else "FAILED")
        lines.append(f"| {p.name} | {res} | {p.seconds:.0f} |")
    missing = not_checked(run)
    if missing:
        lines += ["", "Not checked by this run:", ""] + [f"- {m}" for m in missing]
    for p in phases:
        lines += ["", f"## {p.name}", ""]
        if p.skipped:
            lines += [f"Not run: {p.skipped}"]
            continue
        if p.error:
            lines += ["Failed:", "", "```", p.error, "```", ""]
        lines += p.lines
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    """Check the GPU path on this machine's CUDA GPUs (or on CPU) and write a report (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.gpu_check", description=main.__doc__)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: one rank per GPU on NCCL; cpu: gloo ranks, small, the harness's own test")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU on cuda, 2 on cpu)")
    ap.add_argument("--out", default=None, help=f"the report (default {DEFAULT_OUT.relative_to(ROOT)} on cuda, "
                                                f"{DEFAULT_CPU_OUT.relative_to(ROOT)} on cpu)")
    ap.add_argument("--preset", default=None, help="GPT preset for the trace, memory and bench phases "
                                                   "(default small on cuda, nano on cpu)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset to run")
    ap.add_argument("--memory-skew", default=None, metavar="SIDE:PCT",
                    help="test seam: inflate the engine's (engine:PCT) or the planner's (formula:PCT) model states "
                         "by PCT percent; the memory phase must then fail")
    args = ap.parse_args(argv)
    wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PHASES]
    if unknown or not wanted:
        print(f"gpu-check: unknown phases {unknown}; choose from {', '.join(PHASES)}", file=sys.stderr)
        return 2
    from zerodp.bench.memory import parse_skew
    from zerodp.train.model import PRESETS as MODEL_PRESETS

    try:
        skew = parse_skew(args.memory_skew)
    except ValueError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    preset = args.preset or PRESETS[args.device]
    if preset not in MODEL_PRESETS:
        print(f"gpu-check: unknown preset {preset!r}; use one of {', '.join(MODEL_PRESETS)}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        n = gpu_count()
        if n == 0:
            print(no_gpu_line())
            return 0
        world = args.world or n
        if not 1 <= world <= n:
            print(f"gpu-check: --world {world} needs 1 to {n} GPUs ({n} visible)", file=sys.stderr)
            return 2
        _progress(f"{n} CUDA GPU(s): {torch.cuda.get_device_name(0)}; world {world} on NCCL")
    else:
        world = args.world or 2
        if world < 1:
            print(f"gpu-check: --world must be >= 1, got {world}", file=sys.stderr)
            return 2
        _progress(f"CPU: world {world} on gloo")
    run = Setup(args.device, world, preset, skew)
    machine = machine_lines(run)
    for line in machine:
        _progress(line[2:])
    for m in not_checked(run):
        _progress(f"not checked here: {m}")
    _progress(f"phases {', '.join(wanted)}" + (f" (not run: {', '.join(p for p in PHASES if p not in wanted)}, "
                                               "not asked for by --phases)" if len(wanted) < len(PHASES) else ""))
    out_path = Path(args.out) if args.out else (DEFAULT_OUT if args.device == "cuda" else DEFAULT_CPU_OUT)
    t = time.perf_counter()
    runs = {"matrix": phase_matrix, "trace": phase_trace, "memory": phase_memory, "bench": phase_bench}
    phases = [_run_phase(name, i + 1, len(wanted), run, runs[name]) for i, name in enumerate(wanted)]
    command = COMMAND if argv is None and args.device == "cuda" else \
        "python -m zerodp.bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    out = write_report(out_path, run, phases, time.perf_counter() - t, machine, command.rstrip())
    _progress(f"wrote {out}; {sum(p.ok and not p.skipped for p in phases)}/{len(phases)} phases ok"
              + "".join(f"; {p.name} not run: {p.skipped}" for p in phases if p.skipped))
    return 0 if all(p.ok for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
