"""Stage 3 side by side: our ZeRO-3 vs PyTorch FSDP2 vs the no-communication floor.

    python -m zerodp.bench.stage3                 # PRESETS["small"], 2 ranks, two regimes
    python -m zerodp.bench.stage3 --tokens 2048 32 --steps 8 40 --json
    python -m zerodp.bench.stage3 --memory        # seed §9.3 bytes per rank: formula vs measured

Seed §10.1-§10.2: FSDP's extra AllGathers hide under compute when tokens per rank exceed C/W;
below that the implementation's fixed costs decide. Two regimes therefore: many tokens per rank
(compute-bound: every contender should sit near the floor) and few (communication- and
overhead-bound: where a lean implementation shows). DESIGN §6 measured FSDP2 at 2.3× the floor
with 32 tokens per rank on this kind of machine.

Contenders, all in the same spawned ranks, same model, same data, fp32, AdamW:

- ``floor``: the plain model and optimizer on each rank, no communication at all — the same
  per-rank forward/backward work, so step time / floor is the overhead of data parallelism;
- ``ours``: ``zerodp.parallelize(stage=3)``, default units (one per block + root), prefetch on;
- ``fsdp2``: ``fully_shard`` on each block, then on the root (its default: reshard after forward).

Runs alternate step by step (one step of each contender per cycle, rotating which goes first,
a barrier before each) so that the drifting load of a shared machine hits all contenders alike;
the figure is the median step time per contender, each step timed as its slowest rank. ``compare`` is the
reusable function (a later, general bench calls it per stage and preset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

CONTENDERS = ("floor", "ours", "fsdp2")
DEFAULT_TOKENS = (2048, 32)  # tokens per rank: compute-bound, then overhead-bound (DESIGN §6)
DEFAULT_STEPS = (6, 30)  # timed steps per contender, per regime
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Regime:
    """One measured configuration: median step time per contender, in seconds."""

    preset: str
    world_size: int
    tokens_per_rank: int
    batch: int
    seq: int
    steps: int
    median_s: dict[str, float]
    samples: dict[str, int]

    def ratio(self, a: str, b: str) -> float:
        return self.median_s[a] / self.median_s[b]


def batch_shape(tokens_per_rank: int, seq_len: int) -> tuple[int, int]:
    """(micro-batch, sequence) with batch × seq = tokens: whole sequences when possible."""
    if tokens_per_rank >= seq_len:
        if tokens_per_rank % seq_len:
            raise ValueError(f"tokens per rank {tokens_per_rank} is not a multiple of seq_len {seq_len}")
        return tokens_per_rank // seq_len, seq_len
    return 1, tokens_per_rank


def _build(name: str, world: int, preset: str):
    """A step function for one contender: ``step(x, y)`` runs forward, backward, optimizer."""
    import torch

    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    make_opt = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    if name == "floor":
        opt = make_opt(model.parameters())

        def step(x, y):
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        return step
    if name == "ours":
        import zerodp

        engine = zerodp.parallelize(model, optimizer=make_opt, stage=3)

        def step(x, y):
            engine(x, y).backward()
            engine.step()
            engine.zero_grad()
        return step
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = make_opt(model.parameters())

        def step(x, y):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return step
    raise ValueError(f"unknown contender {name!r}; use one of {CONTENDERS}")


def _rank_main(rank: int, world: int, preset: str, tokens: list[int], steps: list[int],
               contenders: list[str]) -> list[dict]:
    import torch
    import torch.distributed as dist

    from zerodp.train.model import PRESETS

    cfg = PRESETS[preset]
    fns = {name: _build(name, world, preset) for name in contenders}
    out = []
    for n_tok, n_steps in zip(tokens, steps):
        b, t = batch_shape(n_tok, cfg.seq_len)
        g = torch.Generator().manual_seed(1234 + rank)
        x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
        y = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for name in contenders:  # warm-up: allocator, autograd caches, lazy init
            for _ in range(WARMUP_STEPS):
                fns[name](x, y)
        for i in range(n_steps):
            k = i % len(contenders)
            for name in contenders[k:] + contenders[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                fns[name](x, y)
                times[name].append(time.perf_counter() - t0)
        # A step of data parallelism is as slow as its slowest rank: take the max across ranks.
        mat = torch.tensor([times[name] for name in contenders], dtype=torch.float64)
        dist.all_reduce(mat, op=dist.ReduceOp.MAX)
        out.append(dict(tokens=n_tok, batch=b, seq=t, steps=n_steps,
                        times={name: mat[i].tolist() for i, name in enumerate(contenders)}))
    return out


def compare(preset: str = "small", world_size: int = 2, tokens: tuple[int, ...] = DEFAULT_TOKENS,
            steps: tuple[int, ...] = DEFAULT_STEPS,
            contenders: tuple[str, ...] = CONTENDERS, timeout: float = 900.0) -> list[Regime]:
    """Median step time of each contender in each regime, measured on local gloo ranks."""
    from zerodp.spawn import run_local

    if len(steps) != len(tokens):
        raise ValueError(f"give one step count per regime: tokens={tokens}, steps={steps}")
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contenders {sorted(unknown)}; use some of {CONTENDERS}")
    results = run_local(_rank_main, world_size, preset, list(tokens), list(steps),
                        list(contenders), timeout=timeout)
    return [Regime(preset, world_size, r["tokens"], r["batch"], r["seq"], r["steps"],
                   {k: statistics.median(v) for k, v in r["times"].items()},
                   {k: len(v) for k, v in r["times"].items()})
            for r in results[0]]


def _memory_rank(rank: int, world: int, preset: str, fp32_accum: bool) -> list[str]:
    import torch

    import zerodp
    from zerodp.engine.config import MixedPrecision
    from zerodp.engine.stats import compare_table, formula_by_kind
    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-3), stage=3,
                                mixed_precision=MixedPrecision(fp32_grad_accum=fp32_accum))
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len))
    for _ in range(2):
        engine(x, x).backward()
        engine.step()
        engine.zero_grad()
    st = engine.stats()
    return [compare_table(st, formula_by_kind(3, st.num_params, world, fp32_accum)), st.table()]


def memory_report(preset: str = "tiny", world_size: int = 2) -> str:
    """Seed §9.3 formula vs measured model-state bytes per rank (bf16 + AdamW, k = 12), with
    and without fp32 gradient accumulation, plus the stats table with the gathered peak."""
    from zerodp.spawn import run_local

    out = []
    for accum in (False, True):
        out.append(f"== stage 3, bf16 + AdamW{' + fp32 grad accumulation' if accum else ''}, rank 0 ==")
        out += run_local(_memory_rank, world_size, preset, accum)[0]
    return "\n".join(out)


def table(regimes: list[Regime]) -> str:
    names = list(regimes[0].median_s)
    head = f"{'tokens/rank':>11} {'batch×seq':>10}" + "".join(f"{n + ' ms':>11}" for n in names)
    extra = [("ours/fsdp2", "ours", "fsdp2"), ("ours/floor", "ours", "floor"), ("fsdp2/floor", "fsdp2", "floor")]
    extra = [e for e in extra if e[1] in names and e[2] in names]
    head += "".join(f"{e[0]:>13}" for e in extra)
    lines = [f"stage 3 vs FSDP2, preset {regimes[0].preset}, {regimes[0].world_size} ranks, fp32 AdamW, "
             "median step time (max over ranks), alternated step by step", head]
    for r in regimes:
        row = f"{r.tokens_per_rank:>11} {f'{r.batch}×{r.seq}':>10}"
        row += "".join(f"{r.median_s[n] * 1e3:>11.1f}" for n in names)
        row += "".join(f"{r.ratio(a, b):>13.3f}" for _, a, b in extra)
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m zerodp.bench.stage3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None, help="model preset (default: small; tiny for --memory)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                    help="tokens per rank, one regime each")
    ap.add_argument("--steps", type=int, nargs="+", default=list(DEFAULT_STEPS),
                    help="timed steps per contender, one count per regime")
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--memory", action="store_true",
                    help="instead: print formula vs measured model-state bytes per rank")
    args = ap.parse_args(argv)
    if args.memory:
        print(memory_report(args.preset or "tiny", args.world))
        return
    t0 = time.perf_counter()
    regimes = compare(args.preset or "small", args.world, tuple(args.tokens), tuple(args.steps),
                      tuple(args.contenders))
    if args.json:
        print(json.dumps([asdict(r) for r in regimes], indent=2))
    else:
        print(table(regimes))
        print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
