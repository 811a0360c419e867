"""Deferred initialization: a model built on the meta device, materialized by the engine.

Guide §9.3: ZeRO-3 exists for models that do not fit on one rank, so such a model cannot first
be built whole on every rank. Build it under ``with torch.device("meta"):`` — shapes and dtypes,
no storage — and :func:`zerodp.parallelize` materializes only what each rank keeps:

- stages 0-2 keep every parameter on every rank anyway: the whole module is allocated on the
  engine's device and initialized, then packed into buckets as usual;
- stage 3 goes unit by unit (guide §10.3): a unit's parameters are allocated, initialized,
  copied into its flat buffer, sliced to this rank's shard and dropped before the next unit, so
  at most one unit is ever whole on a rank besides its shards.

Each module that owns parameters or buffers is initialized by its own ``reset_parameters()``
(every ``torch.nn`` layer has one), then by ``init_fn(module)`` when given (e.g. a Hugging Face
model's ``model._init_weights``, or GPT-2's normal(0, 0.02)); when weights are loaded afterwards
with :func:`zerodp.engine.hf.load_hf` nothing else is needed. The random generator is seeded per module, from
``init_seed`` and the module's name — not from the rank — so the values do not depend on the
world size, the stage or the unit plan: a run can be resumed or re-run at another world size and
start from the same weights (the tests check world 2 stage 3 against world 3 stage 1, bitwise).
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

InitFn = Callable[[nn.Module], None]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def init_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a meta model is materialized: the current CUDA device under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def module_seed(init_seed: int, name: str) -> int:
    """The generator seed of module ``name`` (its fully qualified name): the same on every rank,
    at every world size and stage."""
    return (init_seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def owners(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters or buffers directly, in registration order."""
    return [(name, m) for name, m in root.named_modules()
            if any(p is not None for p in m._parameters.values()) or any(b is not None for b in m._buffers.values())]


def initialize(modules: Iterable[tuple[str, nn.Module]], init_fn: InitFn | None, init_seed: int,
               device: torch.device) -> None:
    """Run each module's initializer under its own seed (guide §9.3, deferred initialization)."""
    devices = [device] if device.type == "cuda" else []
    for name, m in modules:
        reset = getattr(m, "reset_parameters", None)
        if reset is None and init_fn is None:
            if any(p is not None for p in m._parameters.values()):
                raise ValueError(
                    f"module {name or 'root'!r} ({type(m).__name__}) was built on the meta device and has no "
                    "reset_parameters() to initialize its parameters: pass init_fn=... to parallelize "
                    "(a function of one module, e.g. model._init_weights), or load weights afterwards "
                    "with init_fn=lambda m: None")
            continue  # buffers only: nothing to draw; to_empty gave them storage
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(module_seed(init_seed, name))
            if device.type == "cuda":
                torch.cuda.manual_seed(module_seed(init_seed, name))
            with torch.no_grad():
                if reset is not None:
                    reset()
                if init_fn is not None:
                    init_fn(m)


def allocate(param: nn.Parameter, device: torch.device) -> None:
    """Give a meta parameter uninitialized storage on ``device``, keeping the Python object (the
    engine, the optimizer and hooks hold it): ``torch.utils.swap_tensors`` with a real one."""
    if param.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty_like(param, device=device),
                                                     requires_grad=param.requires_grad))


def allocate_buffers(root: nn.Module, device: torch.device) -> None:
    for m in root.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)


@torch.no_grad()
def materialize_module(root: nn.Module, device: torch.device, init_fn: InitFn | None, init_seed: int) -> None:
    """Stages 0-2: allocate the whole model on ``device`` and initialize every owner module."""
    for p in root.parameters():
        allocate(p, device)
    allocate_buffers(root, device)
    initialize(owners(root), init_fn, init_seed, device)


@torch.no_grad()
def materialize_buffers(root: nn.Module, device: torch.device, init_fn: InitFn | None, init_seed: int,
                        param_owners: set[int]) -> None:
    """Stage 3, before the units: every buffer gets storage; modules that own buffers but no
    parameters are initialized now (the others with their unit)."""
    allocate_buffers(root, device)
    initialize([(n, m) for n, m in owners(root) if id(m) not in param_owners], init_fn, init_seed, device)


@torch.no_grad()
def materialize_params(params: list[nn.Parameter], modules: list[tuple[str, nn.Module]], device: torch.device,
                       init_fn: InitFn | None, init_seed: int) -> None:
    """Stage 3, one unit: allocate its parameters and initialize the modules that own them."""
    for p in params:
        allocate(p, device)
    initialize(modules, init_fn, init_seed, device)
