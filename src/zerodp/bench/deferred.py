"""A model larger than one rank, built on the meta device: peak RSS per rank against the planner's
model states (guide §9.3): ``python -m zerodp.bench.deferred [--layers 24 --d-model 1024 --nproc 4
--steps 2 --mixed-precision bf16 --compare-cpu --malloc mmap|default]``.

Guide §9.3: at stage 3 each rank keeps 1/N of the parameters, gradients and optimizer states,
16Ψ/N bytes in bf16 with AdamW (2 + 2 + 12, :func:`zerodp.plan.memory.model_states`), plus the
units gathered for the layer in use and the one prefetched. That only helps if no rank ever holds
the whole model, so the model is built under ``with torch.device("meta"):`` and
:func:`zerodp.parallelize` materializes it unit by unit (:mod:`zerodp.engine.deferred`). Built on
the CPU first (``--compare-cpu``), every rank holds the whole fp32 model, 4Ψ bytes, before it is
sharded.

Each of N spawned gloo ranks reads its resident set from ``/proc/self/status``:

import
    ``VmRSS`` on entry: after ``import torch``, ``init_process_group`` (gloo) and ``import
    zerodp`` (printed for reference).
baseline
    ``VmRSS`` after a warm-up: one stage-3 bf16 AdamW step, through the engine, of a 1-layer GPT
    of the measured model's width, then everything freed. It holds what every process running the
    engine holds whatever the model's depth: torch's and gloo's code pages, the oneDNN kernels of
    these shapes, Python's and the allocator's arenas. It holds no tensor of the measured model.
construction peak
    ``VmHWM`` over building the GPT (meta or CPU) and ``parallelize(stage=3,
    units=list(model.blocks), mixed_precision="bf16")``. The high-water mark is reset before it by
    writing ``5`` to ``/proc/self/clear_refs`` (resets ``VmHWM`` and ``ru_maxrss`` alike); where
    that file cannot be written the table says so and the step peak is the peak since the start.
first step peak
    ``VmHWM`` over the first step (forward, backward, ``engine.step()``, ``zero_grad()``) on one
    sequence of the model's ``seq_len`` tokens, the mark reset before it. Adam's moments are
    created by that step's ``optimizer.step()``, after its backward.
step peak
    ``VmHWM`` over all ``--steps`` steps: from the second step on, the backward runs with Adam's
    moments already there, beside the gathered units, their gradients and the activations.
rest
    ``VmRSS`` after the last step.

Allocator: by default (``--malloc mmap``) each rank fixes glibc's ``M_MMAP_THRESHOLD`` at 128 KiB
with ``mallopt``, so that every buffer of 128 KiB or more is its own mapping, handed back when it
is freed, and ``VmRSS`` follows the live tensors. ``--malloc default`` keeps glibc's dynamic
threshold: once a buffer of up to 32 MiB is freed, later ones of that size come from the heap,
whose holes stay resident, and the resident set grows over the first steps by far more than the
model states (measured in docs/interop.md, "Models larger than one rank").

The bound per rank, above the baseline, in bytes (Ψ parameters, Ψ_u the largest unit's, N ranks):

- model states 16Ψ/N, the planner's ``model_state_bytes`` for stage 3, and two gathered units in
  bf16, 2·2Ψ_u, its ``gathered_unit_bytes`` — together the *issue bound* (issue #15);
- the bf16 gradients of the unit whose backward is running and of the units in flight to their
  ReduceScatter, at most ``MAX_REDUCE_IN_FLIGHT`` = 2 of them, each with the receive buffer of
  its all-to-all (on CPU the engine reduces a unit's gradients as an all-to-all of the slices,
  guide §12.5, so gloo's ReduceScatter and its two input-sized copies are not used):
  (2·2 + 1)·2Ψ_u;
- the activations of one sequence, :func:`zerodp.plan.memory.activations` (no recomputation);
- the fp32 gradients handed to the optimizer: the engine keeps the gradient shard in bf16
  (counted in 16Ψ/N) and casts it to fp32 for ``optimizer.step()`` in batches of at most
  ``STEP_BATCH_BYTES`` (one optimizer target more at most), never 4Ψ/N at once.

PASS when the construction peak and the step peak both stay below baseline + bound. The issue's
verdict is on what the issue bounds: the construction peak and the first step peak below
baseline + 16Ψ/N + 2·2Ψ_u. The terms never all coexist (the optimizer step has no gathered unit,
the backward no fp32 gradient), so the bound is an upper bound, not a prediction. The construct bound
is printed beside the construction peak: construction allocates 8Ψ/N (bf16 shard, fp32 master, bf16
gradient shard — the last left unwritten until the first backward, so not yet resident; Adam's
moments are created at the first step) plus one unit materialized, its fp32 parameters and the fp32
flat copy that is broadcast, 8Ψ_u.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

from zerodp.bench.probe import MALLOC_MODES, Malloc, set_malloc

MiB = 1 << 20
CLEAR_REFS = "/proc/self/clear_refs"
DEFAULT_LAYERS = 24
DEFAULT_D_MODEL = 1024
DEFAULT_SEQ_LEN = 64


def read_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes (Linux ``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def reset_peak() -> bool:
    """Reset ``VmHWM`` (and ``ru_maxrss``) to the current ``VmRSS``; False where not allowed."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    s = read_status()
    return s["VmHWM"] <= s["VmRSS"] + MiB


