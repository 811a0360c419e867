"""Standard state dicts for every stage, keyed by the model's own parameter and buffer names.

The engine keeps a model's state in flat buffers, sharded 1/N at stages 1-3 (guide §12.1), with
fp32 master values and optimizer states beside them (guide §12.3). Checkpoints of the engine's
own format are :class:`~zerodp.engine.master.Piece` s; this module offers the two shapes the rest
of the PyTorch world expects instead:

``state_dict(engine)``
    ``{name: tensor}`` as ``module.state_dict()`` gives it: every parameter (trainable or frozen)
    as its fp32 master value and every persistent buffer (floating-point ones as fp32), under the
    model's own names. A weight tied to another one (``head.weight = tok_emb.weight``) appears
    under both of its names, as the *same* tensor object, exactly as ``module.state_dict()`` lists
    it, so that a plain copy of the model loads the dict with ``load_state_dict(strict=True)``.
    (Writers that refuse shared memory, such as safetensors, need a ``.clone()`` per key.)
``optimizer_state_dict(engine)``
    ``{"state": {name: {"step": tensor, "exp_avg": tensor shaped like the parameter, ...}},
    "param_groups": [{...options..., "params": [names]}]}`` — the layout of
    ``torch.optim.Optimizer.state_dict()`` with parameter names in place of indices, so it does
    not depend on the stage, the world size, or the order in which an optimizer was built.

Both are built by gathering (collective: every rank must call), and both load at any stage and
world size: each rank copies the part it holds through ``engine.load_state_pieces`` (guide
§12.1: the layout says who owns which elements).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import namedtuple
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from zerodp.engine.control import (FULL_GRAD_DICT, FULL_STATE_DICT, LOAD_OPTIMIZER_STATE_DICT, LOAD_STATE_DICT,
                                OPTIMIZER_STATE_DICT, SCALAR_STATE, STATE_DICT, user_call)
from zerodp.engine.group import FROZEN
from zerodp.engine.master import OWNER, PARAM, Piece, Target, whole_name
from zerodp.engine.optimizer_plan import UserGroups

#: The engine whose calls the functions below are: zerodp.engine.base.StageEngine, which imports this module
Engine = Any


BUFFER = "buffer"  # the piece kind of a module buffer (zerodp.engine.base.BUFFER)

#: What ``load_state_dict`` returns, as ``torch.nn.Module.load_state_dict`` does.
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


# ---- names -----------------------------------------------------------------------------------
class _Names:
    """The model's state-dict keys, which of them are tied aliases, and every expected shape."""

    def __init__(self, engine: Engine):
        # names, shapes and identities only: no wait for parameter gathers in flight (a rank serving
        # a call from inside one of them would wait on itself, zerodp.engine.control)
        module = engine.checkpoint.module
        first: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), name)
        self.params = list(dict.fromkeys(first.values()))  # named_parameters() order, tied once
        self.trainable = [n for n, _ in engine.named_params]
        trainable = set(self.trainable)
        self.frozen = [n for n in self.params if n not in trainable]
        self.buffers = [name for name, _, _ in engine.state_buffers]
        for name, sub, local in engine.state_buffers:
            first.setdefault(id(getattr(sub, local)), name)
        # Every key of module.state_dict(), in its order, with the name it is stored under.
        self.canonical: dict[str, str] = {}
        with engine.checkpoint.module_entries():  # the module's own entries, not the engine's (stage 3's hook)
            entries = module.state_dict(keep_vars=True)
        for key, value in entries.items():
            if torch.is_tensor(value):
                self.canonical[key] = first.get(id(value), key)
        known = set(self.params) | set(self.buffers)
        self.canonical = {k: c for k, c in self.canonical.items() if c in known}
        for name in self.params + self.buffers:  # anything state_dict() did not list (hooks)
            self.canonical.setdefault(name, name)
        self.aliases: dict[str, list[str]] = {}
        for key, name in self.canonical.items():
            self.aliases.setdefault(name, []).append(key)
        # Shapes: at stage 3 a parameter's tensor is empty while its unit is freed, so the flat
        # layouts (pure data) say what it is; frozen parameters at stages 0-2 and buffers are whole.
        self.shapes: dict[str, tuple[int, ...]] = {}
        for layout in engine.layout():
            for slot in layout["slots"]:
                self.shapes[slot["name"]] = tuple(slot["shape"])
        for name, p in module.named_parameters():
            self.shapes.setdefault(name, tuple(p.shape))
        for name, sub, local in engine.state_buffers:
            self.shapes[name] = tuple(getattr(sub, local).shape)

    def lookup(self, state: Mapping[str, Any], name: str) -> Any:
        """The value stored for ``name`` under it or under any of its tied aliases (else None)."""
        for key in self.aliases.get(name, [name]):
            if key in state:
                return state[key]
        return None


