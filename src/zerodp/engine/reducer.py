"""The gradient reducer shared by stages 0-2: hooks, buckets launched in order, end of backward.

Guide §3: a parameter's gradient is final as soon as its post-accumulate-grad hook fires, so its
communication can start right away while backward computes earlier layers. Guide §4: the hooks
only count down a bucket; when the bucket's last gradient arrives, one collective is launched
for the whole bucket. The collective itself is the stage's policy (:meth:`_launch`): an
AllReduce for stage 0 (:mod:`zerodp.engine.ddp`), a ReduceScatter for stages 1-2
(:mod:`zerodp.engine.zero1`, :mod:`zerodp.engine.zero2`).

Rules that keep every rank in step (a mismatch would hang, guide §12):

- buckets are launched strictly in bucket order: bucket i only after buckets 0..i-1, even if
  it fills first (as DDP's reducer does);
- at the end of backward (an autograd-engine callback, queued by the first hook) every bucket
  not yet launched is launched, in order, then all collectives are waited for — so gradients
  are final when ``loss.backward()`` returns, as with DDP;
- a parameter that got no gradient in a synchronizing backward is an error naming it, raised
  after its bucket was still launched on this rank so the other ranks do not hang; with
  ``find_unused_parameters=True`` it contributes zeros on this rank (its bucket is launched at
  the end of backward). A parameter that *no* rank used in any backward of the step is skipped
  by the optimizer — no weight decay, no moment update, no step count — as with DDP, where its
  ``.grad`` stays None (one small AllReduce of a used-flag per parameter at ``step()``).

Inside ``no_sync()`` (guide §5) the hooks launch nothing and gradients accumulate locally.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, ClassVar

import torch
import torch.nn as nn

from zerodp.engine.base import StageEngine
from zerodp.engine.buckets import build_buckets, cast_floating_buffers, plan_buckets
from zerodp.engine.comm import InFlight, Pending
from zerodp.engine.config import AUTO, EngineConfig, resolve_auto_bucket
from zerodp.engine.master import OptimizerFactory, Target


class BucketEngine(StageEngine):
    """Stages 0-2: parameters in bucketed flat buffers, one collective per bucket.

    ``shards_master``: the policy that tells stage 0 from stages 1-2 — whether rank r keeps the
    fp32 master and optimizer states of slice r of each bucket (then the updated slices are
    AllGathered after the step) or of the whole bucket.

    Subclasses implement :meth:`_init_grads` (gradient storage), :meth:`_launch` (the collective
    of one bucket), :meth:`_bucket_grads` (the gradient each master tensor reads) and the
    ``StageEngine`` methods ``_zero_grad``, ``_memory_tensors``.
    """

    shards_master: ClassVar[bool] = False

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, config: EngineConfig,
                 units: list[nn.Module] | None = None, group=None):
        super().__init__(module, optimizer_factory, config, units=units, group=group)
        mp = self.mixed_precision
        dtypes = sorted({str(p.dtype) for _, p in self.named_params})
        if mp is None and len(dtypes) > 1:
            raise ValueError(f"parameters have several dtypes {dtypes}: convert the model to one dtype, "
                             "or pass mixed_precision='bf16' to compute in bf16 with fp32 masters")
        self.param_dtype = mp.param_dtype if mp else self.named_params[0][1].dtype
        if not self.param_dtype.is_floating_point:
            raise ValueError(f"parameters of dtype {self.param_dtype} cannot be trained")
        # bucket_mb="auto" (guide §4): chosen once, here, before the buckets are planned.
        self.bucket_auto = config.bucket_mb == AUTO
        config = self.config = resolve_auto_bucket(config, module, self.world_size, self.param_dtype,
                                                   self._grad_comm_dtype())
        # Per parameter: which bucket, and where in it (used by the hooks).
        plan = plan_buckets([p.numel() for _, p in self.named_params], self.param_group_of,
                            self.param_dtype.itemsize, config.sync,
                            config.bucket_mb, config.first_bucket_mb)
        self.buckets, fp32 = build_buckets(self.named_params, self.param_group_of, plan,
                                           self.world_size, self.param_dtype, self.device)
        if mp is not None:  # buffers and frozen parameters compute in the param dtype too
            cast_floating_buffers(module, self.param_dtype)
            with torch.no_grad():
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(self.param_dtype)
        self._check_consistency(self._description())
        with torch.no_grad():
            # Rank 0's values everywhere, as DDP does: trainable parameters, frozen ones, buffers.
            frozen = [p for p in module.parameters() if not p.requires_grad]
            self._broadcast_from_rank0(fp32 + frozen + [b for b in module.buffers()])
            for bucket, full in zip(self.buckets, fp32):
                if bucket.param_buf is not full:
                    bucket.param_buf.copy_(full)
        self._init_grads()
        self.master = self._build_master(self._chunked_targets(self._bucket_masters(fp32)))
        del fp32  # the fp32 full copies live on only where a bucket's master kept them
        # Hooks: parameter i (numbered in bucket order) of bucket b calls _grad_ready(b, i).
        self._hooks, self._names = [], []
        for b, bucket in enumerate(self.buckets):
            bucket.param_ids = []
            for name, p in zip(bucket.names, bucket.params):
                i = len(self._names)
                self._names.append(name)
                bucket.param_ids.append(i)
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._grad_ready, b, i)))
        self._full_count = [len(b.params) for b in self.buckets]
        position = {n: i for i, (n, _) in enumerate(self.named_params)}
        self._named_index = [position[n] for n in self._names]  # bucket order → named_params order
        self._step_used = [False] * len(self._names)
        self._reset_backward()
        self._inflight = InFlight()  # bucket collectives issued, not yet waited for
        self._param_gathers = InFlight()  # stages 1-2: parameter AllGathers after the step
        self._start_clock()

    # ---- what a stage provides ---------------------------------------------------------------
    def _grad_comm_dtype(self) -> torch.dtype:
        """The dtype bucket collectives move gradients in (sizes ``bucket_mb="auto"``)."""
        mp = self.mixed_precision
        return mp.comm_dtype if mp else self.param_dtype

    def _init_grads(self) -> None:
        raise NotImplementedError

    # ---- the master: whole buckets (stage 0) or slice r of each (stages 1-2, guide §9.1) -------
    def _bucket_masters(self, fp32: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        """Per bucket: its fp32 master tensor and where it starts in the bucket's flat layout.

        Stage 0 keeps the whole fp32 buffer (with fp32 params it *is* the flat parameter buffer,
        no copy). Stages 1-2 keep slice r: with fp32 params a view of the parameter buffer, else a
        separate fp32 shard, and the full fp32 copy is dropped (4Ψ/N instead of 4Ψ)."""
        if not self.shards_master:
            return [(full, 0) for full in fp32]
        masters = []
        for bucket, full in zip(self.buckets, fp32):
            lo, hi = bucket.layout.shard_range(self.rank)
            masters.append((full[lo:hi] if full is bucket.param_buf else full[lo:hi].clone(), lo))
        return masters

    @torch.no_grad()
    def _publish_params(self) -> None:
        """After the step, the compute parameters ← the master: a cast (stage 0), or a cast of
        slice r and the AllGather of each bucket, in the order the next forward needs them (the
        last bucket holds the first layers; guide §9.1 step 5)."""
        for b in reversed(range(len(self.buckets))):
            bucket, master = self.buckets[b], self._bucket_master[b]
            lo, hi = bucket.layout.shard_range(self.rank) if self.shards_master else (0, bucket.layout.padded_numel)
            mine = bucket.param_buf[lo:hi]
            if mine.data_ptr() != master.data_ptr():
                mine.copy_(master)  # fp32 master → compute dtype
            if self.shards_master:
                # In place: slice r of the buffer is this rank's input, the others' arrive around it.
                self._param_gathers.add(self.comm.all_gather(bucket.param_buf, mine, bucket.label))

    def _wait_params(self) -> None:
        self._param_gathers.wait_all()

    def _owned_range(self, target: Target) -> tuple[int, int]:
        # Stage 0's replicas: rank r saves only slice r, so checkpoint pieces are disjoint.
        return target.layout.shard_range(self.rank) if not self.shards_master else super()._owned_range(target)

    def _bucket_grads(self) -> list[torch.Tensor | None]:
        """Per bucket: the gradient its master tensor reads (same length), or None to skip it."""
        raise NotImplementedError

    # ---- master targets: each bucket's master, in cache-sized chunks -----------------------------
    def _chunked_targets(self, masters: list[tuple[torch.Tensor, int]]) -> list[Target]:
        """Each bucket's master tensor as optimizer targets (per parameter, cache-sized chunks),
        remembering which range of the bucket's gradient each target reads."""
        self._bucket_master = [m for m, _ in masters]
        self._target_range: list[tuple[int, int, int]] = []  # (bucket, start, stop) in its master
        targets: list[Target] = []
        for b, (master, start) in enumerate(masters):
            for t in self._targets(master, self.buckets[b].layout, start):
                lo = t.flat_start - start
                self._target_range.append((b, lo, lo + t.tensor.numel()))
                targets.append(t)
        return targets

    def _flat_layouts(self):
        return [b.layout for b in self.buckets]

    def _local_used(self) -> list[bool] | None:
        if not self.config.find_unused_parameters:
            return None
        used = [False] * len(self.named_params)
        for i, u in enumerate(self._step_used):
            used[self._named_index[i]] = u
        return used

    def _reset_used(self) -> None:
        self._step_used = [False] * len(self._names)

    def _master_grads(self) -> list[torch.Tensor | None]:
        grads = self._bucket_grads()
        return [None if grads[b] is None else grads[b][lo:hi] for b, lo, hi in self._target_range]

    def _launch(self, b: int) -> tuple[Pending, Callable[[], None] | None]:
        """Start bucket ``b``'s collective; return it and what to do once it completed."""
        raise NotImplementedError

    def _reduces_now(self) -> bool:
        """Whether this backward reduces gradients (False if its forward ran in ``no_sync``, §5)."""
        return self._sync_at_forward

    def _accumulate_local(self, b: int) -> None:
        """A bucket filled in a backward that does not reduce (default: autograd accumulated)."""

    def _prepare_missing(self, b: int, missing: list[int]) -> None:
        """Bucket ``b`` is launched although parameters ``missing`` got no gradient."""

    # ---- hooks (the hot path) -----------------------------------------------------------------
    def _grad_ready(self, b: int, i: int, param: nn.Parameter) -> None:
        """Hook of parameter ``i`` in bucket ``b``: take its gradient, count the bucket down
        (calling :meth:`_bucket_full` at zero). Implemented by the gradient storage classes."""
        raise NotImplementedError

    def _backward_started(self) -> None:
        super()._backward_started()
        self._reducing = self._reduces_now()

    def _bucket_full(self, b: int) -> None:
        if not self._reducing:
            self._accumulate_local(b)
            return
        self._ready[b] = True
        if self.config.sync != "naive":  # naive (guide §2.5): everything waits for the end of backward
            self._launch_ready()

    def _launch_ready(self) -> None:
        ready, n = self._ready, len(self.buckets)
        while self._next < n and ready[self._next]:
            b = self._next
            self._next += 1
            self._inflight.add(*self._launch(b))

    def _on_backward_end(self) -> None:
        self._step_used = [a or b for a, b in zip(self._step_used, self._fired)]
        try:
            if self._reducing:
                missing = [i for i, fired in enumerate(self._fired) if not fired]
                for b, left in enumerate(self._remaining):
                    if left > 0:
                        ids = [i for i in self.buckets[b].param_ids if not self._fired[i]]
                        self._prepare_missing(b, ids)
                        self._ready[b] = True
                self._launch_ready()
                self._inflight.wait_all()
                if missing and not self.config.find_unused_parameters:
                    names = [self._names[i] for i in missing]
                    raise RuntimeError(
                        f"parameters that require grad received no gradient in this backward: "
                        f"{names}. Their buckets were still reduced so other ranks do not hang. If "
                        f"this is expected (conditional branches, unused heads), pass "
                        f"find_unused_parameters=True; if they are frozen, set requires_grad=False "
                        f"before parallelize()"
                    )
            else:
                for b, left in enumerate(self._remaining):
                    if 0 < left < self._full_count[b]:
                        self._accumulate_local(b)
        finally:
            self._reset_backward()

    def _reset_backward(self) -> None:
        self._remaining = list(self._full_count)
        self._ready = [False] * len(self.buckets)
        self._fired = [False] * len(self._names)
        self._next = 0
        self._reducing = False

    def _finish_grad_sync(self) -> None:
        self._inflight.wait_all()

    # ---- description for the start-up consistency check -----------------------------------------
    def _description(self) -> dict:
        return {
            "engine": type(self).__name__,
            "world_size": self.world_size,
            "sync": self.config.sync,
            "param_dtype": str(self.param_dtype),
            "params": {n: {"shape": list(p.shape), "dtype": str(p.dtype),
                           "options": sorted(map(str, self.group_options[g].items()))}
                       for (n, p), g in zip(self.named_params, self.param_group_of)},
            "param_order": [n for n, _ in self.named_params],
            "buckets": [b.describe() for b in self.buckets],
        }

    def _layout_extra(self, index: int) -> dict:
        bucket = self.buckets[index]  # layouts come in bucket order
        return {"label": bucket.label, "dtype": str(bucket.param_buf.dtype)}


