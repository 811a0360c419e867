"""Stage 1, ZeRO-1: shard the optimizer states (seed §9.1).

In plain DP every rank runs the same optimizer step on the same gradients — N times the same
work and N copies of the fp32 master and Adam moments. ZeRO-1 makes rank r responsible for
slice r (1/N) of every flat buffer:

1. forward with the full (bf16) parameters, backward to full local gradients;
2. **ReduceScatter** each bucket's gradients: rank r receives the average of its slice only;
3. update only that slice of the fp32 master with the optimizer states it holds, cast to bf16;
4. **AllGather** the parameters so every rank has the full updated model again.

Memory per rank: 2Ψ params + 2Ψ grads + 12Ψ/N master and Adam states = 4Ψ + 12Ψ/N. Traffic is
unchanged: ReduceScatter + AllGather = one AllReduce (seed §9.1), only the AllGather moved from
the gradients to the updated parameters.

Here the ReduceScatter of a bucket is launched as soon as the bucket is full (as stage 0's
AllReduce is; the reduction runs in place, rank r's slice of the bucket's gradient buffer
receives the result), and waited for at the end of backward.

Hiding the AllGather — which of §9.1's two options, and why: **in the optimizer step, bucket by
bucket**. Buckets are updated in the order the next forward needs them (the last bucket holds
the first layers), and each bucket's AllGather is launched as soon as its slice is updated, so it
runs while the next buckets are updated, during ``zero_grad``, data loading and the start of the
next step; it is waited for only at the next forward (or when ``engine.module`` is accessed). The
other option — waiting for each bucket right before its first use in forward — needs forward
hooks that know every place a parameter is read; a parameter read directly by a parent module
(tied embeddings, raw ``nn.Parameter`` s) would silently see stale values. The chosen option is
exact for every model and leaves exposed only what the step itself cannot cover.
"""

from __future__ import annotations

import torch

from zerodp.engine.comm import Pending
from zerodp.engine.reducer import BucketEngine, FullGradEngine


class ShardedMaster(BucketEngine):
    """Stages 1-2: rank r keeps the fp32 master and optimizer states of slice r of each bucket."""

    def _bucket_masters(self, fp32: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        self._param_gathers: list[Pending] = []
        masters = []
        for bucket, full in zip(self.buckets, fp32):
            lo, hi = bucket.layout.shard_range(self.rank)
            # fp32 params: the master *is* slice r of the parameter buffer (no copy); otherwise a
            # separate fp32 shard, and the full fp32 copy is dropped (4Ψ/N instead of 4Ψ).
            masters.append((full[lo:hi] if full is bucket.param_buf else full[lo:hi].clone(), lo))
        return masters

    def _shard(self, b: int) -> tuple[int, int]:
        return self.buckets[b].layout.shard_range(self.rank)

    def _optimizer_step(self) -> None:
        """§9.1 steps 3-4, bucket by bucket in forward order; each AllGather overlaps the next update."""
        grads = self._bucket_grads()
        targets = self.master.targets
        for b in reversed(range(len(self.buckets))):
            if grads[b] is None:
                continue
            grad = grads[b] if grads[b].dtype == torch.float32 else grads[b].float()
            mine = [targets[i] for i in self._targets_of[b]]
            for t in mine:
                lo = t.flat_start - self._shard(b)[0]
                t.tensor.grad = grad[lo:lo + t.tensor.numel()]
            self.master.step()  # the stock optimizer skips targets whose .grad is None
            for t in mine:
                t.tensor.grad = None
            self._publish_bucket(b)

    @torch.no_grad()
    def _publish_bucket(self, b: int) -> None:
        bucket, master = self.buckets[b], self._bucket_master[b]
        lo, hi = self._shard(b)
        mine = bucket.param_buf[lo:hi]
        if mine.data_ptr() != master.data_ptr():
            mine.copy_(master)  # fp32 master → bf16 slice
        # In place: rank r's slice of the buffer is its input; the others' slices arrive around it.
        self._param_gathers.append(self.comm.all_gather(bucket.param_buf, mine, bucket.label))

    def _publish_params(self) -> None:
        for b in reversed(range(len(self.buckets))):
            self._publish_bucket(b)

    def _wait_params(self) -> None:
        if self._param_gathers:
            for pending in self._param_gathers:
                pending.wait()
            self._param_gathers.clear()


class ZeRO1Engine(ShardedMaster, FullGradEngine):
    """Stage 1: full params and grads, sharded master and optimizer states."""

    stage = 1

    def _launch(self, b: int) -> tuple[Pending, None]:
        buf = self._grads_to_reduce(b)
        lo, hi = self._shard(b)
        # In place: slice r of the bucket's gradient buffer receives the average of slice r.
        return self.comm.reduce_scatter_mean(buf[lo:hi], buf, self.buckets[b].label), None

    def _bucket_grads(self) -> list[torch.Tensor | None]:
        return [None if g is None else g[slice(*self._shard(b))] for b, g in enumerate(self._full_grads())]


class ZeRO2ReduceOnceEngine(ZeRO1Engine):
    """Stage 2 with ``reduce_every_microbatch=False``: communication first.

    Gradients accumulate at full size across the micro-batches of ``no_sync`` and are
    ReduceScattered once per step, exactly as stage 1 does; the price is stage 1's memory for
    gradients (2Ψ instead of 2Ψ/N). See :mod:`zerodp.engine.zero2` for the trade-off.
    """

    stage = 2