def gpt_config(layers: int, d_model: int, seq_len: int = DEFAULT_SEQ_LEN, heads: int | None = None):
    """The benchmark's GPT: the presets' byte-level vocabulary, ``heads`` = d_model / 64 by default."""
    from zerodp.train.model import GPTConfig

    heads = heads or max(1, d_model // 64)
    return GPTConfig(seq_len=seq_len, n_layer=layers, n_head=heads, d_model=d_model)


def sizes(cfg) -> tuple[int, int]:
    """(Ψ, Ψ_u): the model's parameters and the largest unit's (one block, or the root unit of
    embeddings, final norm and head), counted on the meta device."""
    import torch

    from zerodp.train.model import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return model.num_params(), max(block, root)


def _adamw(groups):
    import torch

    return torch.optim.AdamW(groups, lr=1e-4)


def _warm_up(cfg_dict: dict, mixed_precision: str) -> None:
    """One stage-3 step, through the engine, of a 1-layer GPT of the measured model's width,
    then everything freed: code pages, oneDNN kernels of these shapes, allocator arenas."""
    import torch

    import zerodp
    from zerodp.train.model import GPT, GPTConfig

    cfg = GPTConfig(**dict(cfg_dict, n_layer=1))
    with torch.device("meta"):
        model = GPT(cfg)
    eng = zerodp.parallelize(model, _adamw, stage=3, units=list(model.blocks), mixed_precision=mixed_precision)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    eng(x, x).backward()
    eng.step()
    eng.zero_grad()
    del eng, model, x
    gc.collect()


def _measure(rank: int, world: int, cfg_dict: dict, steps: int, mixed_precision: str, build: str,
             malloc: Malloc = Malloc.MMAP) -> dict:
    """One rank: baseline, construction peak, step peak and rest, in bytes (module docstring)."""
    import torch

    import zerodp
    from zerodp.train.model import GPT, GPTConfig

    malloc_set = set_malloc(malloc)
    imported = read_status()["VmRSS"]
    _warm_up(cfg_dict, mixed_precision)
    base = read_status()["VmRSS"]
    separate = reset_peak()

    cfg = GPTConfig(**cfg_dict)
    torch.manual_seed(0)
    if build == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    eng = zerodp.parallelize(model, _adamw, stage=3, units=list(model.blocks), mixed_precision=mixed_precision)
    gc.collect()
    s = read_status()
    construct_peak, construct_rest = s["VmHWM"], s["VmRSS"]

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
    y = torch.roll(x, -1, dims=1)
    separate = reset_peak() and separate
    losses, step_peaks = [], []
    for _ in range(steps):
        loss = eng(x, y)
        loss.backward()
        eng.step()
        eng.zero_grad()
        losses.append(loss.item())
        del loss
        step_peaks.append(read_status()["VmHWM"])
    st = eng.stats()
    rest = read_status()["VmRSS"]
    return {"rank": rank, "import": imported, "baseline": base, "construct_peak": construct_peak,
            "construct_rest": construct_rest, "step_peak": max(step_peaks) if step_peaks else construct_peak,
            "step_peaks": step_peaks, "rest": rest, "malloc_set": malloc_set, "losses": losses,
            "separate_peaks": separate,
            "engine_params": st.num_params, "peak_gathered_units": st.peak_gathered_units,
            "engine_memory": dict(st.memory)}


@dataclasses.dataclass(frozen=True)
class Bound:
    """The terms of the bound per rank, in bytes (module docstring)."""

    params: int
    unit_params: int
    n: int
    model_states: float  # the planner's 16Ψ/N
    gathered: float  # two units in bf16: 2 · 2 · Ψ_u (the planner's gathered_unit_bytes)
    unit_grads: float  # bf16 gradients of the unit in backward, the 2 in flight and their receive buffers: 5 · 2Ψ_u
    activations: float  # the planner's activations of one sequence (Korthikanti et al., no recomputation)
    fp32_grads: float  # the gradients cast to fp32 for the optimizer: one batch of STEP_BATCH_BYTES
    construct_states: float  # what construction keeps: bf16 shard + fp32 master + bf16 gradient shard, 8Ψ/N
    unit_init: float  # one unit materialized: its fp32 parameters + the fp32 flat copy broadcast, 8Ψ_u

    @property
    def construction(self) -> float:
        """The construction bound above the baseline: 8Ψ/N + 8Ψ_u (Adam's moments come at the step)."""
        return self.construct_states + self.unit_init

    @property
    def issue(self) -> float:
        """The issue's bound above the baseline: model states + two gathered units."""
        return self.model_states + self.gathered

    @property
    def documented(self) -> float:
        """This benchmark's bound above the baseline: every term above."""
        return (self.model_states + self.gathered + self.unit_grads + self.activations
                + self.fp32_grads)


def bound_terms(params: int, unit_params: int, n: int, cfg=None, param_bytes: int = 2) -> Bound:
    """The planner's model states for stage 3 with AdamW (k = 12), its activations for one
    sequence of ``cfg`` (0 without it), and the engine's transients (module docstring)."""
    from zerodp.engine.master import CPU_OPTIMIZER_CHUNK, STEP_BATCH_BYTES
    from zerodp.engine.step import MAX_REDUCE_IN_FLIGHT
    from zerodp.plan.memory import activations, model_states

    ms = model_states(params, n, 3, unit_params=unit_params, param_bytes=param_bytes, grad_bytes=param_bytes)
    act = 0.0
    if cfg is not None:
        act = activations(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.seq_len, 1, ffn=cfg.ffn_mult * cfg.d_model,
                          vocab=cfg.vocab_size).total_bytes
    in_flight = MAX_REDUCE_IN_FLIGHT * param_bytes * unit_params
    fp32_batch = min(4.0 * params / n, STEP_BATCH_BYTES + 4 * CPU_OPTIMIZER_CHUNK)
    return Bound(params=params, unit_params=unit_params, n=n, model_states=ms.model_state_bytes,
                 gathered=ms.gathered_unit_bytes, unit_grads=2 * in_flight + param_bytes * unit_params,
                 activations=act, fp32_grads=fp32_batch,
                 construct_states=(2 * param_bytes + 4.0) * params / n,
                 unit_init=8.0 * unit_params)


def peak(r: dict) -> int:
    return max(r["construct_peak"], r["step_peak"])


def first_peak(r: dict) -> int:
    """The peak over construction and the first step: what the issue bounds."""
    return max(r["construct_peak"], (r.get("step_peaks") or [r["step_peak"]])[0])


def verdicts(results: list[dict], bound: Bound, issue: bool = False) -> list[bool]:
    """Per rank: both peaks below baseline + the bound; ``issue``: the construction and first
    step peaks below baseline + the issue's bound."""
    if issue:
        return [first_peak(r) < r["baseline"] + bound.issue for r in results]
    return [peak(r) < r["baseline"] + bound.documented for r in results]


def _mib(b: float) -> str:
    return f"{b / MiB:,.0f}"


def table(results: list[dict], bound: Bound, build: str) -> str:
    """The per-rank table, MiB."""
    head = ["rank", "import MiB", "baseline MiB", "construct peak MiB", "construct bound MiB", "first step peak MiB",
            "step peak MiB", "rest MiB", "bound MiB", "headroom MiB", "result", "issue bound MiB", "issue result"]
    rows = []
    for r, ok, ok_issue in zip(results, verdicts(results, bound), verdicts(results, bound, issue=True)):
        limit, limit_issue = r["baseline"] + bound.documented, r["baseline"] + bound.issue
        limit_c = r["baseline"] + bound.construction
        headroom = limit - peak(r)
        first = (r.get("step_peaks") or [r["step_peak"]])[0]
        rows.append([str(r["rank"]), _mib(r["import"]), _mib(r["baseline"]), _mib(r["construct_peak"]), _mib(limit_c),
                     _mib(first), _mib(r["step_peak"]), _mib(r["rest"]), _mib(limit), _mib(headroom),
                     "PASS" if ok else "FAIL", _mib(limit_issue), "PASS" if ok_issue else "FAIL"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = [f"built on {build}:",
             "  " + "  ".join(h.rjust(w) for h, w in zip(head, widths)),
             "  " + "  ".join("-" * w for w in widths)]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    r0 = results[0]
    losses = ", ".join(f"{v:.4f}" for v in r0["losses"])
    lines.append(f"  above baseline (rank 0): construction {_mib(r0['construct_peak'] - r0['baseline'])} MiB, "
                 f"first step {_mib(r0['step_peaks'][0] - r0['baseline'])} MiB, "
                 f"all steps {_mib(r0['step_peak'] - r0['baseline'])} MiB, "
                 f"at rest {_mib(r0['rest'] - r0['baseline'])} MiB"
                 f" (model states {_mib(bound.model_states)} MiB); losses {losses}")
    if not all(r["separate_peaks"] for r in results):
        lines.append(f"  note: {CLEAR_REFS} could not be written: the step peak is the peak since the start")
    if not all(r["malloc_set"] for r in results):
        lines.append("  note: mallopt(M_MMAP_THRESHOLD) failed: glibc's default allocator behaviour")
    return "\n".join(lines)


def header(cfg, bound: Bound, steps: int, mixed_precision: str, malloc: Malloc) -> str:
    alloc = ("glibc malloc, M_MMAP_THRESHOLD fixed at 128 KiB (mallopt): freed buffers leave the resident set"
             if malloc is Malloc.MMAP else
             "glibc malloc as it comes (dynamic mmap threshold): heap holes stay resident")
    return "\n".join([
        f"GPT {cfg.n_layer} layers × d_model {cfg.d_model} ({cfg.n_head} heads), vocab {cfg.vocab_size}, "
        f"seq_len {cfg.seq_len}: Ψ = {bound.params:,} parameters, largest unit Ψ_u = {bound.unit_params:,}",
        f"stage 3 on {bound.n} gloo ranks, {mixed_precision} + AdamW, {steps} steps of 1 × {cfg.seq_len} tokens; "
        f"allocator: {alloc}",
        f"per rank, MiB: model states 16Ψ/N {_mib(bound.model_states)} (zerodp.plan.memory.model_states) "
        f"+ 2 gathered units 2·2Ψ_u {_mib(bound.gathered)} = issue bound {_mib(bound.issue)}; "
        f"+ unit gradients, the one in backward and 2 in flight with their all-to-all receive buffers (2·2+1)·2Ψ_u "
        f"{_mib(bound.unit_grads)} "
        f"+ activations {_mib(bound.activations)} "
        f"(zerodp.plan.memory.activations) + one batch of fp32 gradients at the step {_mib(bound.fp32_grads)} "
        f"= bound {_mib(bound.documented)}",
        f"construction allocates 8Ψ/N {_mib(bound.construct_states)} (bf16 shard, fp32 master, "
        f"bf16 gradient shard unwritten; "
        f"Adam's moments come at the first step) + one unit materialized 8Ψ_u {_mib(bound.unit_init)} "
        f"= construct bound {_mib(bound.construction)}",
        f"for scale: the whole model in fp32, 4Ψ = {_mib(4 * bound.params)} MiB; bounds are above each rank's "
        "baseline; result: both peaks < bound (the construct bound is printed for comparison, no verdict); "
        "issue result: construction and first step peaks < issue bound",
    ])


def run(layers: int = DEFAULT_LAYERS, d_model: int = DEFAULT_D_MODEL, nproc: int = 4, steps: int = 2,
        mixed_precision: str = "bf16", compare_cpu: bool = False, seq_len: int = DEFAULT_SEQ_LEN,
        malloc: Malloc = Malloc.MMAP, timeout: float = 3600.0) -> dict:
    """Measure on ``nproc`` local ranks; returns ``{"config", "bound", "meta": [per rank], "cpu": [...]}``
    (``cpu`` only with ``compare_cpu``) and ``"text"``, the printed report."""
    from zerodp.spawn import run_local

    if mixed_precision != "bf16":
        raise ValueError(f"--mixed-precision must be bf16 (the bound counts 2-byte parameters): {mixed_precision!r}")
    malloc = Malloc.parse(malloc, "--malloc", optional=False)
    if steps < 1 or nproc < 1:
        raise ValueError("--steps and --nproc must be >= 1")
    cfg = gpt_config(layers, d_model, seq_len)
    params, unit = sizes(cfg)
    bound = bound_terms(params, unit, nproc, cfg)
    out = {"config": cfg.to_dict(), "bound": dataclasses.asdict(bound)}
    parts = [header(cfg, bound, steps, mixed_precision, malloc)]
    builds = ["meta", "cpu"] if compare_cpu else ["meta"]
    for build in builds:
        res = run_local(_measure, nproc, cfg.to_dict(), steps, mixed_precision, build, malloc, timeout=timeout)
        out[build] = res
        parts.append(table(res, bound, build))
    out["pass"] = all(verdicts(out["meta"], bound))
    out["pass_issue"] = all(verdicts(out["meta"], bound, issue=True))
    out["text"] = "\n".join(parts)
    return out


def main(argv: list[str] | None = None) -> int:
    """Peak RSS per rank of a meta-built GPT at stage 3 against baseline + 16Ψ/N + two units."""
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.deferred", description=main.__doc__)
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help=f"blocks (default {DEFAULT_LAYERS})")
    ap.add_argument("--d-model", type=int, default=DEFAULT_D_MODEL, help=f"width (default {DEFAULT_D_MODEL})")
    ap.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens (default {DEFAULT_SEQ_LEN})")
    ap.add_argument("--nproc", type=int, default=4, help="local gloo ranks (default 4)")
    ap.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    ap.add_argument("--mixed-precision", default="bf16", choices=["bf16"])
    ap.add_argument("--compare-cpu", action="store_true", help="also build the model on the CPU first")
    ap.add_argument("--malloc", default="mmap", choices=MALLOC_MODES,
                    help="mmap: fix glibc's mmap threshold at 128 KiB so RSS follows live tensors (default); "
                         "default: glibc as it comes")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for all ranks (default 3600)")
    args = ap.parse_args(argv)
    try:
        out = run(args.layers, args.d_model, args.nproc, args.steps, args.mixed_precision, args.compare_cpu,
                  args.seq_len, args.malloc, args.timeout)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(out["text"])
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
