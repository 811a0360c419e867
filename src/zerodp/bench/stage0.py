"""Stage 0 vs PyTorch DDP, side by side: median step time, alternated, in one run.

    python -m zerodp.bench.stage0                 # ~11M-param GPT, 2 ranks, two regimes
    python -m zerodp.bench.stage0 --regimes 32 --rounds 40

Seed §7: with many tokens per rank the backward is long and the gradient AllReduce hides under
it, so every implementation lands near the *floor* (the same per-rank work with no
communication at all); with few tokens per rank the step is short and the implementation's own
overheads decide. Variants, each a full training step (forward, backward, AdamW, zero_grad):

- ``floor``      the model and AdamW alone, no communication;
- ``ddp``        ``torch.nn.parallel.DistributedDataParallel`` with its defaults;
- ``ddp_gbv``    DDP with ``gradient_as_bucket_view=True`` (its fastest setting here);
- ``zerodp``     ``zerodp.parallelize(model, stage=0)`` with its defaults (bucketed, 25 MB).

Runs alternate (one step of each variant per round, the order rotating every round) so that
load changes on a shared machine hit every variant alike; medians are reported. Reading: the
``/floor`` column is the overhead of data parallelism, ``/ddp_gbv`` our time over DDP's best.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

VARIANTS = ("floor", "ddp", "ddp_gbv", "zerodp")
DEFAULT_REGIMES = (2048, 32)  # tokens per rank: many (compute-bound) and few (overhead-bound)


@dataclass
class Result:
    tokens_per_rank: int
    median_s: dict[str, float]
    samples: dict[str, list[float]]

    def ratio(self, a: str, b: str) -> float:
        return self.median_s[a] / self.median_s[b]


def _build(variant: str, preset: str, lr: float = 3e-4) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step of ``variant`` as a closure over its model and optimizer."""
    import zerodp
    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    if variant == "zerodp":
        engine = zerodp.parallelize(model, lambda groups: torch.optim.AdamW(groups, lr=lr), stage=0)

        def step(x, y):
            engine(x, y).backward()
            engine.step()
            engine.zero_grad()
        return step
    if variant in ("ddp", "ddp_gbv"):
        model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=variant == "ddp_gbv")
    elif variant != "floor":
        raise ValueError(f"unknown variant {variant!r}; use {VARIANTS}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x, y):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return step


def _bench_rank(rank: int, world: int, preset: str, tokens: int, rounds: int, warmup: int,
               variants: tuple[str, ...]) -> dict[str, list[float]]:
    from zerodp.train.model import PRESETS

    cfg = PRESETS[preset]
    seq = min(tokens, cfg.seq_len)
    if tokens % seq:
        raise ValueError(f"tokens per rank ({tokens}) must be a multiple of the sequence length used ({seq})")
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (tokens // seq, seq + 1), generator=g)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    steps = {v: _build(v, preset) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(warmup + rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            torch.distributed.barrier()  # every variant starts from the same line on all ranks
            t = time.perf_counter()
            steps[v](inputs, targets)
            if r >= warmup:
                times[v].append(time.perf_counter() - t)
    return times


def run(preset: str = "small", world: int = 2, tokens_per_rank: int = 2048, rounds: int = 5,
        warmup: int = 1, variants: tuple[str, ...] = VARIANTS, timeout: float = 900.0) -> Result:
    """Median step time per variant on ``world`` local ranks (rank 0's clock)."""
    from zerodp.spawn import run_local

    times = run_local(_bench_rank, world, preset, tokens_per_rank, rounds, warmup, tuple(variants),
                      timeout=timeout)
    bad = [type(t).__name__ for t in times if not isinstance(t, dict)]
    if bad:
        raise RuntimeError(f"ranks returned {bad} instead of their timings; rerun the benchmark")
    # A step is as slow as its slowest rank: take the per-step maximum over ranks.
    samples = {v: [max(ts) for ts in zip(*(t[v] for t in times))] for v in variants}
    return Result(tokens_per_rank, {v: statistics.median(s) for v, s in samples.items()}, samples)


def format_table(results: list[Result], preset: str, world: int) -> str:
    lines = [f"median step time, GPT '{preset}', {world} ranks (gloo), alternated runs",
             f"{'tokens/rank':>12}" + "".join(f"{v:>11}" for v in VARIANTS)
             + f"{'ours/floor':>12}{'ours/ddp':>10}{'ours/gbv':>10}"]
    for r in results:
        cells = "".join(f"{r.median_s[v] * 1e3:>9.1f}ms" if v in r.median_s else f"{'-':>11}" for v in VARIANTS)
        lines.append(f"{r.tokens_per_rank:>12}{cells}{r.ratio('zerodp', 'floor'):>12.3f}"
                     f"{r.ratio('zerodp', 'ddp'):>10.3f}{r.ratio('zerodp', 'ddp_gbv'):>10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.stage0", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--regimes", type=int, nargs="+", default=list(DEFAULT_REGIMES),
                    help="tokens per rank per step, one regime each")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per regime (default: 6 for >= 1024 tokens, else 30)")
    args = ap.parse_args(argv)
    results = []
    for tokens in args.regimes:
        rounds = args.rounds or (6 if tokens >= 1024 else 30)
        results.append(run(args.preset, args.world, tokens, rounds))
        print(format_table(results[-1:], args.preset, args.world), flush=True)
    print()
    print(format_table(results, args.preset, args.world))


if __name__ == "__main__":
    main()
