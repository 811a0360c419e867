"""The contenders of ``zerodp bench``: our engine per stage, its PyTorch peers, and the floor.

Every contender is built on the same GPT, from the same seed, with the same AdamW settings, and
exposes one call, ``step(x, y)`` = forward, backward, optimizer step, zero grad. The pairing
follows the guide's stages (§9) and what PyTorch ships for each:

=====  ================================  =====================================================
stage  ours                              PyTorch peer(s)
=====  ================================  =====================================================
0      ``parallelize(stage=0)``          ``DistributedDataParallel`` default, and with
                                         ``gradient_as_bucket_view=True`` (its fastest, guide §13)
1      ``parallelize(stage=1)``          ``ZeroRedundancyOptimizer(AdamW)`` + DDP
2      ``parallelize(stage=2)``          FSDP2 ``fully_shard`` per block + root,
                                         ``reshard_after_forward=False`` (ZeRO-2-like, §9.2)
3      ``parallelize(stage=3)``          FSDP2 ``fully_shard`` per block + root,
                                         ``reshard_after_forward=True`` (ZeRO-3, §9.3, §10.3)
=====  ================================  =====================================================

Our engine also runs with compressed collectives and hybrid sharding (guide §14-§15,
:class:`zerodp.bench.contenders.Variant`, ``zerodp bench --compress ... --shard-size G``): ``ours3_int8``
(int8 parameter AllGathers and gradient reductions), ``ours0_bf16`` (gradients reduced in bf16), ``ours3_hybrid``
(shard groups of G ranks, replicated), and their combinations; they have no PyTorch peer here.

With ``zerodp bench --compile``, ``ours{stage}_compiled`` and the reference peer's
``{peer}_compiled`` (``ddp_bucket_view_compiled``, ``zero_ddp_compiled``, ``fsdp2_keep_compiled``,
``fsdp2_compiled``) build the same contender on a model compiled in place first, the way
``zerodp train --compile`` does (:func:`zerodp.engine.compiled.compile_in_place`: ``model.compile()``,
aot_eager on CPU, inductor on CUDA), before ``parallelize``, ``DistributedDataParallel`` or
``fully_shard`` wraps it.

With ``zerodp bench --optimizer muon`` (:class:`zerodp.bench.contenders.Optimizer`) every contender
steps ``torch.optim.Muon`` over the transformer blocks' 2-D weights and AdamW over the rest
(:func:`optimizers_for`); ours takes the two as a list (``parallelize(optimizer=[Muon, AdamW])``),
and the one peer, ``ddp_muon``, is ``DistributedDataParallel`` (``gradient_as_bucket_view=True``)
with the same two stock optimizers, their state replicated on every rank.

plus the **floor**: the plain model and optimizer on each rank with no collectives at all — the
same per-rank forward/backward/update, so that step time / floor is the price of data
parallelism (guide §7: ≈ 1 when compute-bound, large when communication-bound).

Model-state bytes are counted the same way for every contender — distinct tensor storages of the
parameters this rank holds, their ``.grad`` and the optimizer's state (our engine: its own
:meth:`stats`, which counts the same storages plus its fp32 master when it is a separate copy).
Buffers internal to C++ (DDP's reducer buckets without ``gradient_as_bucket_view``) are not
visible to Python and are not in that count; the RSS peak (:mod:`zerodp.bench.probe`) sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from zerodp.bench.contenders import MUON_PEER, CONTENDERS, Optimizer, eager_form, engine_options, is_compiled

LR = 3e-4
MUON_LR = 0.02  # Muon's own learning rate (its update is orthogonalised, RMS ~ 0.2·sqrt(max(A, B)) smaller)


@dataclass
class Contender:
    """One thing to time: ``step(x, y)`` runs a full training step and returns the loss.

    ``step(x, y, on_backward=fn)`` calls ``fn()`` between backward and the optimizer step — where
    gradients and optimizer states both exist — which is when the bench counts model states.
    """

    name: str
    stage: int | None
    role: str
    label: str
    step: Callable[..., torch.Tensor]
    model_state_bytes: Callable[[], int]
    options: dict = field(default_factory=dict)  # e.g. the bucket size actually used
    engine: object | None = None  # our engine, for its own comm accounting
    # bytes of this rank's optimizer state alone (every tensor in its optimizers' state, the step
    # counters included; our engine: its stats' "optimizer_states")
    optimizer_state_bytes: Callable[[], int] | None = None


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of a flat buffer counts once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        local = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def _states_counter(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], int]:
    def count() -> int:
        params = list(model.parameters())
        return storage_bytes(params + [p.grad for p in params] + _optimizer_tensors(opt))
    return count


def _optimizer_state_counter(opt) -> Callable[[], int]:
    """Bytes of every tensor in ``opt``'s state (scalars such as ``step`` included, as the engine's
    stats count them)."""
    def count() -> int:
        return storage_bytes([v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)])
    return count


class Optimizers:
    """Stock optimizers over disjoint parameters, stepped as one (Muon + AdamW): ``step``,
    ``zero_grad`` and one ``state`` mapping over all of them."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) parameters, the usual split: the 2-D weights of the transformer blocks
    (``model.blocks``) to Muon; the embeddings, LayerNorms, biases and the LM head to AdamW."""
    blocks = getattr(model, "blocks", None)
    hidden = {id(p) for p in (blocks.parameters() if blocks is not None else ()) if p.ndim == 2}
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]


def optimizers_for(model: nn.Module, optimizer: "Optimizer | str" = Optimizer.ADAMW) -> list[torch.optim.Optimizer]:
    """The stock optimizers a contender steps, built over ``model``'s parameters: ``[AdamW]``, or
    under ``muon`` ``[Muon(the blocks' matrices), AdamW(the rest)]`` (:func:`muon_split`)."""
    if Optimizer.parse(optimizer, "optimizer", optional=False) is Optimizer.ADAMW:
        return [torch.optim.AdamW(model.parameters(), lr=LR)]
    matrices, rest = muon_split(model)
    return ([torch.optim.Muon(matrices, lr=MUON_LR)] if matrices else []) + (
        [torch.optim.AdamW(rest, lr=LR)] if rest else [])


def _plain_step(model: nn.Module, opt, set_to_none: bool):
    """A contender's step: forward and backward through ``model``, then ``opt.step()`` and
    ``opt.zero_grad(set_to_none=...)`` (a torch optimizer, or the engine, its own optimizer)."""
    def step(x, y, on_backward=None):
        loss = model(x, y)
        loss.backward()
        if on_backward is not None:
            on_backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach()
    return step


def build(name: str, make_model: Callable[[], nn.Module], world_size: int,
          bucket_mb: "float | str" = 25.0, profile=None, tokens_per_rank: int | None = None,
          shard_size: int | None = None, optimizer: "Optimizer | str" = Optimizer.ADAMW) -> Contender:
    """Build contender ``name`` (a key of :data:`zerodp.bench.contenders.CONTENDERS`) on a fresh model
    from ``make_model``.

    Call on every rank of an initialized gloo process group; ``make_model`` must seed itself so
    that every contender starts from the same weights. ``bucket_mb`` applies to our stages 0-2
    and to DDP (``bucket_cap_mb``); ``"auto"`` (ours only) lets the engine choose it from
    ``profile`` at ``tokens_per_rank`` (``zerodp.parallelize(bucket_mb="auto")``), and the
    contender's ``options["bucket_mb"]`` is the size the engine chose. ``shard_size`` is the shard
    group of the hybrid variants (guide §14); their compression options are in ``options``.
    ``optimizer``: what every contender steps (:func:`optimizers_for`); the peer ``ddp_muon`` is
    built under ``muon`` only.
    """
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; use one of {', '.join(CONTENDERS)}")
    stage, role, label = CONTENDERS[name]
    model = make_model()
    if is_compiled(name):
        from zerodp.engine.compiled import compile_in_place

        compile_in_place(model)  # before any wrapper, the same for ours and the peer
    kind = eager_form(name) if role == "peer" else name
    optimizer = Optimizer.parse(optimizer, "optimizer", optional=False)
    if (kind == MUON_PEER) != (optimizer is Optimizer.MUON) and role == "peer":
        raise ValueError(f"contender {name!r} does not run with optimizer={optimizer!r}")
    muon = optimizer is Optimizer.MUON
    opt_factory = lambda params: torch.optim.AdamW(params, lr=LR)  # noqa: E731

    def stock(module: nn.Module):
        """The contender's optimizer over ``module``: AdamW alone, or Muon + AdamW stepped as one."""
        return Optimizers(optimizers_for(module, optimizer)) if muon else opt_factory(module.parameters())

    if role == "ours":
        import zerodp

        auto = {"profile": profile, "tokens_per_rank": tokens_per_rank} if bucket_mb == "auto" else {}
        extra = engine_options(name, shard_size)
        engine = zerodp.parallelize(model, optimizer=optimizers_for(model, optimizer) if muon else opt_factory,
                                    stage=stage,
                                    **({} if stage == 3 else {"bucket_mb": bucket_mb, **auto}), **extra)
        step = _plain_step(engine, engine, True)  # the engine is its own optimizer (zero_grad sets to None)
        options = {} if stage == 3 else {"bucket_mb": engine.config.bucket_mb, "bucket_auto": engine.bucket_auto}
        options.update(extra)
        return Contender(name, stage, role, label, step, lambda: engine.stats().model_state_bytes,
                         options, engine, lambda: engine.stats().memory.get("optimizer_states", 0))

    if name == "floor":
        opt = stock(model)
        return Contender(name, stage, role, label, _plain_step(model, opt, False), _states_counter(model, opt),
                         optimizer_state_bytes=_optimizer_state_counter(opt))

    if kind == MUON_PEER:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
        opt = stock(model)  # over the same parameters DDP wraps, replicated on every rank
        return Contender(name, stage, role, label, _plain_step(ddp, opt, False), _states_counter(model, opt),
                         {"bucket_mb": bucket_mb, "gradient_as_bucket_view": True},
                         optimizer_state_bytes=_optimizer_state_counter(opt))

    if kind in ("ddp", "ddp_bucket_view"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        view = kind == "ddp_bucket_view"
        ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=view)
        opt = opt_factory(ddp.parameters())
        # With bucket views the grads must stay (they alias the buckets): zero in place.
        return Contender(name, stage, role, label, _plain_step(ddp, opt, not view), _states_counter(model, opt),
                         {"bucket_mb": bucket_mb, "gradient_as_bucket_view": view},
                         optimizer_state_bytes=_optimizer_state_counter(opt))

    if kind == "zero_ddp":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=bucket_mb)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

        def count() -> int:
            params = list(model.parameters())
            return storage_bytes(params + [p.grad for p in params] + _optimizer_tensors(zero.optim))
        return Contender(name, stage, role, label, _plain_step(ddp, zero, True), count,
                         {"bucket_mb": bucket_mb}, optimizer_state_bytes=_optimizer_state_counter(zero.optim))

    if kind in ("fsdp2", "fsdp2_keep"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        reshard = kind == "fsdp2"
        # the mesh on the model's device: fully_shard moves every parameter to its mesh's device, so a
        # "cpu" mesh took a CUDA model to the host (gpu-check's stages 2-3 failed so on one GPU)
        mesh = init_device_mesh(next(model.parameters()).device.type, (world_size,))
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = opt_factory(model.parameters())
        return Contender(name, stage, role, label, _plain_step(model, opt, True), _states_counter(model, opt),
                         {"reshard_after_forward": reshard}, optimizer_state_bytes=_optimizer_state_counter(opt))

    raise AssertionError(f"contender {name!r} is listed but has no builder")
