"""Fault-free overhead of the managed path (zerodp.ft over torchft) against plain hybrid sharding.

    python tools/ft_overhead.py [--preset tiny] [--stage 1] [--steps 60] [--rounds 2]

Side by side, alternating, ``--rounds`` times: plain hybrid sharding on 4 ranks in one job
(``shard_size=2``: ZeRO inside 2 groups of 2, the replica AllReduce in the job's own process
group), and 2 replica groups of 2 ranks as jobs of their own joined by torchft (a quorum and a
``should_commit`` per step, the replica AllReduce through the managed process group). Each run's
median step time after 10 warm-up steps (rank 0; the same span in both: the step's start to
``zero_grad``), the ratio per round, and their mean and spread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

WARMUP = 10


def _plain(rank, world, preset, stage, steps, rows):
    import torch
    import torch.nn.functional as F

    import zerodp
    from zerodp.ft.trainer import batch
    from zerodp.train.model import GPT, PRESETS

    cfg = PRESETS[preset]
    torch.manual_seed(0)
    engine = zerodp.parallelize(GPT(cfg), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage,
                                shard_size=2)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = batch(2 * step + rank // 2, rows * 2, cfg.seq_len, cfg.vocab_size)
        mine = slice((rank % 2) * rows, (rank % 2 + 1) * rows)
        F.cross_entropy(engine(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
        engine.step()
        engine.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def _managed(preset, stage, steps, rows):
    from zerodp.ft.launch import LocalGroups

    c = LocalGroups("zerodp.ft.trainer:train", 2, 2, dict(preset=preset, stage=stage, steps=steps, rows=rows),
                    tempfile.mkdtemp(prefix="zerodp-ft-overhead-"))
    try:
        c.start_all()
        c.wait_for(lambda: not any(c.alive(g) for g in range(2)), 600, "the managed run")
    finally:
        c.close()
    return [r["s"] for r in c.records(0, 0) if r["committed"]]


def main(argv=None) -> int:
    from zerodp.spawn import run_local

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    ratios = []
    for k in range(a.rounds):
        plain = statistics.median(run_local(_plain, 4, a.preset, a.stage, a.steps, a.rows, timeout=600)[0][WARMUP:])
        managed = statistics.median(_managed(a.preset, a.stage, a.steps, a.rows)[WARMUP:])
        ratios.append(managed / plain)
        print(f"round {k}: plain hybrid {plain * 1e3:.1f} ms/step, managed (torchft) {managed * 1e3:.1f} ms/step, "
              f"ratio {managed / plain:.3f}", flush=True)
    spread = (max(ratios) - min(ratios)) / 2
    print(f"{a.preset}, stage {a.stage}, 2 groups x 2 ranks: managed / plain = {statistics.mean(ratios):.3f} "
          f"± {spread:.3f} over {a.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
