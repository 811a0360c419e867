"""The training loop of one rank of a fault-tolerant replica group (:mod:`zerodp.ft`).

A GPT preset of :mod:`zerodp.train.model` at a ZeRO stage inside the group, AdamW, and seeded
token batches addressed by the global batch index (:meth:`ReplicaGroups.batch_index`): the batch
of index b is the same tensor on whichever group takes it, so a run's committed steps see each
batch once whatever fails. Each step logs the committed step, the groups in the quorum, the loss,
the wall time, and on request a digest of everything the rank's optimizer holds (master values
and optimizer states, bitwise) — what the tests compare between a healed group and its peer.

Arguments (``ctx.args``): ``preset`` ("nano"), ``stage`` (1), ``steps`` (run until this many
committed steps, or until the launcher says stop), ``rows`` (sequences per rank per step, 2),
``lr`` (1e-3), ``seed`` (0), ``digest`` (False), ``step_sleep_s`` (0: a pause per step, to
stretch a demo), ``timeout_s`` (30, the cross-group collectives), ``quorum_timeout_s`` (60),
``diloco_every`` (0: none; H: the DiLoCo outer loop over the groups, fp32).
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.nn.functional as F

import zerodp
from zerodp.ft.replicas import ReplicaGroups
from zerodp.train.model import GPT, PRESETS


def batch(index: int, rows: int, seq_len: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``index``: ``rows`` sequences of random tokens and their next tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randint(0, vocab, (rows, seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def digest(engine, outer: bool = False) -> str:
    """SHA-256 of every piece this rank's optimizer holds (values and states), in a fixed order;
    ``outer``: of the DiLoCo outer state instead (θ_outer and momentum: equal in every live group)."""
    h = hashlib.sha256()
    pieces = engine.outer.pieces() if outer else engine.master.pieces()
    for p in sorted(pieces, key=lambda p: (p.name, p.kind, p.start)):
        h.update(f"{p.name}|{p.kind}|{p.start}|{p.stop}".encode())
        h.update(p.tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(ctx) -> None:
    a = ctx.args
    cfg = PRESETS[a.get("preset", "nano")]
    rows = int(a.get("rows", 2))
    torch.manual_seed(int(a.get("seed", 0)))
    model = GPT(cfg)
    replicas = ReplicaGroups(ctx.group, ctx.groups, ctx.lighthouse, timeout_s=float(a.get("timeout_s", 30)),
                             quorum_timeout_s=float(a.get("quorum_timeout_s", 60)),
                             overlap_quorum=bool(a.get("overlap_quorum", True)))
    every = int(a.get("diloco_every", 0))
    engine = zerodp.parallelize(model, optimizer=lambda g: torch.optim.AdamW(g, lr=float(a.get("lr", 1e-3))),
                                stage=int(a.get("stage", 1)), replicas=replicas,
                                outer=zerodp.DiLoCo(every=every) if every else None)
    replicas.attach(engine)
    ctx.barrier()
    steps = int(a.get("steps", 1 << 30))
    try:
        while replicas.step < steps and not ctx.stopped(replicas.step):
            t0 = time.perf_counter()
            heals = replicas.heals
            replicas.start_step()
            step = replicas.step
            at_heal = digest(engine) if a.get("digest") and replicas.heals > heals else None
            index, first = replicas.batch_index(), replicas.batches_committed
            x, y = batch(index, rows * ctx.world_size, cfg.seq_len, cfg.vocab_size, int(a.get("seed", 0)))
            mine = slice(ctx.rank * rows, (ctx.rank + 1) * rows)
            logits = engine(x[mine])
            loss = F.cross_entropy(logits.flatten(0, 1), y[mine].flatten())
            loss.backward()
            before = replicas.commits
            engine.step()
            engine.zero_grad()
            committed = replicas.commits > before
            rec = dict(step=step, committed=committed, participants=replicas.participants,
                       batch=index if replicas.took_part else None, first=first,
                       loss=float(loss.detach()), s=round(time.perf_counter() - t0, 4),
                       quorum_s=round(replicas.last_quorum_s or 0.0, 4), healed=replicas.heals > heals)
            if a.get("digest"):
                rec["digest"] = digest(engine)
                if at_heal is not None:
                    rec["heal_digest"] = at_heal  # what the peer sent: its state after its last step
                if every:
                    rec["outer_digest"] = digest(engine, outer=True)
            ctx.log(**rec)
            if a.get("step_sleep_s"):
                time.sleep(float(a["step_sleep_s"]))
    finally:
        replicas.shutdown()
