"""Measured model-state bytes per rank against the planner's formulas (guide §8, §9), per kind,
for every stage, each row checked against a stated bound: ``python -m zerodp.bench.memory [--world 2]
[--preset tiny] [--device cpu|cuda]``.

Each row (one stage, with or without fp32 gradient accumulation; bf16 mixed precision + AdamW,
k = 12) is measured in a clean state: a throwaway row first creates what lives once per process
(the collectives' set-up, cuBLAS workspaces), then every row starts after ``gc.collect()``,
``torch.cuda.empty_cache()`` and ``torch.cuda.reset_peak_memory_stats()``, with the previous row's
model and engine verified dead (weak references) and, on CUDA, ``torch.cuda.memory_allocated``
back at the baseline. The row builds the model and the engine, steps twice (the second step is the
one whose peak is read: the optimizer's states exist before it, as in every later step) and reads
the figures at rest after ``zero_grad()``. :func:`evaluate` then checks, per row
(:data:`BOUNDS` says each bound and why):

* **clean** — nothing of the previous row alive; on CUDA the allocator at the baseline (0 B);
* **engine vs planner** — the engine's model states (``engine.stats().memory``, distinct storages)
  against :func:`zerodp.plan.memory.model_states` for the same stage, N and accumulation: the
  difference is the optimizer's scalar states (AdamW's ``step``, one per flat group) plus at most
  20 B per padding element, and nothing else; the one documented gap is applied first
  (fp32 accumulation at stages 2-3 keeps no bf16 gradient shard at rest, :mod:`zerodp.engine.stats`);
* **nothing outside the engine** — every storage the module reaches (parameters, ``.grad``,
  buffers) is one the engine lists, except the module's own buffers and stage 3's placeholders
  (one element per parameter, :mod:`zerodp.engine.module_view`);
* **allocator at rest** (CUDA) — ``torch.cuda.memory_allocated`` after the step equals the storages
  held (the engine's at rest, the module's, the batch) up to the allocator's rounding (512 B per
  block) and a few device scalars;
* **allocator peak** (CUDA) — ``torch.cuda.max_memory_allocated`` over a step at least the
  engine's model states at their step maximum plus the batch, at most the planner's model
  states and activations (:func:`zerodp.plan.memory.activations`) plus the engine's transient
  buffers, with a stated margin.

A CPU run has no allocator counter: it makes the first three checks and says that it cannot make
the last two. ``skew`` (``--skew engine:5``) inflates one side of the engine-vs-planner comparison
by a percentage: a test seam, a wrong figure that must make the check fail.
"""

from __future__ import annotations

import argparse
import gc
import weakref
from dataclasses import dataclass, fields

import torch

from zerodp.bench.spec import Device
from zerodp.engine.config import STAGES
from zerodp.engine.stats import MEMORY_KINDS, EngineStats, compare_table, fmt_bytes, formula_by_kind

MICRO_BATCH = 2  # sequences per rank in every row
#: the allocator rounds every block up to a multiple of this (c10's kMinBlockSize)
ALLOC_ROUND = 512
#: device scalars an engine may keep outside its lists at rest (the skip guard's flags, a norm)
DEVICE_SCALARS = 16
#: bytes per padding element over every kind of a flat buffer: bf16 param 2 + bf16 grad 2 + fp32
#: accumulation 4 + fp32 master 4 + AdamW m and v 8
PAD_BYTES = 20
#: the peak's margin over the planner's stored activations: the transient of one op (its input
#: and output alive together, the fp32 upcast of the logits) is not in the Korthikanti ledger
ACT_MARGIN = 1.0
#: plus a fixed allowance for the workspaces of an op (flash attention's backward, cuBLAS)
WORKSPACE_BYTES = 8 * 2 ** 20

