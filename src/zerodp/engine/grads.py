"""``param.grad`` where the averaged gradient lives in shards, for torch's own clipping (by norm and by value).

A DDP script clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)``. At stages 2-3
(and wherever the gradient shard is a buffer of its own beside full local gradients) no module
parameter holds the averaged gradient: rank r holds slice r of it (guide §9.2-§9.3), so torch's
function would read None (norm 0, nothing clipped) or local sums. FSDP2 answers with DTensor
gradients; here :class:`ShardedGrad` is the smallest such answer: a tensor of the parameter's
shape whose data is this rank's slice of the gradient shard, and which implements what torch's
``clip_grad_norm_``, ``get_total_norm`` and ``clip_grads_with_norm_`` call on a gradient:

- ``torch.linalg.vector_norm(g, p)``: the *global* p-norm of the parameter's gradient, from the
  local slices with one AllReduce over the shard group (MAX for p = inf, else Σ|x|^p);
- ``g.mul_(c)``, ``g.div_(c)``, ``g.zero_()``: change the local slice, i.e. the gradient shard the
  optimizer step reads, and where full local gradients stay at rest beside the shard (stage 1)
  the parameter's part of them too, so that later micro-batches add onto the clipped gradient
  (guide §12.5);
- the other in-place elementwise changes a script makes to an averaged gradient with scalars —
  ``g.clamp_(-c, c)`` (``torch.nn.utils.clip_grad_value_``), ``clamp_min_``, ``clamp_max_``,
  ``nan_to_num_``: the local slice as above; the full local gradients at rest are moved by
  N·(new − old) on this rank's slice of the parameter, so that their mean over the N ranks — what
  the next ReduceScatter averages — moves by exactly the change the slice made.

- what a script reads off a gradient to log it or to check it is finite — ``torch.isfinite(g).all()``,
  ``g.isnan().any()``, ``g.abs().max()``, ``(g ** 2).sum()``, ``g.mean()``: an elementwise op with
  scalars (or between two such gradients of one parameter) gives another :class:`ShardedGrad`, of
  this rank's slice only; a whole-tensor reduction of one (``sum``, ``mean``, ``max``/``amax``,
  ``min``/``amin``, ``all``, ``any``) gives the *global* value, from the slices with one AllReduce
  over the shard group (SUM, MAX or MIN). Every rank makes it, as every rank clips.

Anything else raises one line naming ``engine.full_grad_dict()`` (the gathered gradients) and
``engine.clip_grad_norm_`` (one AllReduce for the whole model instead of one per parameter).
They are on the module's parameters after every backward whose gradients were reduced and after
``step()``; the engine reads them back (``model.zero_grad()``, ``p.grad = None``) before its next
forward, backward, clip or step, and ``zero_grad`` takes them off (guide §12.9).
"""

from __future__ import annotations

import math

import torch

from zerodp.engine.control import GRAD_NORM

aten = torch.ops.aten
#: in-place scalings a script applies to a gradient (a clip, an unscale, ``model.zero_grad(set_to_none=False)``):
#: applied to this rank's slice and to the local gradient beside it
_IN_PLACE = {aten.mul_.Tensor: torch.Tensor.mul_, aten.mul_.Scalar: torch.Tensor.mul_,
             aten.div_.Tensor: torch.Tensor.div_, aten.div_.Scalar: torch.Tensor.div_,
             aten.zero_.default: torch.Tensor.zero_}
#: in-place elementwise changes with scalar arguments that are not scalings (a clip by value,
#: non-finite values replaced): applied to this rank's slice, the local gradient moved by N·change
_ELEMENTWISE = {aten.clamp_.default: torch.Tensor.clamp_, aten.clamp_min_.default: torch.Tensor.clamp_min_,
                aten.clamp_max_.default: torch.Tensor.clamp_max_, aten.nan_to_num_.default: torch.Tensor.nan_to_num_}
#: out-of-place elementwise ops a script reads a gradient with: applied to the slice, a ShardedGrad again
_READS = {aten.abs.default, aten.neg.default, aten.isnan.default, aten.isinf.default, aten.isfinite.default,
          aten.isneginf.default, aten.isposinf.default, aten.logical_not.default, aten.sign.default,
          aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar,
          aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar, aten.ge.Scalar, aten.lt.Scalar, aten.le.Scalar,
          aten.eq.Tensor, aten.ne.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
          aten.logical_and.default, aten.logical_or.default, aten.square.default, aten._to_copy.default}
#: whole-tensor reductions: the local value of the slice, then one AllReduce with this op; what a rank
#: with an empty slice contributes
_REDUCTIONS = {aten.sum.default: ("sum", 0.0), aten.mean.default: ("sum", 0.0), aten.max.default: ("max", -math.inf),
               aten.amax.default: ("max", -math.inf), aten.min.default: ("min", math.inf),
               aten.amin.default: ("min", math.inf), aten.all.default: ("min", 1.0), aten.any.default: ("max", 0.0)}


