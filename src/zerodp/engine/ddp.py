"""Stage 0: data parallelism as PyTorch DDP does it (guide §2-§5).

Every rank holds the full model, its own micro-batch, and after backward the *average* of all
ranks' gradients — one AllReduce per bucket, SUM then ÷N (guide §2.1 step 3), launched from the
gradient hooks as soon as a bucket is full so that it overlaps with the rest of backward (§3,
§4), and skipped inside ``no_sync()`` (§5). Every rank then runs the same optimizer step on the
same gradients, so the replicas stay identical.

The three sync modes (``EngineConfig.sync``) reproduce the guide's path from naive to fast:
``naive`` (§2.5: one AllReduce per param group after backward), ``overlap`` (§3: one async
AllReduce per parameter from its hook) and ``bucketed`` (§4, default).

Memory per rank (guide §8): bf16 params 2Ψ + bf16 grads 2Ψ + fp32 master 4Ψ + Adam m, v 8Ψ =
16Ψ (+4Ψ with fp32 gradient accumulation). In fp32 without mixed precision the optimizer runs
directly on the flat parameter buffers, so there is no separate master copy.
"""

from __future__ import annotations

from zerodp.engine.reducer import BucketEngine


class DDPEngine(BucketEngine):
    """Stage 0: replicated params, grads and optimizer states; AllReduce per bucket."""

    stage = 0
