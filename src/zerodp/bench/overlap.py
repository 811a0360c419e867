"""How much communication really hides behind compute on this machine.

Guide §3: gradient hooks start the AllReduce of finished gradients while backward still runs, so
that communication hides behind compute; the planner's simulator
(:mod:`zerodp.plan.timeline`) assumes the two share nothing. That holds when communication has
its own engine (a GPU's copy engines and a few SMs for NCCL). On a CPU with gloo the collective's
copies and reductions run on the same cores as forward and backward, so communication that is
"hidden" still takes its time out of compute. Measured here, all ranks in lock-step:

    t_compute   forward + backward alone
    t_comm      an AllReduce of V bytes alone
    t_both      the same AllReduce started asynchronously, the same forward + backward, then wait

    overlap efficiency  η = (t_compute + t_comm − t_both) / min(t_compute, t_comm),  clipped to [0, 1]

η = 1: the shorter of the two hides entirely (the simulator's assumption); η = 0: they run one
after the other. V is sized so that t_comm ≈ t_compute, where the estimate is least noisy. The
predictor (:mod:`zerodp.bench.predict`) and ``bucket_mb="auto"`` (:mod:`zerodp.bench.auto`)
charge the communication that the simulator hid under compute (1 − η) of its time
(:func:`contention_s`).
"""

from __future__ import annotations

import statistics
import time


from zerodp.plan.calibrated import Overlap


def measure_overlap(model_name: str, tokens: int, max_bytes: int, iters: int = 8,
                    warmup: int = 2, seed: int = 0) -> dict:
    """Time compute alone, an AllReduce alone and both at once on this rank (call on every rank of
    the default process group). Returns the raw per-iteration times; :func:`aggregate` combines
    the ranks."""
    import torch
    import torch.distributed as dist

    from zerodp.bench.compute import split_tokens
    from zerodp.train.model import GPT, PRESETS

    cfg = PRESETS[model_name]
    mb, seq = split_tokens(tokens, cfg.seq_len)
    torch.manual_seed(seed)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (mb, seq), generator=torch.Generator().manual_seed(seed))
    n = dist.get_world_size()

    def compute():
        model(x, x).backward()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # V such that the AllReduce takes about as long as the compute (agreed by every rank).
    probe = torch.zeros(max(n, max_bytes // 4 // n * n))
    t_c = statistics.median(timed(compute) for _ in range(3))
    t_v = statistics.median(timed(lambda: dist.all_reduce(probe)) for _ in range(3))
    want = torch.tensor([min(1.0, max(1 / 64, t_c / max(t_v, 1e-9))) * probe.numel()], dtype=torch.float64)
    dist.all_reduce(want, op=dist.ReduceOp.MAX)
    buf = torch.zeros(max(n, int(want.item()) // n * n))

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    out = {"bytes": buf.numel() * buf.element_size(), "tokens": tokens, "compute": [], "comm": [], "both": []}
    for i in range(warmup + iters):
        for key, fn in (("compute", compute), ("comm", lambda: dist.all_reduce(buf)), ("both", both)):
            t = timed(fn)
            if i >= warmup:
                out[key].append(t)
    model.zero_grad(set_to_none=True)
    return out


def aggregate(per_rank: list[dict]) -> Overlap:
    """Per iteration the slowest rank (the step waits for it), then medians."""
    def med(key):
        return statistics.median(max(ts) for ts in zip(*(r[key] for r in per_rank)))
    r0 = per_rank[0]
    return Overlap(r0["bytes"], r0["tokens"], med("compute"), med("comm"), med("both"))