#: Name segments that wrappers add to a module's state-dict keys: DDP / DataParallel (``module.``),
#: ``torch.compile`` (``_orig_mod.``), activation-checkpoint wrappers.
WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def plain_name(key: str) -> str:
    """``key`` without the segments wrappers add (``module._orig_mod.blocks.0.w`` → ``blocks.0.w``)."""
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def match_names(keys, known) -> dict:
    """Map each of ``keys`` to the name in ``known`` it means: itself, or the known name with the same
    :func:`plain_name` — so a checkpoint of a DDP-wrapped or compiled model loads into this one, and
    back. Keys that mean nothing here map to themselves."""
    known = list(known)
    plain = {}
    for k in known:
        plain.setdefault(plain_name(k), k)
    known_set = set(known)
    return {k: k if k in known_set else plain.get(plain_name(k), k) for k in keys}


def _agree(engine: Engine, problem: str | None, what: str) -> None:
    """Raise the same error on every rank when any rank found ``problem`` (a rank that raised
    alone would leave the others waiting in the next collective)."""
    problems = [problem]
    if engine.world_size > 1:
        problems = engine.control.all_gather_object(problem)
    for rank, p in enumerate(problems):
        if p:
            where = f" (rank {rank})" if engine.world_size > 1 else ""
            raise ValueError(f"{what}{where}: {p}")


