"""``make gpu-check``: the GPU path of zerodp, checked on the GPUs of this machine (guide §12, §13).

``python -m zerodp.bench.gpu_check [--out docs/gpu.md]``. Without CUDA it prints one line saying so
and what it would run, and exits 0 having run nothing. With N ≥ 1 CUDA GPUs (one rank per GPU,
NCCL), each phase time-boxed so that the whole fits in about five minutes:

1. **matrix** — the differential matrix of ``tests/_matrix.py`` (engine against a single-process
   reference, dtype-derived tolerances) on CUDA: the pairwise table with every world size above N
   brought down to N (resharding cases that would need more than N ranks are left out);
2. **trace** — a few steps of the ``small`` GPT at every stage with the engine's trace on CUDA
   events (:mod:`zerodp.engine.trace`): every event resolved on the device clock, ``wait_s`` within
   its collective, the compute spans within the step's device time; ``stats()`` per stage;
3. **memory** — the memory ledger per stage: the planner's formulas (:mod:`zerodp.plan.memory`)
   against the engine's own count and against ``torch.cuda.memory_allocated`` /
   ``max_memory_allocated`` (:mod:`zerodp.bench.memory`);
4. **bench** — ``zerodp bench`` on CUDA: our stages against DDP and FSDP2
   (:mod:`zerodp.bench.compare`), stages 0-1 and 2-3 in two groups so that one failing peer does
   not take the other figures with it.

It writes ``docs/gpu.md`` with the figures (units in every header) and the command that produced
them, and exits 1 if any phase failed or found a mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/zerodp/bench/ → ../../..)
DEFAULT_OUT = ROOT / "docs" / "gpu.md"
COMMAND = "make gpu-check  (python -m zerodp.bench.gpu_check)"
#: seconds per phase: together under six minutes with the spawns and CUDA/NCCL start-up
LIMITS = {"matrix": 110, "trace": 40, "memory": 50, "bench": 100}
TRACE_STEPS = 4
TRACE_SLACK_S = 50e-6  # device timestamps resolve to ~0.5 µs; the anchor to a few µs


def no_gpu_line() -> str:
    return ("gpu-check: no CUDA GPU present (torch.cuda.device_count() = 0), nothing run; on N GPUs it runs "
            "the differential matrix on NCCL at world N, the CUDA-event trace checks, the memory ledger per "
            "stage (torch.cuda.max_memory_allocated vs zerodp.plan.memory) and zerodp bench vs DDP/FSDP2, "
            "and writes docs/gpu.md")


def gpu_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


@dataclass
class Phase:
    name: str
    ok: bool = False
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)  # markdown for docs/gpu.md
    error: str | None = None


def _progress(text: str) -> None:
    print(f"[gpu-check] {text}", flush=True)


def _run_phase(name: str, index: int, total: int, fn, *args) -> Phase:
    _progress(f"phase {index}/{total} {name}: started (time box {LIMITS[name]} s)")
    t = time.perf_counter()
    phase = Phase(name)
    try:
        phase.ok, phase.lines = fn(*args)
    except Exception as e:  # noqa: BLE001 - a phase's failure is reported, the others still run
        phase.error = f"{type(e).__name__}: {e}"
        phase.lines = ["```", traceback.format_exc(limit=6).rstrip()[-4000:], "```"]
    phase.seconds = time.perf_counter() - t
    verdict = "ok" if phase.ok else ("FAILED: " + (phase.error or "mismatch").splitlines()[0][:200])
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


def phase_matrix(n: int) -> tuple[bool, list[str]]:
    from zerodp.spawn import run_local

    matrix = _matrix_module()
    n = min(n, max(matrix.WORLDS))  # the matrix's largest world: more GPUs would sit idle
    cases = gpu_cases(matrix, n)
    t = time.perf_counter()
    results = run_local(matrix.run_cases, n, cases, "cuda", backend="nccl", timeout=LIMITS["matrix"])
    wall = time.perf_counter() - t
    failures = []
    for i, case in enumerate(cases):
        errors = sorted({rank[i][1] for rank in results if rank[i][1]})
        if errors:
            failures.append((str(case), errors[0].splitlines()[0][:300]))
    by_stage = {s: sum(1 for c in cases if c.stage == s) for s in sorted({c.stage for c in cases})}
    lines = [f"{len(cases)} cases of the pairwise table on {n} GPU(s) (world sizes above {n} brought down to "
             f"{n}; resharding cases needing more ranks left out), {wall:.0f} s:", "",
             "| stage | cases | failed |", "|---:|---:|---:|"]
    for s, k in by_stage.items():
        lines.append(f"| {s} | {k} | {sum(1 for f, _ in failures if f.startswith(f'stage={s} '))} |")
    lines.append(f"| all | {len(cases)} | {len(failures)} |")
    if failures:
        lines += ["", "Failures (rerun one with `ZERODP_MATRIX_DEVICE=cuda python tests/_matrix.py \"<case>\"`):", ""]
        lines += [f"- `{case}`: {err}" for case, err in failures]
    return not failures, lines


# ---- phase 2: the trace on CUDA events ----------------------------------------------------
def _trace_rank(rank: int, world: int, preset: str, steps: int) -> list[dict]:
    import zerodp
    from zerodp.engine.trace import COMM, COMPUTE
    from zerodp.train.model import GPT, PRESETS

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    out = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(PRESETS[preset]).to(dev)
        engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage)
        cfg = model.cfg
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device=dev)
        host_step = []
        for _ in range(steps):
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            engine(x, x).backward()
            engine.step()
            engine.zero_grad()
            torch.cuda.synchronize(dev)
            host_step.append(time.perf_counter() - t)
        events = engine.recorder.step_events()  # resolves the device events
        s = engine.stats()
        problems = []
        clocks = {e.args.get("clock") for e in events if e.end is not None}  # open ones resolve later
        if clocks != {"cuda"}:
            problems.append(f"closed events on clocks {sorted(map(str, clocks))}, expected only cuda")
        for e in events:
            if e.end is not None and e.duration < 0:
                problems.append(f"{e.name}: negative duration {e.duration:.3g} s")
            if e.lane == COMM and e.end is not None and e.args.get("wait_s", 0.0) > e.duration + TRACE_SLACK_S:
                problems.append(f"{e.name} {e.args.get('label')}: wait_s {e.args['wait_s']:.3g} s > its duration "
                                f"{e.duration:.3g} s")
        top = [e for e in events if e.lane == COMPUTE and e.name in ("forward", "backward", "step") and e.end]
        busy = sum(e.duration for e in top)
        if top:
            span = max(e.end for e in top) - min(e.start for e in top)
            if span > host_step[-1] + TRACE_SLACK_S:
                problems.append(f"the step's compute spans cover {span * 1e3:.3f} ms on the device, more than the "
                                f"synchronized host time of the step {host_step[-1] * 1e3:.3f} ms")
        if s.exposed_comm_s > host_step[-1] + TRACE_SLACK_S:
            problems.append(f"exposed comm {s.exposed_comm_s * 1e3:.3f} ms > step {host_step[-1] * 1e3:.3f} ms")
        out.append({"stage": stage, "events": len(events), "host_step_s": host_step[-1], "busy_s": busy,
                    "compute_s": dict(s.compute_s), "exposed_s": s.exposed_comm_s,
                    "collectives": {k: (c.count, c.bytes, c.seconds, c.wait_s) for k, c in s.collectives.items()},
                    "problems": problems[:5], "table": s.table()})
        del engine, model, x
    return out


def phase_trace(n: int, preset: str) -> tuple[bool, list[str]]:
    from zerodp.spawn import run_local

    results = run_local(_trace_rank, n, preset, TRACE_STEPS, backend="nccl", timeout=LIMITS["trace"])
    lines = [f"GPT `{preset}`, fp32, AdamW, 4 sequences per rank, {n} rank(s); figures of the last of "
             f"{TRACE_STEPS} steps on rank 0, from the engine's CUDA-event trace (`engine.stats()`). "
             "Host step: the step between two `torch.cuda.synchronize()`.", "",
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
def phase_memory(n: int, preset: str) -> tuple[bool, list[str]]:
    from zerodp.bench.memory import as_stats, run
    from zerodp.engine.stats import MEMORY_KINDS

    mib = 2 ** 20
    results = run(n, preset, "cuda", timeout=LIMITS["memory"])
    lines = [f"GPT `{preset}`, bf16 mixed precision + AdamW (k = 12), 2 sequences, rank 0 of {n}. Formula: the "
             "planner's model states (`zerodp.plan.memory.model_states`); engine: the distinct storages it holds "
             "(`engine.stats().memory`); allocator: `torch.cuda.memory_allocated` after the step (at rest) and "
             "`torch.cuda.max_memory_allocated` over it (peak), as growth over what was allocated before the model.",
             "", "| fp32 grad acc | stage | formula model states (MiB) | engine model states (MiB) | diff | engine all "
             "kinds (MiB) | allocator at rest (MiB) | at rest − engine − batch (KiB) | allocator peak (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fp32_accum, stats, formula, alloc in results:
        s = as_stats(stats)
        want, got = formula["total"], s.model_state_bytes
        counted = sum(s.memory.get(k, 0) for k in MEMORY_KINDS)
        extra = alloc["at_rest"] - counted - alloc["batch"]
        lines.append(f"| {'yes' if fp32_accum else 'no'} | {s.stage} | {want / mib:.3f} | {got / mib:.3f} | "
                     f"{(got - want) / max(want, 1) * 100:+.2f}% | {counted / mib:.3f} | "
                     f"{alloc['at_rest'] / mib:.3f} | {extra / 1024:+.1f} | {alloc['peak'] / mib:.3f} |")
    lines += ["", "(Where the engine holds less than the formula, `zerodp.engine.stats` says why — e.g. no bf16 "
              "gradient shard at rest under fp32 accumulation. The engine's count of all kinds includes "
              "`comm_buffers`, which may count transient buffers at their peak in the step. The allocator rounds "
              "blocks up to 512 B; NCCL's own buffers are not in its count.)"]
    return True, lines


# ---- phase 4: zerodp bench against DDP / FSDP2 ---------------------------------------------
def phase_bench(n: int, preset: str) -> tuple[bool, list[str]]:
    from zerodp.bench.compare import run_bench
    from zerodp.bench.spec import REGIMES, BenchSpec
    from zerodp.bench.tables import contenders_table, summary_table

    ok, lines = True, []
    for stages in ((0, 1), (2, 3)):
        spec = BenchSpec(model=preset, world_size=n, regimes=tuple(REGIMES.values()), stages=stages,
                         warmup=3, steps=10, device="cuda")
        t = time.perf_counter()
        try:
            result = run_bench(spec, timeout=LIMITS["bench"] / 2)
        except Exception as e:  # noqa: BLE001 - the other group still runs
            ok = False
            lines += [f"Stages {stages}: FAILED — `{type(e).__name__}: {str(e).splitlines()[0][:300]}`", ""]
            continue
        lines += [f"Stages {stages} ({time.perf_counter() - t:.0f} s):", "", "```", summary_table(result), "",
                  contenders_table(result), "```", ""]
    return ok, lines


# ---- the report -----------------------------------------------------------------------------
def machine_lines(n: int) -> list[str]:
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    mem = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return [f"- GPUs: {n} × {', '.join(names)} ({mem:.0f} GiB each)",
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, Python {sys.version.split()[0]}"]


def write_report(path: Path, n: int, phases: list[Phase], total_s: float, machine: list[str]) -> Path:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# zerodp on GPU", "",
             f"Produced by `{COMMAND}` on {when}, {total_s:.0f} s in all; "
             "see `src/zerodp/bench/gpu_check.py` for what each phase checks (guide §12-§13).", ""] + machine
    lines += ["", "| phase | result | time (s) |", "|---|---|---:|"]
    lines += [f"| {p.name} | {'ok' if p.ok else 'FAILED'} | {p.seconds:.0f} |" for p in phases]
    for p in phases:
        lines += ["", f"## {p.name}", ""]
        if p.error:
            lines += [f"Failed: `{p.error.splitlines()[0][:300]}`", ""]
        lines += p.lines
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    """Check the GPU path on this machine's CUDA GPUs and write docs/gpu.md (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.gpu_check", description=main.__doc__)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the report (default docs/gpu.md)")
    ap.add_argument("--preset", default="small", help="GPT preset for the trace, memory and bench phases")
    ap.add_argument("--phases", default="matrix,trace,memory,bench", help="comma-separated subset to run")
    args = ap.parse_args(argv)
    wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in LIMITS]
    if unknown or not wanted:
        print(f"gpu-check: unknown phases {unknown}; choose from {', '.join(LIMITS)}", file=sys.stderr)
        return 2
    n = gpu_count()
    if n == 0:
        print(no_gpu_line())
        return 0
    from zerodp.train.model import PRESETS

    if args.preset not in PRESETS:
        print(f"gpu-check: unknown preset {args.preset!r}; use one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    _progress(f"{n} CUDA GPU(s): {torch.cuda.get_device_name(0)}; phases {', '.join(wanted)}")
    t = time.perf_counter()
    runs = {"matrix": (phase_matrix, n), "trace": (phase_trace, n, args.preset),
            "memory": (phase_memory, n, args.preset), "bench": (phase_bench, n, args.preset)}
    phases = [_run_phase(name, i + 1, len(wanted), *runs[name]) for i, name in enumerate(wanted)]
    out = write_report(Path(args.out), n, phases, time.perf_counter() - t, machine_lines(n))
    _progress(f"wrote {out}; {sum(p.ok for p in phases)}/{len(phases)} phases ok")
    return 0 if all(p.ok for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
