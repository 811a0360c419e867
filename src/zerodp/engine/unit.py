"""FSDP units: which parameters each unit owns (guide §10.3), before any buffer exists.

Guide §9.3: ZeRO-3 keeps only 1/N of the parameters on each rank and AllGathers a layer's
parameters just before it runs, then drops them. Guide §10.3: FSDP does this not per parameter
but per *unit* (usually one transformer block) — the same trade-off as the buckets of §4: small
units mean many collectives, each paying the latency α; big units mean big temporary buffers and
an un-hidden first gather. A unit that is the whole model degenerates to ZeRO-1/2.

This module only plans: :func:`plan_units` assigns every parameter to the innermost unit module
that reaches it. Each planned unit then becomes a :class:`~zerodp.engine.group.FlatGroup` — the
same object a bucket of stages 0-2 is — whose policy shards its parameters too (guide §12.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from zerodp.engine.group import FROZEN


@dataclass(frozen=True)
class UnitSpec:
    """Which parameters one unit owns, before any buffer exists (pure bookkeeping)."""

    name: str  # fully qualified module name; "" for the root unit
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter, int], ...]  # (fqn, parameter, group index or FROZEN)

    @property
    def label(self) -> str:
        return self.name or "root"


def _owner_map(root: nn.Module, unit_modules: list[nn.Module]) -> dict[int, tuple[str, nn.Module]]:
    """Each parameter's owning unit = the innermost unit module that reaches it (guide §10.3).

    Returns ``id(param) -> (unit name, unit module)``. A parameter reached from two different
    units (weights tied across units) is refused: each unit shards and reduces its own flat
    buffer, so a shared parameter would be updated twice with half its gradient each time.
    """
    unit_ids = {id(m) for m in unit_modules}
    owners: dict[int, tuple[str, nn.Module]] = {}
    first_fqn: dict[int, str] = {}

    def walk(module: nn.Module, prefix: str, owner: tuple[str, nn.Module], path: tuple[int, ...]):
        if id(module) in path:  # a module cycle cannot occur in a tree, but guard anyway
            return
        if id(module) in unit_ids:
            owner = (prefix, module)
        for pname, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{prefix}.{pname}" if prefix else pname
            prev = owners.get(id(p))
            if prev is not None and prev[1] is not owner[1]:
                raise ValueError(
                    f"parameter {first_fqn[id(p)]!r} is shared with {fqn!r} but they fall in different "
                    f"FSDP units ({prev[0] or 'root'!r} and {owner[0] or 'root'!r}). Each unit shards "
                    "and reduces its own flat buffer, so a tied weight must live in one unit: put the "
                    "modules that share it in the same unit (e.g. leave both in the root unit), or untie "
                    "the weights."
                )
            owners.setdefault(id(p), owner)
            first_fqn.setdefault(id(p), fqn)
        for cname, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{cname}" if prefix else cname, owner, path + (id(module),))

    walk(root, "", ("", root), ())
    return owners


def default_unit_modules(root: nn.Module) -> list[nn.Module]:
    """The blocks of the model's largest ``nn.ModuleList`` (guide §10.3: one unit per block).

    "Largest" means most parameters (ties: most children, then first found). Returns ``[]`` when
    the model has no ``ModuleList`` with parameters: then the root unit is the whole model.
    """
    best, best_key = None, (0, 0)
    for m in root.modules():
        if isinstance(m, nn.ModuleList):
            key = (sum(p.numel() for p in m.parameters()), len(m))
            if key > best_key:
                best, best_key = m, key
    return [] if best is None else [c for c in best if any(True for _ in c.parameters())]


def plan_units(root: nn.Module, unit_modules: list[nn.Module] | None,
               group_of) -> list[UnitSpec]:
    """Split ``root``'s parameters into units: the given modules plus a root unit for the rest.

    ``group_of(fqn, param) -> int`` gives the parameter group index (ignored for frozen ones).
    Units are returned in module registration order (the root unit, if it owns parameters,
    first); within a unit parameters are ordered by group, frozen ones last, so that each group
    is one contiguous range of the flat buffer and of every shard.
    """
    modules = default_unit_modules(root) if unit_modules is None else list(unit_modules)
    all_modules: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        all_modules.setdefault(id(m), name)
    seen = set()
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"units must be nn.Module objects inside the model, got {type(m).__name__}")
        if id(m) not in all_modules:
            raise ValueError(
                f"unit {type(m).__name__} is not a submodule of the model: pass modules reachable "
                "from the model given to parallelize (e.g. units=list(model.blocks))"
            )
        if id(m) in seen:
            raise ValueError(f"module {all_modules[id(m)]!r} is listed twice in units")
        seen.add(id(m))
    owners = _owner_map(root, modules)
    by_unit: dict[int, list[tuple[str, nn.Parameter, int]]] = {}
    for fqn, p in root.named_parameters():  # deduplicated: a tied parameter appears once
        name, mod = owners[id(p)]
        group = group_of(fqn, p) if p.requires_grad else FROZEN
        by_unit.setdefault(id(mod), []).append((fqn, p, group))
    specs = []
    position = {}
    for i, (_, m) in enumerate(root.named_modules(remove_duplicate=False)):
        position.setdefault(id(m), i)
    ordered = ([root] if id(root) not in seen else []) + modules
    ordered.sort(key=lambda m: position[id(m)])
    for mod in ordered:
        name = all_modules[id(mod)]
        params = by_unit.get(id(mod), [])
        if not params:
            if mod is root:
                continue  # every parameter is inside some unit: no root unit needed
            raise ValueError(
                f"unit {name!r} owns no parameters (all of them belong to nested units or it has "
                "none): drop it from units"
            )
        dtypes = {p.dtype for _, p, _ in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"unit {name or 'root'!r} mixes parameter dtypes {sorted(map(str, dtypes))}: one flat "
                "buffer holds one dtype; cast the model to one dtype (mixed precision is a separate option)"
            )
        order = sorted(range(len(params)), key=lambda i: (params[i][2] == FROZEN, params[i][2], i))
        specs.append(UnitSpec(name, mod, tuple(params[i] for i in order)))
    return specs