class ShardedGrad(torch.Tensor):
    """A parameter's averaged gradient as this rank holds it (module docstring)."""

    _local: torch.Tensor
    _comm: object  # zerodp.engine.comm.Collectives of the shard group
    _also: torch.Tensor | None  # the parameter's full local gradient, scaled with the slice
    _mine: torch.Tensor | None  # the part of it at this rank's slice's positions

    @staticmethod
    def __new__(cls, like: torch.Tensor, local: torch.Tensor, comm, also: torch.Tensor | None = None,
                mine: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> "ShardedGrad":
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=dtype or like.dtype, device=like.device,
                                                requires_grad=False)
        t._local = local
        t._comm = comm
        t._also = also
        t._mine = mine
        return t

    def __repr__(self) -> str:  # noqa: D105
        return (f"ShardedGrad(shape={tuple(self.shape)}, this rank's slice: {self._local.numel()} elements; "
                "engine.full_grad_dict() gathers the whole gradient)")

    def _norm(self, p: float) -> torch.Tensor:
        local = self._local.detach()
        local = local if local.dtype in (torch.float32, torch.float64) else local.float()  # fp64 keeps its precision
        if math.isinf(p):
            value = (local.abs().max() if local.numel() else torch.zeros((), dtype=local.dtype,
                                                                         device=local.device)).reshape(1)
            self._comm.reduce_for(GRAD_NORM, value, "max", detail=self.numel())
            return value[0]
        value = local.abs().pow(p).sum().reshape(1)
        self._comm.reduce_for(GRAD_NORM, value, detail=self.numel())
        return value[0].pow(1.0 / p)

    def _reduce(self, func) -> torch.Tensor:
        """A whole-tensor reduction's global value (module docstring)."""
        op, empty = _REDUCTIONS[func]
        local = self._local.detach()
        if local.dtype == torch.bool:
            local = local.to(torch.int64 if op == "sum" else torch.float32)
        base = aten.sum.default if func is aten.mean.default else func
        value = (base(local).double() if local.numel() else torch.tensor(empty, dtype=torch.float64)).reshape(1)
        if op == "min":  # the control exchanges SUM and MAX: MIN is MAX of the negated values
            value.neg_()
        self._comm.reduce_for(GRAD_NORM, value, "sum" if op == "sum" else "max", detail=self.numel())
        if op == "min":
            value.neg_()
        if func is aten.mean.default:
            value /= self.numel()
        dtype = (torch.bool if func in (aten.all.default, aten.any.default)
                 else self.dtype if self.dtype.is_floating_point else torch.int64)
        return value[0].to(dtype=dtype, device=self._local.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REDUCTIONS and len(args) == 1 and not kwargs and isinstance(args[0], ShardedGrad):
            return args[0]._reduce(func)
        if func in _READS and isinstance(args[0], ShardedGrad):
            g = args[0]
            others = [o for o in (*args[1:], *kwargs.values()) if isinstance(o, torch.Tensor)]
            if all(o.dim() == 0 and not isinstance(o, ShardedGrad)
                   or isinstance(o, ShardedGrad) and o._local.shape == g._local.shape and o.shape == g.shape
                   for o in others):
                local = func(*[a._local if isinstance(a, ShardedGrad) else a for a in args],
                             **{k: v._local if isinstance(v, ShardedGrad) else v for k, v in kwargs.items()})
                return ShardedGrad(g, local, g._comm, dtype=local.dtype)
        if func is aten.linalg_vector_norm.default and not kwargs.get("dim") and len(args) <= 2:
            p = float(args[1]) if len(args) > 1 else float(kwargs.get("ord", 2.0))
            return args[0]._norm(p)
        if func in _IN_PLACE and isinstance(args[0], ShardedGrad):
            op, rest = _IN_PLACE[func], args[1:]
            for t in (args[0]._local, args[0]._also):
                if t is not None:
                    op(t, *[o.to(t.dtype) if isinstance(o, torch.Tensor) else o for o in rest])
            return args[0]
        if func in _ELEMENTWISE and isinstance(args[0], ShardedGrad) \
                and not any(isinstance(o, torch.Tensor) for o in (*args[1:], *kwargs.values())):
            g = args[0]
            before = g._local.clone() if g._mine is not None else None
            _ELEMENTWISE[func](g._local, *args[1:], **kwargs)
            if before is not None:  # the mean of the local gradients moves with the slice (module docstring)
                g._mine.add_((g._local - before).to(g._mine.dtype), alpha=g._comm.world_size)
            return args[0]
        if func is aten.detach.default:
            return args[0]
        raise NotImplementedError(
            f"{func}: this gradient is sharded across ranks (zerodp stage 2-3): torch.nn.utils.clip_grad_norm_ and "
            "clip_grad_value_ work on it, as do in-place scalings and clamps, elementwise reads and whole-tensor "
            "sum/mean/max/min/all/any (g.isnan().any(), g.abs().max()); to read whole gradients use "
            "engine.full_grad_dict(), to clip faster engine.clip_grad_norm_(max_norm)")