BOUNDS = {
    "clean": "previous row's model and engine collected; CUDA: memory_allocated − baseline = 0 B",
    "engine vs planner": ("0 ≤ engine − (planner − documented gap) ≤ optimizer scalar states + "
                          f"{PAD_BYTES} B × padding elements"),
    "outside the engine": ("storages the module reaches but the engine does not list ≤ the module's buffers + "
                           "one element per parameter (stage 3's placeholders, zerodp.engine.module_view)"),
    "allocator at rest": (f"0 ≤ memory_allocated − held ≤ ({ALLOC_ROUND - 1} B × blocks held) + "
                          f"{DEVICE_SCALARS} × {ALLOC_ROUND} B (device scalars); held = engine at rest + "
                          "module + batch"),
    "allocator peak": ("engine model states (grads at their step maximum) + batch ≤ max_memory_allocated ≤ "
                       f"planner model states + {1 + ACT_MARGIN:g} × planner activations + engine gathered "
                       f"and comm buffers + batch + {WORKSPACE_BYTES >> 20} MiB (op workspaces)"),
}
CUDA_ONLY = ("allocator at rest", "allocator peak")


def _storages(tensors, device_type: str | None = None) -> dict[tuple[str, int], int]:
    """Distinct storages (device, pointer) → bytes, of ``tensors`` (on ``device_type`` if given)."""
    out = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if device_type is not None and t.device.type != device_type:
            continue
        st = t.untyped_storage()
        if st.nbytes():
            out[(str(t.device), st.data_ptr())] = st.nbytes()
    return out


def _engine_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """What the engine holds, by kind (the lists :func:`zerodp.engine.stats.engine_memory` sums)."""
    by_kind = dict(engine.machine.memory_tensors())
    by_kind["master"] = [t.tensor for t in engine.master.targets]
    by_kind["optimizer_states"] = [v for state in engine.master.optimizer.state.values()
                                   for v in state.values() if torch.is_tensor(v)]
    return by_kind


def _held(engine, model, batch: torch.Tensor, device_type: str | None) -> dict:
    """Bytes held at rest: the engine's storages by kind, the module's outside them, the batch."""
    by_kind = _engine_tensors(engine)
    seen: dict = {}
    kinds = {}
    for kind in MEMORY_KINDS:
        st = {k: v for k, v in _storages(by_kind.get(kind, []), device_type).items() if k not in seen}
        seen.update(st)
        kinds[kind] = sum(st.values())
    module = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]
    outside = {k: v for k, v in _storages(module, device_type).items() if k not in seen}
    buffers = sum(_storages(list(model.buffers()), device_type).values())
    placeholders = sum(p.element_size() for p in model.parameters())  # stage 3: one element each
    batch_st = _storages([batch], device_type)
    scalars = sum(v.untyped_storage().nbytes() for v in by_kind["optimizer_states"] if v.dim() == 0)
    return {"kinds": kinds, "engine": sum(kinds.values()), "outside": sum(outside.values()),
            "buffers": buffers, "placeholders": placeholders, "batch": sum(batch_st.values()),
            "blocks": len(seen) + len(outside) + len(batch_st), "scalar_states": scalars}


def _memory_demo(rank: int, world: int, preset: str, device: Device = Device.CPU,
                 rows: tuple = ()) -> list[dict]:
    """Rank side: per (fp32 accumulation, stage) of ``rows`` (default every stage, both), the raw
    figures of one clean row (module docstring)."""
    import zerodp
    from zerodp.engine.config import MixedPrecision
    from zerodp.train.model import GPT, PRESETS

    cuda = device is Device.CUDA
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    rows = rows or tuple((acc, s) for acc in (False, True) for s in STAGES)

    def clean() -> int | None:
        gc.collect()
        if not cuda:
            return None
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)

    def one(acc: bool, stage: int) -> tuple[dict, list]:
        torch.manual_seed(0)
        model = GPT(PRESETS[preset]).to(dev)
        engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage,
                                    mixed_precision=MixedPrecision(fp32_grad_accum=acc))
        x = torch.randint(0, model.cfg.vocab_size, (MICRO_BATCH, model.cfg.seq_len), device=dev)
        fig: dict = {}
        for step in range(2):
            if cuda and step == 1:  # the peak of a steady step: states exist before it
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            engine(x, x).backward()
            engine.step()
            engine.zero_grad()
        if cuda:
            torch.cuda.synchronize(dev)
            fig["at_rest"] = torch.cuda.memory_allocated(dev)
            fig["peak"] = torch.cuda.max_memory_allocated(dev)
        s = engine.stats()
        fig.update(stage=stage, fp32_accum=acc, stats=s.to_dict(),
                   held=_held(engine, model, x, dev.type if cuda else None))
        refs = [weakref.ref(model), weakref.ref(engine), weakref.ref(engine.master.optimizer)]
        return fig, refs

    _, refs = one(False, 0)  # throwaway: what a process creates once (collectives, workspaces) is in the baseline
    base = clean()
    out = []
    for acc, stage in rows:
        now = clean()
        alive = [type(r()).__name__ for r in refs if r() is not None]
        fig, refs = one(acc, stage)
        fig["alive_before"] = alive
        if cuda:
            fig["leftover"] = now - base
            fig["at_rest"] -= base
            fig["peak"] -= base
        out.append(fig)
    return out


