"""``zerodp.parallelize``: one call, one switch for the sharding stage (guide §9, guide §12).

    engine = zerodp.parallelize(model, optimizer=lambda groups: torch.optim.AdamW(groups, lr=3e-4),
                                stage=2, mixed_precision="bf16")

stage 0 = data parallelism as DDP does it (guide §2-§5), 1 = ZeRO-1 (optimizer states sharded,
§9.1), 2 = ZeRO-2 (+ gradients, §9.2), 3 = ZeRO-3 / FSDP (+ parameters, §9.3, §10). Every stage
class has the same constructor, see :mod:`zerodp.engine.base`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.base import StageEngine, module_device
from zerodp.engine.compiled import unwrap_compiled
from zerodp.engine.config import EngineConfig, MixedPrecision
from zerodp.engine.optimizer_plan import OptimizerFactory


def engine_class(stage: int) -> type[StageEngine]:
    """The engine class of a stage (stage 3 is imported only when asked for)."""
    if stage == 0:
        from zerodp.engine.ddp import DDPEngine

        return DDPEngine
    if stage == 1:
        from zerodp.engine.zero1 import ZeRO1Engine

        return ZeRO1Engine
    if stage == 2:
        from zerodp.engine.zero2 import ZeRO2Engine

        return ZeRO2Engine
    if stage == 3:
        from zerodp.engine.fsdp import FSDPEngine

        return FSDPEngine
    raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0 (DDP), 1, 2 or 3 (FSDP)")


#: torch DDP's keyword arguments a ported wrap line may keep (docs/porting.md, "From DDP"): renamed
#: to this engine's option, accepted as what the engine does anyway (with the values that say so),
#: or refused in one line
DDP_RENAMED = {"bucket_cap_mb": "bucket_mb", "process_group": "group"}
DDP_ACCEPTED = {"dim": (0,), "init_sync": (True,), "check_reduction": (False, True),
                "gradient_as_bucket_view": (False, True), "static_graph": (False, True),
                "batched_grad_copy": (False, True), "forward_sync_buffers": (None, True),
                "skip_all_reduce_unused_params": (False,), "delay_all_reduce_named_params": (None,),
                "param_to_hook_all_reduce": (None,), "bucket_cap_mb_list": (None,)}
DDP_WHY = {"dim": "each rank's batch is its own input, split along no dimension",
           "init_sync": "every rank starts from rank 0's values, as DDP's default",
           "forward_sync_buffers": "buffers follow broadcast_buffers",
           "skip_all_reduce_unused_params": "unused parameters follow find_unused_parameters",
           "bucket_cap_mb_list": "buckets are sized by bucket_mb and first_bucket_mb"}


def _device_index(value) -> int | str | None:
    """``cuda:1``, ``torch.device("cuda", 1)`` or ``1`` as DDP reads ``device_ids`` entries."""
    if value is None or isinstance(value, int):
        return value
    device = torch.device(value)
    return device.index if device.type != "cpu" else "cpu"


def ddp_arguments(model: nn.Module, options: dict, group):
    """``DDP(model, device_ids=[i], bucket_cap_mb=25, ...)``'s keywords kept in a wrap line changed
    to ``zerodp.parallelize``: the same meaning, or one line saying what to change. Returns the
    options and the group with DDP's names taken out."""
    for ddp_name, ours in DDP_RENAMED.items():
        if ddp_name not in options:
            continue
        value = options.pop(ddp_name)
        if ours == "group":
            if group is not None and value is not group:
                raise TypeError("parallelize got both group= and DDP's process_group=: pass one")
            group = value
        elif ours in options:
            raise TypeError(f"parallelize got both {ours}= and DDP's {ddp_name}=: pass one")
        elif value is not None:
            options[ours] = value
    mesh = options.pop("device_mesh", None)
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"device_mesh with {mesh.ndim} dimensions: DDP takes a 1-D mesh; for replicas of "
                             "shard groups pass shard_size=g (docs/porting.md, HSDP)")
        group = mesh.get_group()
    for name, allowed in DDP_ACCEPTED.items():
        if name in options and options.pop(name) not in allowed:
            why = DDP_WHY.get(name, "DDP's option has no counterpart in this engine")
            raise ValueError(f"{name}= (a torch DDP option) other than {allowed[0]!r}: {why}; drop it")
    ids, out = options.pop("device_ids", None), options.pop("output_device", None)
    if ids is None and out is None:
        return options, group
    device = module_device(model)
    here = device.index if device.type != "cpu" else "cpu"
    if ids is not None and device.type == "cpu":
        raise ValueError(f"device_ids={ids!r} with the model on the CPU: DDP takes device_ids only for a model on "
                         "one accelerator; drop device_ids (the engine runs where the model's parameters are)")
    if ids is not None and [_device_index(i) for i in ids] != [here]:
        raise ValueError(f"device_ids={ids!r} but the model's parameters are on {device}: move the model to the "
                         "rank's device first (model.to(device)), or drop device_ids")
    if out is not None and _device_index(out) != here:
        raise ValueError(f"output_device={out!r}: the engine returns the module's outputs where the module puts "
                         f"them ({device}); drop output_device")
    # gradient_as_bucket_view, static_graph: the gradients are views of the buckets already, and the
    # engine follows each backward's graph: either value means what the engine does
    return options, group


