"""Stage 2, ZeRO-2: shard the gradients too (guide §9.2).

Under ZeRO-1 rank r only ever uses slice r of the gradient, yet stores all of it. ZeRO-2 does
not: during backward each bucket is **ReduceScattered as soon as it is full**, rank r keeps the
averaged slice r, and the bucket's full-size gradient buffer is released. What stays at rest is
2Ψ params + 2Ψ/N gradient shard + 12Ψ/N master and Adam states = 2Ψ + 14Ψ/N; in flight there
are only the buckets whose ReduceScatter is not done (at most ``MAX_REDUCE_IN_FLIGHT`` = 2 before
the oldest is waited for; ``comm_buffers`` in ``stats()`` is their peak). So here ``bucket_mb``
is memory held during backward, up to about 2 + 1 buckets counting the pool's: where 25 MiB (DDP's
default) is a large share of the model, buckets of one transformer block, the unit FSDP2 reduces
at, give a lower peak (guide §13.4). Traffic is ZeRO-1's: ReduceScatter of the gradients +
AllGather of the parameters.

How a gradient travels (:meth:`zerodp.engine.reducer.BucketHooks.grad_ready`, then
:class:`zerodp.engine.group.FlatGroup`):

1. autograd produces ``param.grad``; its hook copies it into the bucket's ``grad_full`` (allocated
   by the bucket's first gradient, in the reduce dtype) and drops ``param.grad``;
2. when the bucket's last gradient arrived, :meth:`~zerodp.engine.gradbuf.GradBuffers.reduce` issues the ReduceScatter —
   straight into the bucket's gradient shard on the first reduction of a step, into a
   shard-sized scratch on later micro-batches (then added to the shard);
3. when it completes, ``grad_full`` is released: its storage waits in the engine's small pool for
   the next bucket of the same size (the pool is emptied when the step's reductions are done).

With ``fp32_grad_accum`` the gradient shard is fp32: the bf16 ReduceScatter lands in a scratch
that is added to it (+4Ψ/N − 2Ψ/N, guide §9.2: "keep fp32 gradients only for your own 1/N").

Gradient accumulation, two choices (``reduce_every_microbatch``):

- ``True`` (default, memory first, as DeepSpeed does): every micro-batch is ReduceScattered,
  ``no_sync`` does not stop it; gradients at rest stay 2Ψ/N, traffic is grad_acc × Ψ per step
  for the gradients instead of Ψ.
- ``False`` (communication first): full local gradients accumulate under ``no_sync`` and are
  reduced once per step, as stage 1 does (the policy's ``full_grads``); gradients at rest
  are 2Ψ, ZeRO-1's memory.

In numbers, from the planner, for the guide's Ψ = 7.5B on N = 64 H100s (8 nodes) and grad_acc = 4:
the bf16 gradients are 15 GB; one ReduceScatter of them takes ≈ 33 ms
(``collective_time("reduce_scatter", 15e9, 64, "h100")``). Memory first keeps 0.23 GB of
gradients per GPU and moves 4 × 33 ≈ 131 ms of ReduceScatter per step (each hidden only under
its own micro-batch's backward); communication first moves 33 ms but keeps 15 GB of gradients
per GPU (``model_states(7.5e9, 64, 1)`` vs ``model_states(7.5e9, 64, 2)``: 31.4 vs 16.6 GB).
"""

from __future__ import annotations

from zerodp.engine.reducer import BucketEngine


class ZeRO2Engine(BucketEngine):
    """Stage 2: full params; a gradient shard per bucket, ReduceScattered in backward (memory
    first), or full local gradients reduced once per step (``reduce_every_microbatch=False``)."""

    stage = 2