def run(world: int, preset: str, device: Device = Device.CPU, timeout: float = 300.0,
        rows: tuple = ()) -> list[dict]:
    """Rank 0's rows of :func:`_memory_demo` on ``world`` local ranks (NCCL on CUDA)."""
    from zerodp.spawn import run_local

    device = Device.parse(device, "device", optional=False)
    if device is Device.CUDA and torch.cuda.device_count() < world:
        raise ValueError(f"--device cuda --world {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    backend = "nccl" if device is Device.CUDA else "gloo"
    return run_local(_memory_demo, world, preset, device, tuple(rows), backend=backend, timeout=timeout)[0]


def as_stats(stats: dict) -> EngineStats:
    names = {f.name for f in fields(EngineStats)}
    return EngineStats(**{k: v for k, v in stats.items() if k in names})


@dataclass
class Check:
    """One comparison of one row: its figure, its bound, whether it holds (None: not made here)."""

    name: str
    ok: bool | None
    detail: str


def parse_skew(text: str | None) -> tuple[str, float] | None:
    """``"engine:5"`` → ("engine", 5.0): the test seam of :func:`evaluate`."""
    if not text:
        return None
    side, _, pct = text.partition(":")
    if side not in ("engine", "formula") or not pct:
        raise ValueError(f"skew must be engine:PCT or formula:PCT, got {text!r}")
    return side, float(pct)


def planner_peak_terms(preset: str, stage: int, world: int, fp32_accum: bool) -> dict[str, float]:
    """The planner's model states and activations for the row's configuration."""
    from zerodp.plan.memory import activations, model_states
    from zerodp.train.model import GPT, PRESETS

    cfg = PRESETS[preset]
    with torch.device("meta"):
        psi = sum(p.numel() for p in GPT(cfg).parameters())
    act = activations(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.seq_len, MICRO_BATCH,
                      ffn=cfg.ffn_mult * cfg.d_model, vocab=cfg.vocab_size, attention="flash")
    ms = model_states(psi, world, stage, fp32_grad_acc=fp32_accum)
    return {"model_states": ms.model_state_bytes, "activations": act.total_bytes}


def evaluate(row: dict, world: int, preset: str, cuda: bool,
             skew: tuple[str, float] | None = None) -> list[Check]:
    """The checks of one row (module docstring, :data:`BOUNDS`)."""
    s = as_stats(row["stats"])
    held = row["held"]
    stage, acc, psi = s.stage, row["fp32_accum"], s.num_params
    formula = formula_by_kind(stage, psi, world, acc)["total"]
    engine = float(s.model_state_bytes)
    if skew:
        factor = 1 + skew[1] / 100
        engine, formula = (engine * factor, formula) if skew[0] == "engine" else (engine, formula * factor)
    gap = 2.0 * psi / world if acc and stage >= 2 else 0.0  # no bf16 gradient shard at rest
    residual = engine - (formula - gap)
    pad = (s.layout or {}).get("padding", 0)
    allow = held["scalar_states"] + PAD_BYTES * pad
    checks = []
    alive = row["alive_before"]
    leftover = row.get("leftover")
    clean_ok = not alive and (leftover is None or leftover == 0)
    checks.append(Check("clean", clean_ok,
                        ("previous row: nothing alive" if not alive else f"alive from the previous row: {alive}")
                        + ("" if leftover is None else f"; allocator {leftover:+,} B over the baseline")))
    checks.append(Check("engine vs planner", 0 <= residual <= allow,
                        f"engine {engine:,.0f} B, planner {formula:,.0f} B"
                        + (f" − gap {gap:,.0f} B" if gap else "") + f": residual {residual:+,.0f} B "
                        f"(bound 0…{allow:,} B: scalar states {held['scalar_states']} B + {pad} padding)"))
    outside = held["outside"]
    allow_out = held["buffers"] + held["placeholders"]
    checks.append(Check("outside the engine", outside <= allow_out,
                        f"{outside:,} B outside the engine's lists (bound {allow_out:,} B: module buffers "
                        f"{held['buffers']:,} B + one element per parameter {held['placeholders']:,} B)"))
    if not cuda:
        checks += [Check(name, None, "not on CPU: no allocator counter") for name in CUDA_ONLY]
        return checks
    held_b = held["engine"] + held["outside"] + held["batch"]
    extra = row["at_rest"] - held_b
    hi = (ALLOC_ROUND - 1) * held["blocks"] + DEVICE_SCALARS * ALLOC_ROUND
    checks.append(Check("allocator at rest", 0 <= extra <= hi,
                        f"allocated {row['at_rest']:,} B, held {held_b:,} B: {extra:+,} B (bound 0…{hi:,} B, "
                        f"{held['blocks']} blocks)"))
    terms = planner_peak_terms(preset, stage, world, acc)
    mem = s.memory
    lo = engine + held["batch"]
    up = (terms["model_states"] + (1 + ACT_MARGIN) * terms["activations"] + mem.get("gathered", 0)
          + mem.get("comm_buffers", 0) + held["batch"] + WORKSPACE_BYTES)
    checks.append(Check("allocator peak", lo <= row["peak"] <= up,
                        f"peak {row['peak']:,} B (bound {lo:,.0f}…{up:,.0f} B: planner states "
                        f"{terms['model_states']:,.0f}, activations {terms['activations']:,.0f})"))
    return checks


def row_ok(checks: list[Check]) -> bool:
    return all(c.ok is not False for c in checks)


def allocator_line(row: dict) -> str:
    """One line: the allocator's bytes at rest and at peak next to what the row holds."""
    held = row["held"]
    return (f"  torch.cuda: at rest {fmt_bytes(row['at_rest'])} (held: engine {fmt_bytes(held['engine'])}, "
            f"module {fmt_bytes(held['outside'])}, batch {fmt_bytes(held['batch'])}), "
            f"peak over a step {fmt_bytes(row['peak'])}")


def main(argv: list[str] | None = None) -> int:
    """Print the guide's model-state formula vs the measured bytes, per kind, for stages 0-3, and
    each row's checks; exit 1 if one fails."""
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.memory", description=main.__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", choices=[d.value for d in Device])
    ap.add_argument("--skew", default=None, help="test seam: engine:PCT or formula:PCT inflates that figure")
    args = ap.parse_args(argv)
    try:
        skew = parse_skew(args.skew)
        results = run(args.world, args.preset, args.device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    cuda = args.device == "cuda"
    ok = True
    for i, row in enumerate(results):
        if i % len(STAGES) == 0:
            print(f"== bf16 + AdamW (k = 12){' + fp32 grad accumulation' if row['fp32_accum'] else ''}, "
                  f"rank 0 of {args.world} ==")
        s = as_stats(row["stats"])
        print(compare_table(s, formula_by_kind(s.stage, s.num_params, args.world, row["fp32_accum"])))
        if cuda:
            print(allocator_line(row))
        checks = evaluate(row, args.world, args.preset, cuda, skew)
        ok &= row_ok(checks)
        for c in checks:
            print(f"  {c.name:<20}{'ok' if c.ok else ('FAILED' if c.ok is False else 'not run')}  {c.detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
