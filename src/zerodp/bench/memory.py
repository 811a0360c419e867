"""Measured model-state bytes per rank against the planner's formulas (guide §8, §9), per kind,
for every stage: ``python -m zerodp.bench.memory [--world 2] [--preset tiny] [--device cpu|cuda]``.

On CUDA (``--device cuda``: NCCL, rank r on ``cuda:r``) the caching allocator is asked too: per
stage, ``torch.cuda.memory_allocated`` at rest after the step (everything the engine holds, which
should equal the engine's own count of all kinds plus the batch) and ``torch.cuda.max_memory_allocated``
over the step (model states + activations + buffers in flight), both as growth over what was
allocated before the model was built."""

from __future__ import annotations

import argparse
import gc
from dataclasses import fields

import torch

from zerodp.bench.spec import Device
from zerodp.engine.config import STAGES
from zerodp.engine.stats import MEMORY_KINDS, EngineStats, compare_table, fmt_bytes, formula_by_kind


def _memory_demo(rank: int, world: int, preset: str, device: Device = Device.CPU) -> list[tuple]:
    """Per (fp32 accumulation, stage): (fp32_accum, stats dict, formula by kind, allocator dict —
    empty on CPU)."""
    import zerodp
    from zerodp.engine.config import MixedPrecision
    from zerodp.train.model import GPT, PRESETS

    cuda = device is Device.CUDA
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    out = []
    for fp32_accum in (False, True):
        for stage in STAGES:
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated(dev)
            torch.manual_seed(0)
            model = GPT(PRESETS[preset]).to(dev)
            engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage,
                                        mixed_precision=MixedPrecision(fp32_grad_accum=fp32_accum))
            cfg = model.cfg
            x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device=dev)
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            engine(x, x).backward()
            engine.step()
            engine.zero_grad()
            alloc = {}
            if cuda:
                torch.cuda.synchronize(dev)
                alloc = {"at_rest": torch.cuda.memory_allocated(dev) - base,
                         "peak": torch.cuda.max_memory_allocated(dev) - base,
                         "batch": x.numel() * x.element_size()}
            s = engine.stats()
            out.append((fp32_accum, s.to_dict(), formula_by_kind(stage, s.num_params, world, fp32_accum), alloc))
            del engine, model, x
    return out


def allocator_line(stats: EngineStats, alloc: dict) -> str:
    """One line: the allocator's bytes at rest and at peak next to the engine's count of all kinds."""
    counted = sum(stats.memory.get(k, 0) for k in MEMORY_KINDS)
    rest = alloc["at_rest"]
    return (f"  torch.cuda: at rest {fmt_bytes(rest)} (engine counts {fmt_bytes(counted)} in all kinds + "
            f"batch {fmt_bytes(alloc['batch'])}; diff {rest - counted - alloc['batch']:+,} B), "
            f"peak over the step {fmt_bytes(alloc['peak'])}")


def run(world: int, preset: str, device: Device = Device.CPU, timeout: float = 300.0) -> list[tuple]:
    """Rank 0's results of :func:`_memory_demo` on ``world`` local ranks (NCCL on CUDA)."""
    from zerodp.spawn import run_local

    device = Device.parse(device, "device", optional=False)
    if device is Device.CUDA and torch.cuda.device_count() < world:
        raise ValueError(f"--device cuda --world {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    backend = "nccl" if device is Device.CUDA else "gloo"
    return run_local(_memory_demo, world, preset, device, backend=backend, timeout=timeout)[0]


def as_stats(stats: dict) -> EngineStats:
    names = {f.name for f in fields(EngineStats)}
    return EngineStats(**{k: v for k, v in stats.items() if k in names})


def main(argv: list[str] | None = None) -> None:
    """Print the guide's model-state formula vs the measured bytes, per kind, for stages 0-3."""
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.memory", description=main.__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", choices=[d.value for d in Device])
    args = ap.parse_args(argv)
    try:
        results = run(args.world, args.preset, args.device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    for i, (fp32_accum, stats, formula, alloc) in enumerate(results):
        if i % len(STAGES) == 0:
            print(f"== bf16 + AdamW (k = 12){' + fp32 grad accumulation' if fp32_accum else ''}, "
                  f"rank 0 of {args.world} ==")
        s = as_stats(stats)
        print(compare_table(s, formula))
        if alloc:
            print(allocator_line(s, alloc))


if __name__ == "__main__":
    main()
