"""Stage 2, ZeRO-2: shard the gradients too (guide §9.2).

Under ZeRO-1 rank r only ever uses slice r of the gradient, yet stores all of it. ZeRO-2 does
not: during backward each bucket is **ReduceScattered as soon as it is full**, rank r keeps the
averaged slice r, and the full-size bucket is released for the next bucket to reuse. What stays
at rest is 2Ψ params + 2Ψ/N gradient shard + 12Ψ/N master and Adam states = 2Ψ + 14Ψ/N; in
flight there are only a few bucket-sized staging buffers (``comm_buffers`` in ``stats()``).
Traffic is ZeRO-1's: ReduceScatter of the gradients + AllGather of the parameters.

How a gradient travels (the hot path is :meth:`ZeRO2Engine._grad_ready`):

1. autograd produces ``param.grad``; its hook copies it into the bucket's staging buffer (a
   free one from the pool; if none is free the oldest in-flight ReduceScatter is waited for) and
   drops ``param.grad``;
2. when the bucket's last gradient arrived, :meth:`ZeRO2Engine._launch` issues the
   ReduceScatter — straight into the bucket's gradient shard on the first reduction of a step,
   into a small temporary shard on later micro-batches (then added to the shard);
3. when it completes, the staging buffer returns to the pool.

With ``fp32_grad_accum`` the bf16 shard is where ReduceScatter lands and an fp32 shard
accumulates it (+4Ψ/N, guide §9.2: "keep fp32 gradients only for your own 1/N").

Gradient accumulation, two choices (``reduce_every_microbatch``):

- ``True`` (default, memory first, as DeepSpeed does): every micro-batch is ReduceScattered,
  ``no_sync`` does not stop it; gradients at rest stay 2Ψ/N, traffic is grad_acc × Ψ per step
  for the gradients instead of Ψ.
- ``False`` (communication first): full local gradients accumulate under ``no_sync`` and are
  reduced once (:class:`ZeRO2ReduceOnceEngine`, below); gradients at rest are 2Ψ,
  ZeRO-1's memory.

In numbers, from the planner, for the guide's Ψ = 7.5B on N = 64 H100s (8 nodes) and grad_acc = 4:
the bf16 gradients are 15 GB; one ReduceScatter of them takes ≈ 33 ms
(``collective_time("reduce_scatter", 15e9, 64, "h100")``). Memory first keeps 0.23 GB of
gradients per GPU and moves 4 × 33 ≈ 131 ms of ReduceScatter per step (each hidden only under
its own micro-batch's backward); communication first moves 33 ms but keeps 15 GB of gradients
per GPU (``model_states(7.5e9, 64, 1)`` vs ``model_states(7.5e9, 64, 2)``: 31.4 vs 16.6 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from zerodp.engine.reducer import BucketEngine
from zerodp.engine.zero1 import ZeRO1Engine

#: staging buffers allocated up front: one bucket filling while the previous one is reduced
STAGING_BUFFERS = 2


@dataclass
class Staging:
    """A bucket-sized buffer that gradients are copied into until its ReduceScatter is done."""

    buf: torch.Tensor  # largest bucket, full size
    temp: torch.Tensor  # largest shard: ReduceScatter output on micro-batches after the first
    bucket: int | None = None  # which bucket uses it now


class ZeRO2Engine(BucketEngine):
    """Stage 2: full params; gradient shard per bucket; ReduceScatter per bucket in backward."""

    stage = 2
    shards_master = True

    def _init_grads(self) -> None:
        mp = self.mixed_precision
        self.comm_dtype = mp.comm_dtype if mp else self.param_dtype
        self.fp32_accum = mp is not None and mp.fp32_grad_accum and self.comm_dtype != torch.float32
        for bucket in self.buckets:
            n = bucket.layout.shard_numel
            bucket.grad_shard = torch.zeros(n, dtype=self.comm_dtype, device=self.device)
            if self.fp32_accum:
                bucket.acc32 = torch.zeros(n, dtype=torch.float32, device=self.device)
            # Where each parameter's gradient goes in the staging buffer.
            for p in bucket.params:
                p.grad = None
        self._reduced = [False] * len(self.buckets)  # bucket reduced since zero_grad?
        self._staging_of: list[Staging | None] = [None] * len(self.buckets)
        self._pool: list[Staging] = [self._new_staging() for _ in range(min(STAGING_BUFFERS, len(self.buckets)))]

    def _new_staging(self) -> Staging:
        biggest = max(b.layout.padded_numel for b in self.buckets)
        return Staging(torch.empty(biggest, dtype=self.comm_dtype, device=self.device),
                       torch.empty(biggest // self.world_size, dtype=self.comm_dtype, device=self.device))

    def _reduces_now(self) -> bool:
        return True  # memory first: every micro-batch is reduced, no_sync or not

    # ---- hot path ---------------------------------------------------------------------------------
    def _grad_ready(self, b: int, i: int, param: nn.Parameter) -> None:
        if not self._backward_armed:
            self._backward_started()
        self._fired[i] = True
        staging = self._staging_of[b] or self._acquire_staging(b)
        bucket = self.buckets[b]
        slot = bucket.layout.slots[i - bucket.param_ids[0]]
        lo, hi = slot.offset, slot.stop
        staging.buf[lo:hi].copy_(param.grad.reshape(-1))
        param.grad = None  # the full gradient lives only in the staging buffer now
        remaining = self._remaining
        remaining[b] -= 1
        if remaining[b] == 0:
            self._bucket_full(b)

    def _acquire_staging(self, b: int) -> Staging:
        free = next((s for s in self._pool if s.bucket is None), None)
        if free is None and self._inflight:
            self._inflight.wait_oldest()  # bounds memory: wait for the oldest bucket in flight
            free = next((s for s in self._pool if s.bucket is None), None)
        if free is None:  # gradients arrived out of bucket order: grow the pool
            free = self._new_staging()
            self._pool.append(free)
        layout = self.buckets[b].layout
        free.buf[layout.numel:layout.padded_numel].zero_()  # padding must add nothing
        free.bucket = b
        self._staging_of[b] = free
        return free

    def _prepare_missing(self, b: int, missing: list[int]) -> None:
        staging = self._staging_of[b] or self._acquire_staging(b)
        bucket = self.buckets[b]
        first = bucket.param_ids[0]
        for i in missing:
            slot = bucket.layout.slots[i - first]
            lo, hi = slot.offset, slot.stop
            staging.buf[lo:hi].zero_()

    def _launch(self, b: int):
        """The ZeRO-2 ReduceScatter of one bucket, issued during backward (guide §9.2)."""
        bucket, staging = self.buckets[b], self._staging_of[b]
        full = staging.buf[:bucket.layout.padded_numel]
        factor = self._token_factor()
        if factor is not None:
            full.mul_(factor)
        shard = bucket.grad_shard
        first = not self._reduced[b]
        # fp32 accumulation: the bf16 mean lands in the bf16 shard, then is added in fp32.
        target = bucket.acc32 if self.fp32_accum else shard
        scratch = shard if self.fp32_accum else staging.temp
        pending = self.comm.reduce_scatter_grad(target, full, bucket.label, overwrite=first, scratch=scratch)
        self._reduced[b] = True

        def finish() -> None:
            staging.bucket = None
            self._staging_of[b] = None

        return pending, finish

    # ---- the StageEngine contract ---------------------------------------------------------------------
    def _bucket_grads(self) -> list[torch.Tensor | None]:
        return [(b.acc32 if self.fp32_accum else b.grad_shard) if done else None
                for b, done in zip(self.buckets, self._reduced)]

    def _zero_grad(self) -> None:
        self._reduced = [False] * len(self.buckets)  # the next reduction overwrites the shard

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [b.grad_shard for b in self.buckets]
        if self.fp32_accum:
            grads += [b.acc32 for b in self.buckets]
        comm = [s.buf for s in self._pool] + [s.temp for s in self._pool]
        return {"params": [b.param_buf for b in self.buckets], "grads": grads, "comm_buffers": comm}


class ZeRO2ReduceOnceEngine(ZeRO1Engine):
    """Stage 2 with ``reduce_every_microbatch=False``: communication first.

    Gradients accumulate at full size across the micro-batches of ``no_sync`` and are
    ReduceScattered once per step, exactly as stage 1 does; the price is stage 1's memory for
    gradients (2Ψ instead of 2Ψ/N). See :mod:`zerodp.engine.zero2` for the trade-off.
    """

    stage = 2
