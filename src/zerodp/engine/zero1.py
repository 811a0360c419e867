"""Stage 1, ZeRO-1: shard the optimizer states (guide §9.1).

In plain DP every rank runs the same optimizer step on the same gradients — N times the same
work and N copies of the fp32 master and Adam moments. ZeRO-1 makes rank r responsible for
slice r (1/N) of every flat buffer:

1. forward with the full (bf16) parameters, backward to full local gradients;
2. **ReduceScatter** each bucket's gradients: rank r receives the average of its slice only;
3. update only that slice of the fp32 master with the optimizer states it holds, cast to bf16;
4. **AllGather** the parameters so every rank has the full updated model again.

Memory per rank: 2Ψ params + 2Ψ grads + 12Ψ/N master and Adam states = 4Ψ + 12Ψ/N. Traffic is
unchanged: ReduceScatter + AllGather = one AllReduce (guide §9.1), only the AllGather moved from
the gradients to the updated parameters.

Here the ReduceScatter of a bucket is launched as soon as the bucket is full (as stage 0's
AllReduce is) and waited for at the end of backward. It writes into a separate gradient shard
(Ψ/N elements per rank), not into rank r's slice of the full buffer: the full buffer keeps this
rank's *local* gradient sum, so a second synchronizing backward in the same step (gradient
accumulation without ``no_sync``, two losses backwarded one after the other) adds onto local
values again and its ReduceScatter returns the average of the whole sum. An in-place
ReduceScatter would leave slice r averaged and the other slices local, and the next backward
would add onto that mixture.

The AllGather of §9.1 step 5: after the one optimizer step, each bucket's updated slice is cast
and its AllGather launched, in the order the next forward needs them (the last bucket holds the
first layers), so that they overlap one another. ``step()`` waits for them before it returns, so
the model's parameters are the new ones afterwards (EMA, ``state_dict()``, evaluation outside
the engine). ``overlap_param_gather=True`` leaves them in flight until the next engine forward
instead, hiding them behind ``zero_grad``, data loading and whatever else runs between steps;
reading the parameters directly in that window sees the old values.
"""

from __future__ import annotations

from zerodp.engine.reducer import BucketEngine


class ZeRO1Engine(BucketEngine):
    """Stage 1: full params and grads, sharded master and optimizer states."""

    stage = 1