def _listed(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def _held_pieces(engine: Engine) -> dict[tuple[str, str, int, int], torch.Tensor]:
    """This rank's master values and optimizer states as they are now, keyed like ``read``'s
    arguments (views: reading one back and copying it onto itself changes nothing)."""
    return {(p.name, p.kind, p.start, p.stop): p.tensor for p in engine.master.pieces()}


def _flat(value: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return value.detach().reshape(-1).to(device=device, dtype=dtype)


@torch.no_grad()
def _load_frozen(engine: Engine, values: dict[str, torch.Tensor]) -> None:
    """Copy frozen parameters from ``values`` (full tensors by name) into what this rank holds:
    its part of a flat group's fp32 master where they live there (stage 3; published by
    ``load_state_pieces`` afterwards), else the module's own tensor (in its compute dtype)."""
    if not values:
        return
    done = engine.checkpoint.load_frozen_pieces(
        lambda name, a, b: _flat(values[name], engine.device, engine.dtypes.master)[a:b], set(values))
    params = dict(engine.module.named_parameters())
    for name, value in values.items():
        if name not in done:
            p = params[name]
            p.copy_(value.detach().reshape(p.shape).to(device=p.device, dtype=p.dtype))


# ---- model state -------------------------------------------------------------------------------
def replicated_model(engine: Engine) -> bool:
    """Every rank holds every value of the model's state dict, as it is saved: stage 0 (the fp32
    master replicated), and stages 1-2 whose parameters are the master's values (fp32 compute,
    no int8 parameter gathers) — so the model's state dict is local, as DDP's is."""
    if engine.stage == 0:
        return True
    return (engine.stage in (1, 2) and engine.dtypes.param == engine.dtypes.master
            and not engine.config.quantize_params)


def replicated_optimizer(engine: Engine) -> bool:
    """Every rank holds every optimizer state whole: stage 0 (as DDP's optimizer)."""
    return engine.stage == 0


@user_call(STATE_DICT, local=replicated_model)
@torch.no_grad()
def state_dict(engine: Engine, *, rank0_only: bool = False, cpu_offload: bool = False,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Collective: the model's parameters and persistent buffers by name, as full tensors.

    Parameters are the fp32 master values (guide §12.3; frozen ones as the engine holds them:
    fp32 at stage 3, the compute dtype widened to fp32 at stages 0-2), buffers rank 0's values
    (floating-point ones as fp32). Keys and their order are those of ``module.state_dict()``; a
    tied weight appears under each of its names as one tensor object. Every rank gathers the
    whole model (guide §12.1); with ``rank0_only`` the other ranks then return ``{}``.
    ``cpu_offload`` moves the tensors to the CPU, ``dtype`` casts the floating-point ones.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r}: give a floating-point torch.dtype such as torch.bfloat16, or None for fp32")
    full = engine.checkpoint.full_values(local=not engine.control.in_call)
    names = _Names(engine)
    if rank0_only and engine.rank != 0:
        return {}
    converted: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, name in names.canonical.items():
        if name not in full:
            continue
        if name not in converted:
            t = full[name]
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            converted[name] = t.cpu() if cpu_offload else t
        out[key] = converted[name]
    return out


@user_call(LOAD_STATE_DICT)
@torch.no_grad()
def load_state_dict(engine: Engine, state: Mapping[str, torch.Tensor], *,
                    strict: bool = True) -> IncompatibleKeys:
    """Collective: load parameters and buffers by name; each rank copies the part it holds.

    ``state`` is what :func:`state_dict` or a plain module's ``state_dict()`` returns (any dtype,
    any device; a tied weight may be given under any of its names). Every rank must pass the
    whole dict. Optimizer states are left as they are. Returns ``(missing_keys,
    unexpected_keys)`` as ``torch.nn.Module.load_state_dict`` does; with ``strict`` any of them
    is an error on every rank, before anything is changed.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"load_state_dict expects a dict of tensors by name, got {type(state).__name__}")
    names = _Names(engine)
    renamed = match_names(state, names.canonical)
    state = {renamed[k]: v for k, v in state.items()}
    missing = [key for key, name in names.canonical.items() if names.lookup(state, name) is None]
    unexpected = [key for key in state if key not in names.canonical]
    problems = []
    if strict and (missing or unexpected):
        problems.append(f"missing keys [{_listed(missing)}], unexpected keys [{_listed(unexpected)}]; "
                        "pass strict=False to load only the keys that match")
    values: dict[str, torch.Tensor] = {}
    for name in names.params + names.buffers:
        value = names.lookup(state, name)
        if value is None:
            continue
        if not torch.is_tensor(value):
            problems.append(f"{name!r} holds a {type(value).__name__}, not a tensor")
        elif value.numel() != _numel(names.shapes[name]) or (
                value.dim() > 0 and tuple(value.shape) != names.shapes[name]):
            problems.append(f"{name!r} has shape {tuple(value.shape)}, the model's is {names.shapes[name]}")
        else:
            values[name] = value
    _agree(engine, "; ".join(problems) or None, "load_state_dict: the state dict does not fit this model")

    held = _held_pieces(engine)
    device = engine.device

    def read(name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        if kind == BUFFER:
            if name in values:
                return values[name].detach().reshape(-1)[start:stop]
            sub, local = next((s, loc) for n, s, loc in engine.state_buffers if n == name)
            return getattr(sub, local).detach().reshape(-1)[start:stop].clone()
        if kind == PARAM and name in values:
            return values[name].detach().reshape(-1)[start:stop].to(device=device, dtype=engine.dtypes.master)
        return held[(name, kind, start, stop)]  # kept as it is (optimizer states, missing keys)

    _load_frozen(engine, {n: values[n] for n in names.frozen if n in values})
    engine.checkpoint.load_state_pieces(read)
    if engine.outer is not None:  # new weights: the outer loop starts again from them (guide §16)
        engine.outer.restart()
    return IncompatibleKeys(missing, unexpected)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- optimizer state ---------------------------------------------------------------------------
def _stepped_names(engine: Engine) -> set[str]:
    """Collective: the parameters with optimizer state on any rank (one never stepped has none)."""
    opt_state = engine.master.optimizer.state
    mine: set[str] = set()
    for t in engine.master.targets + engine.master.proxies:
        if opt_state.get(t.tensor):
            if t.name is not None:
                mine.add(t.name)
            else:
                start = t.flat_start
                mine.update(sp.slot.name for sp in t.layout.spans(start, start + t.tensor.numel()))
    if engine.world_size > 1 and engine.stage > 0:
        mine = {n for names in engine.control.all_gather_object(sorted(mine)) for n in names}
    return mine


def _scalar_tensor(value: float) -> torch.Tensor:
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(value, dtype=dtype)


def _group_options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


@user_call(OPTIMIZER_STATE_DICT, local=replicated_optimizer)
@torch.no_grad()
def optimizer_state_dict(engine: Engine, *, rank0_only: bool = False,
                         cpu_offload: bool = False) -> dict:
    """Collective: the optimizer's state by parameter name, in ``torch.optim``'s layout.

    ``{"state": {name: {scalar: 0-d tensor, ..., kind: fp32 tensor shaped like the parameter}},
    "param_groups": [{...options..., "params": [names]}]}``: per-element states (Adam's
    ``exp_avg``, ``exp_avg_sq``) gathered from every rank's shard into full tensors (guide §12.3),
    scalars (``step``) from the rank that holds the parameter. A parameter the optimizer has
    never stepped (no rank used it yet) has no entry in ``state``; frozen parameters are in no
    group. With ``rank0_only`` the other ranks return ``{}`` after taking part in the gathers.
    """
    master = engine.master
    scalars = engine.checkpoint.scalar_state()  # collective
    kinds = list(scalars.get("kinds", []))
    stepped = _stepped_names(engine)  # collective
    full_kinds: dict[str, dict[str, torch.Tensor]] = {}
    for kind in kinds:  # one gather per kind, every rank in the same order
        values = []
        for t in master.targets:
            v = master.optimizer.state.get(t.tensor, {}).get(kind)
            values.append(v if torch.is_tensor(v) and v.shape == t.tensor.shape else torch.zeros_like(t.tensor))
        full_kinds[kind] = engine.checkpoint._gather_full(values)
    whole = _gather_whole_states(engine)  # collective; Adafactor's row/column factors
    param_kinds = scalars.get("param_kinds", {})
    if rank0_only and engine.rank != 0:
        return {}

    per_param = scalars.get("params")
    group_scalars = scalars.get("groups", [])
    group_of = engine.optimizer_plan.group_by_name
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, _ in engine.named_params:
        if name not in stepped:
            continue
        saved = per_param.get(name) if per_param is not None and name in per_param else None
        if saved is None:
            g = group_of[name]
            saved = group_scalars[g] if g < len(group_scalars) and group_scalars[g] else {}
        entry = {k: _scalar_tensor(v) for k, v in saved.items()}
        for kind in param_kinds.get(name, kinds):
            value = full_kinds[kind][name]
            entry[kind] = value.cpu() if cpu_offload else value
        for kind, value in whole.get(name, {}).items():
            entry[kind] = value.cpu() if cpu_offload else value.to(engine.device)
        state[name] = entry
    groups = []
    for g, group in enumerate(master.optimizer.param_groups):
        groups.append({**_group_options(group),
                       "params": [n for n, _ in engine.named_params if group_of[n] == g]})
    return {"state": state, "param_groups": groups}


def _gather_whole_states(engine: Engine) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: every parameter's states kept whole by one rank (shaped unlike the parameter:
    Adafactor's ``row_var``/``col_var``; every state of a tensor stage 3 steps whole on its owner,
    :mod:`zerodp.engine.exchange`), by name, from that rank (the ownership path; {} on the flat
    path, where there are none)."""
    master = engine.master
    if getattr(master, "placement", None) != OWNER:
        return {}
    mine = {n: {k: v.detach().cpu().clone() for k, v in states.items()} for n, states in master.owner_states().items()}
    if engine.world_size > 1 and engine.stage > 0:
        for other in engine.control.all_gather_object(mine):
            for name, states in other.items():
                mine.setdefault(name, states)
    return mine


@user_call(LOAD_OPTIMIZER_STATE_DICT)
@torch.no_grad()
def load_optimizer_state_dict(engine: Engine, state: Mapping) -> None:
    """Collective: load an :func:`optimizer_state_dict` saved at any stage and world size.

    Every rank must pass the whole dict. The param groups must hold the same parameter names as
    this engine's (their options — lr, betas, weight decay — are taken from ``state``, as
    ``torch.optim.Optimizer.load_state_dict`` does). Each rank creates its state (zeros and the
    scalars, ``engine.load_scalar_state``), then reads the elements it holds from the full
    tensors (``engine.load_state_pieces``); parameters and buffers are left as they are.
    """
    if not isinstance(state, Mapping) or not isinstance(state.get("state"), Mapping) \
            or not isinstance(state.get("param_groups"), (list, tuple)):
        raise ValueError("load_optimizer_state_dict expects {'state': {name: {...}}, 'param_groups': [...]}, as "
                         "engine.optimizer_state_dict() returns")
    names = _Names(engine)
    optimizer = engine.master.optimizer
    group_of = dict(zip(names.trainable, engine.optimizer_plan.group_of))
    listed = [n for g in state["param_groups"] if isinstance(g, Mapping) for n in g.get("params", [])]
    renamed = match_names(list(state["state"]) + [n for n in listed if isinstance(n, str)], names.canonical)
    saved_state = {names.canonical.get(renamed[k], renamed[k]): v for k, v in state["state"].items()}  # tied: any name
    saved_groups = [{**g, "params": [renamed.get(n, n) if isinstance(n, str) else n for n in g.get("params", [])]}
                    if isinstance(g, Mapping) else g for g in state["param_groups"]]
    owner = getattr(engine.master, "placement", None) == OWNER
    problem = _check_optimizer_state(names, group_of, len(optimizer.param_groups), saved_state, saved_groups,
                                     whole_ok=owner)
    _agree(engine, problem, "load_optimizer_state_dict: the optimizer state does not fit this engine")

    # Per-element kinds: the tensors of dimension >= 1 kept for parameters of dimension >= 1 with
    # the parameter's number of elements; the rest are scalars (a 0-d parameter's states are all
    # 0-d: they follow the others' kinds) or, on the ownership path, whole-tensor states shaped
    # unlike their parameter (Adafactor's row_var/col_var), loaded whole by the owner.
    def elementwise(name, v):
        return torch.is_tensor(v) and v.dim() > 0 and v.numel() == _numel(names.shapes[name])

    whole = {name: {k: tuple(v.shape) for k, v in entry.items()
                    if torch.is_tensor(v) and v.dim() > 0 and not elementwise(name, v)}
             for name, entry in saved_state.items()}
    param_kinds = {name: sorted(k for k, v in entry.items() if names.shapes[name] and elementwise(name, v))
                   for name, entry in saved_state.items()}
    kinds = {k for ks in param_kinds.values() for k in ks}
    if not kinds:  # only 0-d parameters: every tensor state but the step count is per element
        kinds = {k for entry in saved_state.values() for k, v in entry.items() if torch.is_tensor(v) and k != "step"}
    for name in param_kinds:
        if not names.shapes[name]:
            param_kinds[name] = sorted(k for k in kinds if k in saved_state[name])
    params = {name: {k: float(v) for k, v in entry.items() if k not in kinds and k not in whole[name]}
              for name, entry in saved_state.items()}
    # Engines whose targets span several parameters (stages 0-2 when every parameter is used in
    # every step) keep one set of scalars per param group: the first stepped parameter's.
    groups: list[dict | None] = [None] * len(optimizer.param_groups)
    uneven = []
    for name in names.trainable:
        g = group_of[name]
        mine = params.get(name)
        if groups[g] is None and mine is not None:
            groups[g] = mine
        elif groups[g] is not None and mine != groups[g]:
            uneven.append(name)
    if uneven and any(t.name is None for t in engine.master.targets):
        warnings.warn(f"the saved optimizer state differs within a param group ({_listed(uneven)} have another "
                      "step count than the first parameter of their group, or none); this engine keeps one per "
                      "group, so they take the first one's. Use find_unused_parameters=True (or stage 3) to keep "
                      "them apart", stacklevel=3)
    for g, group in enumerate(saved_groups):
        optimizer.param_groups[g].update(_group_options(group))

    held = _held_pieces(engine)  # parameters: kept as they are
    device = engine.device
    scalars = {"kinds": sorted(kinds), "groups": groups, "params": params}
    if owner:
        scalars.update(param_kinds=param_kinds,
                       whole={n: {k: list(sh) for k, sh in w.items()} for n, w in whole.items()})
    engine.checkpoint.load_scalar_state(scalars)
    whole_by_piece = {whole_name(n, k): (n, k) for n, w in whole.items() for k in w}

    def read(name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        if kind == BUFFER:
            sub, local = next((s, loc) for n, s, loc in engine.state_buffers if n == name)
            return getattr(sub, local).detach().reshape(-1)[start:stop].clone()
        if kind == PARAM:
            return held[(name, kind, start, stop)]
        if name in whole_by_piece:  # a whole-tensor state, read by its owner
            param, state_kind = whole_by_piece[name]
            return saved_state[param][state_kind].detach().reshape(-1)[start:stop].to(device=device,
                                                                                    dtype=engine.dtypes.master)
        value = saved_state.get(name, {}).get(kind)
        if value is None:  # never stepped, or a state this parameter lacks: fresh zeros
            return torch.zeros(stop - start, dtype=engine.dtypes.master, device=device)
        return value.detach().reshape(-1)[start:stop].to(device=device, dtype=engine.dtypes.master)

    engine.checkpoint.load_state_pieces(read)


def _check_optimizer_state(names: _Names, group_of: dict[str, int], n_groups: int, saved_state: Mapping,
                           saved_groups: list, whole_ok: bool = False) -> str | None:
    """What is wrong with an optimizer state dict for this engine, in one line (None if nothing)."""
    if len(saved_groups) != n_groups:
        return (f"it has {len(saved_groups)} param groups, this engine has {n_groups}: build the engine with the "
                "same param_groups rule as the one that saved it")
    trainable = set(names.trainable)
    for g, group in enumerate(saved_groups):
        listed = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(listed, (list, tuple)) or any(not isinstance(n, str) for n in listed):
            return (f"param group {g} does not list parameter names (a torch optimizer's own state_dict lists "
                    "indices): save it with engine.optimizer_state_dict(), which keys by name")
        expected = {n for n in names.trainable if group_of[n] == g}
        # a tied weight may be listed under another of its names
        got = {names.canonical.get(n, n) for n in listed}
        if got != expected:
            extra, lacking = sorted(got - expected), sorted(expected - got)
            return (f"param group {g} lists other parameters than this engine's group {g} (not in the engine's group: "
                    f"[{_listed(extra)}]; missing: [{_listed(lacking)}]): build the model and param_groups as "
                    "when it was saved")
    unknown = [n for n in saved_state if n not in trainable]
    if unknown:
        return (f"state for parameters this engine does not train: [{_listed(unknown)}] (frozen, renamed, or of "
                "another model)")
    for name, entry in saved_state.items():
        if not isinstance(entry, Mapping):
            return f"state[{name!r}] is a {type(entry).__name__}, not a dict of the parameter's states"
        numel = _numel(names.shapes[name])
        for k, v in entry.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.numel() != numel and not whole_ok:
                return (f"state[{name!r}][{k!r}] has {v.numel()} elements, the parameter has {numel} "
                        f"(shape {names.shapes[name]}): a state shaped unlike its parameter (Adafactor's factors) "
                        "loads only on the tensor-ownership path (optimizer_layout='owner')")
    return None


# ---- the engine's side of the contract ------------------------------------------------------------
class CheckpointContract:
    """The checkpoint contract of a stage engine, one part of it (``engine.checkpoint``): the
    pieces each rank saves and loads, the optimizer's scalars, full tensors gathered from the
    shards, the flat layout as data. The standard state dicts by name (the functions above) are
    built on it; the engine's ``state_dict`` and friends call them."""

    def __init__(self, module: torch.nn.Module, named_params: list, *, stage: int, policy, dtypes, device,
                 control, shard_comm, replica_comm, machine, outer, construction, state_buffers: list,
                 take_values: Callable[[bool], None]):
        self.module = module  # the model, read without waiting for parameter gathers (see _Names)
        self.named_params = named_params
        self.stage, self.policy, self.dtypes, self.device = stage, policy, dtypes, device
        self.control = control  # user_call: the calls below are named and bounded
        self.rank, self.world_size = control.rank, control.world_size
        self.shard_comm, self.replica_comm = shard_comm, replica_comm
        self.machine = machine  # the step machine: the groups, the optimizer part (machine.master)
        self.outer = outer  # the DiLoCo outer loop (zerodp.engine.outer), or None
        self.construction = construction  # rank 0's values broadcast
        self.state_buffers = state_buffers
        self.take_values = take_values  # the module's own values taken back (the engine's take_module_values)
        self.raw_module_state = False  # module.state_dict() gives its own entries (module_entries)

    @contextlib.contextmanager
    def module_entries(self) -> Iterator[None]:
        """Inside, ``module.state_dict()`` lists the module's own entries — stage 3's placeholders —
        instead of the full values its hook puts there (:meth:`zerodp.engine.fsdp.UnitHooks.module_state_dict`)."""
        self.raw_module_state = True
        try:
            yield
        finally:
            self.raw_module_state = False

    def state_pieces(self) -> list[Piece]:
        """The master values and optimizer states this rank saves: disjoint across ranks, and
        together they cover every element of every parameter (padding excluded)."""
        self.machine.finish_grad_sync()
        pieces = self.machine.master.pieces(ranges=self._owned_range)
        outer = self.outer
        if outer is not None:  # each replica group's own inner state, and the outer state (guide §16)
            pieces = outer.replica_pieces(pieces) + outer.pieces()
        if self.rank == 0:  # buffers: rank 0's values, as broadcast to every rank
            for name, sub, local in self.state_buffers:
                buf = getattr(sub, local)
                pieces.append(Piece(name, BUFFER, 0, buf.numel(), tuple(buf.shape), buf.detach().reshape(-1)))
        return pieces

    def load_state_pieces(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Fill master values and optimizer states from ``read(name, kind, start, stop)``, then
        publish the parameters (collective for sharded stages). Call ``load_scalar_state`` first."""
        self.machine.finish_grad_sync()
        self.take_values(fold=True)  # a rebound p.data is taken back before it is overwritten
        self.machine.wait_params()
        outer = self.outer
        self.machine.master.load_pieces(read if outer is None else outer.replica_read(read))
        if outer is not None:
            outer.load_pieces(read)  # θ_outer, momentum, step count: when the scalars loaded held them
        self.machine.publish_params()
        self.machine.wait_params()
        self._load_buffers(read)

    @torch.no_grad()
    def load_frozen_pieces(self, read: Callable[[str, int, int], torch.Tensor], names: set[str]) -> set[str]:
        """Frozen parameters that live in a flat group's fp32 master (stage 3 keeps them in its
        units' shards, outside the optimizer's pieces): fill this rank's part of each from
        ``read(name, start, stop)`` (flattened elements) for those in ``names``;
        ``load_state_pieces`` then publishes them. Returns the names so handled."""
        done: set[str] = set()
        for g in self.machine.groups:
            if FROZEN not in g.groups:
                continue
            lo = g.master_start
            hi = lo + g.master.numel()
            for slot, grp in zip(g.layout.slots, g.groups):
                if grp != FROZEN or slot.name not in names:
                    continue
                done.add(slot.name)
                a, b = max(slot.offset, lo), min(slot.stop, hi)
                if a < b:
                    g.master[a - lo:b - lo].copy_(read(slot.name, a - slot.offset, b - slot.offset).reshape(-1))
        return done

    @torch.no_grad()
    def _load_buffers(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Every rank reads every buffer (checkpoints written before buffers were saved hold
        none: the model's buffers are then left as they are, with a warning)."""
        missing = []
        for name, sub, local in self.state_buffers:
            buf = getattr(sub, local)
            try:
                src = read(name, BUFFER, 0, buf.numel())
            except Exception:  # noqa: BLE001 - absent from this checkpoint
                missing.append(name)
                continue
            buf.copy_(src.reshape(buf.shape))
        if missing:
            warnings.warn(f"the checkpoint holds no values for the buffers {missing}; they keep "
                          "their current values", stacklevel=3)

    @user_call(SCALAR_STATE, local=lambda checkpoint: checkpoint.stage == 0)  # as replicated_optimizer
    def scalar_state(self) -> dict:
        """Collective: the optimizer's scalars (per parameter and per group) from every rank."""
        mine = self.machine.master.scalar_state()
        if self.world_size > 1 and self.stage > 0:
            for other in self.control.all_gather_object(mine):
                for name, scalars in other.get("params", {}).items():
                    mine["params"].setdefault(name, scalars)
                for g, scalars in enumerate(other["groups"]):
                    if scalars and not mine["groups"][g]:
                        mine["groups"][g] = scalars
                mine["kinds"] = sorted(set(mine["kinds"]) | set(other["kinds"]))
                for key in ("param_kinds", "whole"):  # the ownership path: each from its owner
                    if key in other:
                        for name, value in other[key].items():
                            mine.setdefault(key, {}).setdefault(name, value)
        if self.outer is not None:
            mine["outer"] = self.outer.scalars()
        return {"stage": self.stage, **mine}

    def load_scalar_state(self, scalars: dict) -> None:
        """The optimizer's scalars (and the outer loop's, checked before anything is loaded)."""
        scalars = dict(scalars)
        outer = scalars.pop("outer", None)
        if outer is not None and self.outer is not None:
            self.outer.load_scalars(outer)
        self.machine.master.load_scalar_state(scalars)

    def _owned_range(self, target: Target) -> tuple[int, int]:
        """Flat range of ``target.layout`` whose state this rank saves: slice r of stage 0's
        replicas, everything a sharded rank holds — on the first replica only under hybrid
        sharding (the others hold the same shards), so that saved pieces are disjoint."""
        if not self.policy.shard_master:
            return target.layout.shard_range(self.shard_comm.rank)
        if self.replica_comm is not None and self.replica_comm.rank > 0:
            return target.flat_start, target.flat_start
        return target.flat_start, target.flat_start + target.tensor.numel()

    @user_call(FULL_STATE_DICT)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets every parameter as an fp32 tensor (from the master) and
        every persistent buffer (rank 0's values; floating-point ones as fp32); served from a wait
        where another rank makes the call alone (zerodp.engine.control)."""
        return self.full_values(local=False)

    @torch.no_grad()
    def full_values(self, local: bool) -> dict[str, torch.Tensor]:
        """:meth:`full_state_dict`'s values; with ``local`` (``state_dict()`` where every rank holds
        them, :func:`replicated_model`) from this rank alone, its own buffers — as DDP's."""
        control = self.control
        if not local and not control.routed:  # a served call leaves the step's collectives alone
            self.machine.finish_grad_sync()
        if not control.serving:
            self.take_values(fold=True)  # what the script wrote into the module since the step
        if local and self.stage > 0:  # stages 1-2, replicated parameters (replicated_model)
            return self._local_full()
        out = self._gather_full([t.tensor for t in self.machine.master.targets], frozen_from_params=True)
        for name, p in self.module.named_parameters():  # frozen parameters outside the buffers
            if name not in out and p.numel() > 0:
                out[name] = p.detach().to(self.dtypes.master).clone()
        out.update(self._buffer_dict())
        return out

    @user_call(FULL_GRAD_DICT)
    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the averaged gradient the next ``step`` would apply, as
        fp32 tensors by parameter name (gathered from the shards; for inspection and tests)."""
        self.machine.finish_grad_sync()
        grads = self.machine.master_grads()
        return self._gather_full([torch.zeros_like(t.tensor) if g is None else g
                                  for t, g in zip(self.machine.master.targets, grads)])

    def _local_full(self) -> dict[str, torch.Tensor]:
        """The full state dict from this rank's own replica (stages 1-2 with parameters in the
        master's dtype: the published parameters are the master values)."""
        master = self.dtypes.master
        self.machine.wait_params()
        out = {name: p.detach().to(master).clone() for name, p in self.module.named_parameters()}
        out.update(self._buffer_dict())
        return out

    @torch.no_grad()
    def _buffer_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        control = self.control
        for name, sub, local in self.state_buffers:
            buf = getattr(sub, local).detach().clone()
            if not control.in_call or self.world_size == 1:
                pass  # a local state_dict(): this rank's buffers, as DDP's
            elif control.routed:
                control.broadcast_from_rank0(buf)
            else:
                self.construction.broadcast_from_rank0([buf])
            out[name] = buf.to(self.dtypes.master) if buf.is_floating_point() else buf
        return out

    def _gather_full(self, values: list[torch.Tensor], frozen_from_params: bool = False) -> dict[str, torch.Tensor]:
        """Per-target values (aligned with ``master.targets``) → full tensors by parameter name.

        Each flat group is rebuilt from what this rank holds — the whole buffer (stage 0) or its
        shard (stages 1-3), gathered — iterating every group in the same order on every rank,
        whether or not this rank's part holds a target."""
        out: dict[str, torch.Tensor] = {}
        by_group: dict[int, list[int]] = {}
        for i, t in enumerate(self.machine.master.targets):
            by_group.setdefault(id(t.layout), []).append(i)
        sharded = self.policy.shard_master
        for g in self.machine.groups:
            layout = g.layout
            lo, hi = g.shard_range if sharded else (0, layout.padded_numel)
            local = torch.zeros(hi - lo, dtype=self.dtypes.master, device=self.device)
            for i in by_group.get(id(layout), []):
                t = self.machine.master.targets[i]
                local[t.flat_start - lo:t.flat_start - lo + t.tensor.numel()].copy_(values[i].reshape(-1))
            if frozen_from_params:  # frozen parameters of a unit live in its master shard only
                for slot, grp in zip(layout.slots, g.groups):
                    a, b = max(slot.offset, lo), min(slot.stop, hi)
                    if grp == FROZEN and a < b:
                        local[a - lo:b - lo].copy_(g.master[a - lo:b - lo])
            if sharded and g.comm.world_size > 1:
                flat = torch.empty(layout.padded_numel, dtype=self.dtypes.master, device=self.device)
                if self.control.routed:  # a served call: the servers' step collectives are in flight
                    self.control.all_gather_flat(flat, local, g.comm.group)
                else:
                    g.comm.all_gather(flat, local, "gather_full", async_op=False)
            else:
                flat = local
            for slot in layout.slots:
                out[slot.name] = flat[slot.offset:slot.stop].view(slot.shape).clone()
        return out

    def layout(self) -> list[dict]:
        """The flat groups as data: which parameter sits at which offset, padding, owners.

        ``owners``: each rank's slice ``[start, stop)``; on the ownership path each slot also
        names its ``owner`` rank. ``cost``: the placement's price (:meth:`FlatLayout.cost`):
        padding elements and bytes in the compute dtype (what each full-buffer copy — the
        parameters, full gradients, every AllGather and ReduceScatter — carries for nothing), the
        parameter elements in each rank's slice, and the imbalance (largest slice over the mean)
        in elements and in fp32 master bytes."""
        out = []
        for i, g in enumerate(self.machine.groups):
            d = g.layout.to_dict()
            trainable = [grp for grp in g.groups if grp != FROZEN]
            d.update(index=i, label=g.label, group=trainable[0] if trainable else FROZEN, groups=list(g.groups),
                     options=self.machine.master.plan.group_options[trainable[0]] if trainable else None,
                     dtype=str(g.dtypes.param), sharded=self.policy.shard_master,
                     owners=[list(g.layout.shard_range(r)) for r in range(g.comm.world_size)],
                     cost={**g.layout.cost(g.dtypes.param.itemsize),
                           "imbalance_bytes": g.layout.cost(4)["imbalance_bytes"]})
            out.append(d)
        return out

    def layout_cost(self) -> dict:
        """The placement's price over every group (per-group figures in :meth:`layout`): padding
        elements and bytes (compute dtype), this rank's parameter elements and the most any rank
        owns, and the imbalance in fp32 master bytes (the most loaded rank's master over the
        mean's; optimizer states scale with it)."""
        world = self.shard_comm.world_size if self.policy.shard_master else 1
        owned = [0] * world
        padding = padding_bytes = 0
        for g in self.machine.groups:
            c = g.layout.cost(g.dtypes.param.itemsize)
            padding += c["padding"]
            padding_bytes += c["padding_bytes"]
            if self.policy.shard_master:
                owned = [a + b for a, b in zip(owned, c["owned_numel"])]
            else:
                owned[0] += g.layout.numel
        mean = sum(owned) / len(owned)
        out = {"placement": self.machine.master.plan.placement, "padding": padding, "padding_bytes": padding_bytes,
               "owned_numel": owned, "max_owned_numel": max(owned),
               "imbalance_bytes": round((max(owned) - mean) * 4, 3)}
        exchange = getattr(self.machine.master, "exchange", None)
        if exchange is not None:  # stage 3's owner exchange (zerodp.engine.exchange)
            out.update(exchange.cost())
        return out

    def optimizer_index_names(self) -> list[str]:
        """Trainable parameter names in torch's optimizer index order (:mod:`zerodp.engine.optim`)."""
        plan = self.machine.master.plan
        names = [n for n, _ in self.named_params]
        if isinstance(plan.rule, UserGroups):
            by_id = {id(p): n for n, p in self.named_params}
            return [by_id[i] for i in plan.rule.order if i in by_id]
        return [n for g in range(len(plan.group_options)) for n, gi in zip(names, plan.group_of) if gi == g]