def parallelize(model: nn.Module, optimizer: OptimizerFactory | None = None, stage: int = 0,
                mixed_precision: "str | MixedPrecision | None" = None,
                units: list[nn.Module] | None = None, group: dist.ProcessGroup | None = None,
                **options) -> StageEngine:
    """Wrap ``model`` for data-parallel training at the given ZeRO ``stage``.

    ``optimizer(param_groups)`` must build a ``torch.optim`` optimizer over the groups it is given
    (the engine's fp32 master tensors): an elementwise one runs on flat 1/N slices, a per-tensor one
    (Muon, Adafactor; or any declared with ``optimizer_layout="owner"``) on whole tensors owned by
    one rank each (guide §12.3, ``EngineConfig.optimizer_layout``). ``optimizer`` may instead be an
    optimizer the script built over ``model.parameters()``, or a list of them over disjoint
    parameters (``[Muon(matrices), AdamW(the rest)]``): each is rebuilt, with its class, defaults
    and param groups, over the master, and ``engine.optimizer`` steps them as one. ``optimizer=None``: the
    script builds its own over ``model.parameters()`` after the wrap, as a DDP script does, and the
    engine adopts it at its first ``step()`` (:mod:`zerodp.engine.adopt`). ``mixed_precision``: None (fp32),
    ``"bf16"`` or a :class:`MixedPrecision`. ``units``: FSDP units for stage 3 (e.g.
    ``list(model.blocks)``). Other keyword options are :class:`EngineConfig` fields
    (``bucket_mb``, ``sync``, ``find_unused_parameters``, ``average_by_tokens``, ``param_groups``,
    ``reduce_every_microbatch``, ...).

    ``bucket_mb="auto"`` (stages 0-2, guide §4) picks the bucket size at the simulator's sweet spot
    for this model on this machine, once, from a calibration profile::

        engine = zerodp.parallelize(model, optimizer=..., stage=2, bucket_mb="auto",
                                    profile="profile.json", tokens_per_rank=8 * 1024)
        engine.config.bucket_mb, engine.bucket_auto   # e.g. (5.36, True)

    ``profile``: a path written by ``zerodp calibrate`` on as many ranks as this process group (or
    the loaded dict, or its ``calibration`` table); ``tokens_per_rank``: micro-batch × sequence
    length per rank. Without either, or with a profile of another world size, ``ValueError``
    says what to pass. Stage 3 has no gradient buckets: "auto" is accepted and ignored there.
    See :class:`EngineConfig` and :func:`zerodp.plan.calibrated.choose_bucket_mb`.

    ``model`` may be compiled: ``torch.compile(model)`` (then compiled in place with the same
    options, so every stored name is the model's own), ``model.compile()``; or compile the engine,
    ``torch.compile(engine)``. The engine's hooks run outside the graphs (docs/engine.md, "torch.compile").
    """
    options, group = ddp_arguments(model, options, group)
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"stage", "mixed_precision"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"parallelize got unknown option(s) {unknown}; known options: {sorted(known)}")
    config = EngineConfig(stage=stage, mixed_precision=MixedPrecision.parse(mixed_precision), **options)
    model = unwrap_compiled(model)  # torch.compile(model): compiled in place, so names stay plain
    return engine_class(stage)(model, optimizer, config, units=units, group=group)