class FullGradEngine(BucketEngine):
    """Stages 0-1 (and 2 with ``reduce_every_microbatch=False``): full local gradients at rest.

    Each bucket has a flat gradient buffer and ``param.grad`` becomes a view into it (DDP's
    ``gradient_as_bucket_view``): after ``zero_grad`` gradients are None; the first gradient of
    a step is copied into the bucket by its hook (one copy, no zeroing pass), later micro-batches
    accumulate into the view in place, and the bucket's collective runs on the buffer.

    With bf16 mixed precision and ``fp32_grad_accum`` (or an fp32 ``reduce_dtype``) each bucket
    also has an fp32 accumulator (+4Ψ, guide §9): every filled bucket is added into it, and the
    collective then runs on the fp32 accumulator.
    """

    def _grad_comm_dtype(self) -> torch.dtype:
        mp = self.mixed_precision
        if mp is not None and self.param_dtype != torch.float32 and mp.fp32_grad_accum:
            return torch.float32  # the collective runs on the fp32 accumulator (_grads_to_reduce)
        return super()._grad_comm_dtype()

    def _init_grads(self) -> None:
        mp = self.mixed_precision
        comm = mp.comm_dtype if mp else self.param_dtype
        if comm not in (self.param_dtype, torch.float32):
            raise ValueError(f"reduce_dtype={comm} is not supported with params in {self.param_dtype} at "
                             f"stage {self.stage}: use the param dtype or torch.float32")
        self.fp32_grads = mp is not None and self.param_dtype != torch.float32 and (
            mp.fp32_grad_accum or comm == torch.float32)
        self._grad_views: list[torch.Tensor] = []
        self._params: list[nn.Parameter] = []
        for bucket in self.buckets:
            bucket.grad_buf = torch.zeros_like(bucket.param_buf)
            self._grad_views += bucket.views(bucket.grad_buf)
            self._params += bucket.params
            if self.fp32_grads:
                bucket.acc32 = torch.zeros(bucket.layout.padded_numel, dtype=torch.float32,
                                                    device=self.device)
        for p in self._params:
            p.grad = None
        self._fresh = False  # do the buffers hold gradients of this step?

    def _grad_ready(self, b: int, i: int, param: nn.Parameter) -> None:
        if not self._backward_armed:
            self._backward_started()
        view = self._grad_views[i]
        if param.grad is not view:  # first gradient since zero_grad: move it into the bucket
            view.copy_(param.grad)
            param.grad = view
        self._fired[i] = True
        remaining = self._remaining
        remaining[b] -= 1
        if remaining[b] == 0:
            self._bucket_full(b)

    def _fill_missing(self, b: int) -> None:
        """Parameters of bucket ``b`` with no gradient this step contribute zeros."""
        for i in self.buckets[b].param_ids:
            if self._params[i].grad is not self._grad_views[i]:
                self._grad_views[i].zero_()
                self._params[i].grad = self._grad_views[i]

    def _prepare_missing(self, b: int, missing: list[int]) -> None:
        self._fill_missing(b)

    def _on_backward_end(self) -> None:
        self._fresh = True
        super()._on_backward_end()

    def _accumulate_local(self, b: int) -> None:
        if self.fp32_grads:
            self._fill_missing(b)
            bucket = self.buckets[b]
            bucket.acc32.add_(bucket.grad_buf)
            for i in bucket.param_ids:  # the next micro-batch copies instead of adding
                self._params[i].grad = None

    def _grads_to_reduce(self, b: int) -> torch.Tensor:
        """The flat buffer bucket ``b``'s collective runs on (pre-scaled for token averaging)."""
        self._accumulate_local(b)
        bucket = self.buckets[b]
        buf = bucket.acc32 if self.fp32_grads else bucket.grad_buf
        factor = self._token_factor()
        if factor is not None:
            buf.mul_(factor)
        return buf

    def _full_grads(self) -> list[torch.Tensor | None]:
        if not self._fresh:
            return [None] * len(self.buckets)  # no backward since zero_grad: nothing to apply
        return [b.acc32 if self.fp32_grads else b.grad_buf for b in self.buckets]

    def _zero_grad(self) -> None:
        for p in self._params:
            p.grad = None
        if self.fp32_grads:
            for bucket in self.buckets:
                bucket.acc32.zero_()
        self._fresh = False

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [b.grad_buf for b in self.buckets]
        if self.fp32_grads:
            grads += [b.acc32 for b in self.buckets]
        return {"params": [b.param_buf for b in self.buckets], "grads": grads}
