"""PyTorch Distributed Checkpoint (DCP) interop: write what FSDP2 reads, read what FSDP2 writes.

A DCP checkpoint (``torch.distributed.checkpoint``) is a directory with a ``.metadata`` file and
one data file per writing rank, keyed by state-dict names; a reader at any world size asks for
the pieces it needs. The engine's standard state dict (:func:`zerodp.engine.state_dict.state_dict`,
guide §12) uses the model's own names and full tensors, so:

- :func:`save_dcp` writes ``engine.state_dict()`` as a DCP checkpoint with flat keys
  (``"blocks.0.attn.qkv.weight"``), which ``torch.distributed.checkpoint.load`` loads into an
  FSDP2 model (``fully_shard``) of the same architecture at any world size, and which
  ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns into a plain state dict;
- :func:`load_dcp` reads such a checkpoint — written by FSDP2 (``dcp.save(model.state_dict())``,
  also under a prefix such as ``{"model": ...}``) or by :func:`save_dcp` — into an engine at any
  stage and world size;
- :func:`export_dcp` writes a plain ``{name: tensor}`` dict from a single process, with no
  process group (what ``zerodp export`` uses).

Tensors travel whole: every rank holds the full model once while saving or loading (as with
``engine.state_dict()``); DCP's planner then has each key written by one rank only.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from zerodp.engine.control import LOAD_DCP, SAVE_DCP

#: The engine whose calls the functions below are: zerodp.engine.base.StageEngine, which imports this module
Engine = Any

_SINGLE_PROCESS_WARNING = ".*assuming the intent is to (save|load) in a single process.*"


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _check_state(state: Any, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{what} expects a dict of tensors by name (or an engine), got {type(state).__name__}")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise TypeError(f"{what}: every key must be a str and every value a tensor; not so for {bad[:5]!r}")
    return {k: v.detach() for k, v in state.items()}


def _check_dir(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file: a DCP checkpoint is a directory; give a directory path")
    return path


def _is_engine(obj: Any) -> bool:
    return not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)) \
        and hasattr(obj, "checkpoint")


def export_dcp(state: Mapping[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write ``state`` (``{name: tensor}``) as a DCP checkpoint directory from one process.

    No process group is needed (nor used if one exists). Tensors are written as they are (dtype
    and shape), from the CPU. Returns the directory.
    """
    state = {k: v.cpu() for k, v in _check_state(state, "export_dcp").items()}
    path = _check_dir(path)
    path.mkdir(parents=True, exist_ok=True)
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def save_dcp(engine_or_state_dict: Engine | Mapping[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Collective: write the engine's state dict (or the given one) as a DCP checkpoint.

    With an engine every rank must call (the state dict is gathered, guide §12.1) and DCP
    coordinates the ranks of the engine's process group, each key written once. With a dict,
    every rank of the default process group must call with the same keys (or a single process
    without one). Returns the directory.
    """
    path = _check_dir(path)
    group = None
    if _is_engine(engine_or_state_dict):
        group = engine_or_state_dict.group
        control = getattr(engine_or_state_dict, "control", None)
        if control is not None:  # named and bounded on a subset of ranks (the engine's timeout_s)
            with control.call(SAVE_DCP):
                return _save(engine_or_state_dict.state_dict(cpu_offload=True), path, group)
        state = engine_or_state_dict.state_dict(cpu_offload=True)
    else:
        state = {k: v.cpu() for k, v in _check_state(engine_or_state_dict, "save_dcp").items()}
    return _save(state, path, group)


def _save(state: dict[str, torch.Tensor], path: Path, group) -> Path:
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank(group) == 0:
        path.mkdir(parents=True, exist_ok=True)
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), process_group=group,
                 no_dist=not distributed)
    return path


def read_keys(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors a DCP checkpoint holds: ``{key: (shape, dtype)}`` (no process group needed)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a DCP checkpoint (no {path / '.metadata'}): give the directory "
                                "that torch.distributed.checkpoint.save wrote")
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _dcp().FileSystemReader(str(path)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _find_prefix(keys: set[str], names: list[str]) -> str | None:
    """The prefix under which the checkpoint stores the model (``""`` when keys are the names)."""
    if any(n in keys for n in names):
        return ""
    for name in names:
        found = sorted(k[:-len(name)] for k in keys if k.endswith("." + name))
        for prefix in found:
            if sum(prefix + n in keys for n in names) * 2 >= len(names):
                return prefix
    return None


def load_dcp(engine: Engine, path: str | os.PathLike, *, prefix: str | None = None,
             strict: bool = True):
    """Collective: load a DCP checkpoint's model tensors into ``engine`` at any stage and size.

    Keys are the model's names, as ``engine.state_dict()`` or an FSDP2 model's ``state_dict()``
    give them, possibly under a prefix (``"model."`` for ``dcp.save({"model": ...})``): found
    by itself, or given as ``prefix``. Keys outside the prefix (an optimizer's, a step count's)
    are left alone; without a prefix every key of the checkpoint is a candidate, and one the
    model lacks is unexpected (an error with ``strict``). Every rank reads the full tensors it
    needs, then each copies the part it holds (:func:`zerodp.engine.state_dict.load_state_dict`, whose ``(missing,
    unexpected)`` keys it returns; ``strict`` as there).
    """
    if not _is_engine(engine):
        raise TypeError(f"load_dcp expects an engine from zerodp.parallelize, got {type(engine).__name__}")
    control = getattr(engine, "control", None)
    if control is not None:  # named and bounded on a subset of ranks (the engine's timeout_s)
        with control.call(LOAD_DCP):
            return _load(engine, path, prefix, strict)
    return _load(engine, path, prefix, strict)


def _load(engine: Engine, path: str | os.PathLike, prefix: str | None, strict: bool):
    available = read_keys(path)
    wanted = list(engine.module.state_dict(keep_vars=True))
    if prefix is None:
        prefix = _find_prefix(set(available), wanted)
        if prefix is None:
            sample = sorted(available)[:5]
            raise KeyError(f"{path} holds none of this model's parameter names (e.g. {wanted[:3]}); its keys look "
                           f"like {sample}: pass prefix= with what comes before the model's names")
    state = {}
    for key, (shape, dtype) in available.items():
        if key.startswith(prefix):
            state[key[len(prefix):]] = torch.empty(shape, dtype=dtype)
    dcp = _dcp()
    distributed = dist.is_available() and dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        # DCP matches keys exactly: load under the checkpoint's own names, into tensors of ours
        dcp.load({prefix + k: v for k, v in state.items()}, storage_reader=dcp.FileSystemReader(str(path)),
                 process_group=engine.group, no_dist=not distributed)
    return engine.load_state_dict(state, strict=strict)
