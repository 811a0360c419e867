"""Measured model-state bytes per rank against the planner's formulas (guide §8, §9), per kind,
for every stage: ``python -m zerodp.bench.memory [--world 2] [--preset tiny]``."""

from __future__ import annotations

import argparse
from dataclasses import fields

import torch

from zerodp.engine.config import STAGES
from zerodp.engine.stats import EngineStats, compare_table, formula_by_kind


def _memory_demo(rank: int, world: int, preset: str) -> list[tuple[bool, dict, dict]]:
    import zerodp
    from zerodp.engine.config import MixedPrecision
    from zerodp.train.model import GPT, PRESETS

    out = []
    for fp32_accum in (False, True):
        for stage in STAGES:
            torch.manual_seed(0)
            model = GPT(PRESETS[preset])
            engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage,
                                        mixed_precision=MixedPrecision(fp32_grad_accum=fp32_accum))
            cfg = model.cfg
            x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
            engine(x, x).backward()
            engine.step()
            engine.zero_grad()
            s = engine.stats()
            out.append((fp32_accum, s.to_dict(), formula_by_kind(stage, s.num_params, world, fp32_accum)))
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the guide's model-state formula vs the measured bytes, per kind, for stages 0-3."""
    from zerodp.spawn import run_local

    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.memory", description=main.__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args(argv)
    results = run_local(_memory_demo, args.world, args.preset)
    for i, (fp32_accum, stats, formula) in enumerate(results[0]):
        if i % len(STAGES) == 0:
            print(f"== bf16 + AdamW (k = 12){' + fp32 grad accumulation' if fp32_accum else ''}, "
                  f"rank 0 of {args.world} ==")
        names = {f.name for f in fields(EngineStats)}
        s = EngineStats(**{k: v for k, v in stats.items() if k in names})
        print(compare_table(s, formula))


if __name__ == "__main__":
    main()
