"""Hugging Face safetensors directories in and out of an engine, at any stage (guide §12.1).

A Hugging Face checkpoint is a directory of ``*.safetensors`` files, keyed by the model's own
parameter names (``model.layers.0.self_attn.q_proj.weight``), with a
``model.safetensors.index.json`` that maps each name to its file when there is more than one::

    {"metadata": {"total_size": 435456}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors", ...}}

:func:`load_hf` fills an engine from such a directory. The engine asks for exactly the pieces this
rank holds (``engine.load_state_pieces``): at stage 3 that is its 1/N shard of each flat buffer,
so each rank reads about 1/N of the bytes — a flat range ``[start, stop)`` of a weight is a run of
whole rows plus partial rows at both ends, and safetensors' ``get_slice`` reads just the covering
rows from the memory-mapped file. Stages 1-2 read their 1/N slice of the fp32 master too (the
AllGather that publishes the parameters fills in the rest); stage 0 keeps full replicas and reads
everything. Values are cast to the engine's fp32 master dtype; the returned :class:`HFLoad`
counts the bytes this rank read.

:func:`save_hf` writes the other way: the full fp32 state (gathered from the shards with a
collective) as sharded ``model-00001-of-0000N.safetensors`` files plus the index, in fp32 or bf16,
written by rank 0 and atomically. It also takes a plain ``{name: tensor}`` state dict in a single
process, which is what ``zerodp export --format hf`` uses.

Names: the checkpoint's keys are the model's ``named_parameters()`` names, as for a
``transformers`` model. Tied weights (one tensor under two names, e.g. ``lm_head.weight`` and
``model.embed_tokens.weight``) appear once in the engine; either name serves, and the other may be
absent from the files, as in checkpoints ``save_pretrained`` writes. Persistent buffers are read
when the files hold them and otherwise keep their values (with a warning).

Only ``safetensors``, ``json`` and ``torch`` are used here; ``transformers`` is not needed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.base import BUFFER, StageEngine, persistent_buffers
from zerodp.engine.durable import fsync_dir, write_durable
from zerodp.engine.master import PARAM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: The shard size ``save_pretrained`` used by default for years ("5GB", decimal).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SAVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class HFCheckpointError(ValueError):
    """A Hugging Face directory that cannot be used; the message names the path and the fix."""


def shard_file_name(i: int, n: int) -> str:
    """Hugging Face's shard name: ``model-00001-of-00003.safetensors`` (``i`` counts from 1)."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


# ------------------------------------------------------------------------------------- reading


@dataclass
class HFIndex:
    """Which file holds which key of a Hugging Face directory, with each key's shape and dtype."""

    path: Path
    files: dict[str, str]  # key -> file name inside ``path``
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]  # safetensors dtype names: "F32", "BF16", ...

    def numel(self, key: str) -> int:
        return math.prod(self.shapes[key])

    def nbytes(self, key: str) -> int:
        return self.numel(key) * _DTYPE_BYTES.get(self.dtypes[key], 4)


def open_hf(directory: str | os.PathLike) -> HFIndex:
    """Read the index (or every ``*.safetensors`` header) of a Hugging Face directory.

    Headers only: no tensor bytes are read here."""
    from safetensors import safe_open

    path = Path(directory)
    if not path.exists():
        raise HFCheckpointError(f"{path} does not exist: give a directory of *.safetensors files "
                                "(as save_pretrained or zerodp.engine.hf.save_hf write it)")
    if not path.is_dir():
        raise HFCheckpointError(f"{path} is not a directory: give the directory that holds the *.safetensors "
                                f"files (and {INDEX_FILE} when there are several)")
    index_path = path / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index_path} is not a valid index ({type(e).__name__}: {e}); it must be "
                                    '{"metadata": {...}, "weight_map": {name: file}}') from None
        file_names = sorted(set(weight_map.values()))
    else:
        weight_map = None
        file_names = sorted(p.name for p in path.glob("*.safetensors"))
        if not file_names:
            raise HFCheckpointError(f"{path} holds no *.safetensors files and no {INDEX_FILE}: give a directory "
                                    "written by save_pretrained(..., safe_serialization=True) or save_hf "
                                    "(PyTorch .bin checkpoints are not read)")
    files: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for name in file_names:
        f = path / name
        if not f.is_file():
            raise HFCheckpointError(f"{f} is missing but {INDEX_FILE} lists it: copy the file back, or "
                                    "download the checkpoint again")
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    if key in files:
                        raise HFCheckpointError(f"{path}: {key} is in both {files[key]} and {name}; a "
                                                "checkpoint holds each tensor once")
                    if weight_map is not None and weight_map.get(key) != name:
                        continue  # the index names another file for this key
                    sl = handle.get_slice(key)
                    files[key], shapes[key], dtypes[key] = name, tuple(sl.get_shape()), sl.get_dtype()
        except HFCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors reports header damage in several types
            raise HFCheckpointError(f"{f} cannot be read as safetensors ({e}): the file is damaged "
                                    "or is not a safetensors file") from None
    if weight_map is not None:
        absent = sorted(k for k in weight_map if k not in files)
        if absent:
            raise HFCheckpointError(f"{index_path} maps {len(absent)} key(s) to files that do not hold them "
                                    f"(first: {absent[0]} -> {weight_map[absent[0]]}): the index and the "
                                    "files come from different saves")
    return HFIndex(path, files, shapes, dtypes)


class SliceReader:
    """Reads flat element ranges of the tensors of an :class:`HFIndex`, counting the bytes read.

    ``read(key, start, stop)`` returns elements ``[start, stop)`` of the flattened tensor, in the
    file's dtype. Only the covering rows (along the first dimension) are taken from the file, so
    ``bytes_read`` is what a rank's shard costs, plus at most two partial rows per range."""

    def __init__(self, index: HFIndex):
        self.index = index
        self.bytes_read = 0
        self.reads = 0
        self._handles: dict[str, object] = {}

    def _slice(self, key: str):
        from safetensors import safe_open

        name = self.index.files[key]
        if name not in self._handles:
            self._handles[name] = safe_open(str(self.index.path / name), framework="pt")
        return self._handles[name].get_slice(key)

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        shape = self.index.shapes[key]
        numel = math.prod(shape)
        if not 0 <= start <= stop <= numel:
            raise HFCheckpointError(f"range [{start}:{stop}) is outside {key} ({numel} elements)")
        itemsize = _DTYPE_BYTES.get(self.index.dtypes[key], 4)
        self.reads += 1
        if len(shape) == 0:
            self.bytes_read += itemsize
            return self._slice(key)[...].reshape(-1)[start:stop]
        row = numel // shape[0] if shape[0] else 1
        r0, r1 = start // row, -(-stop // row)
        if stop == start:
            r1 = r0
        rows = self._slice(key)[r0:r1]
        self.bytes_read += (r1 - r0) * row * itemsize
        return rows.reshape(-1)[start - r0 * row:stop - r0 * row]

    def close(self) -> None:
        self._handles.clear()


@dataclass
class HFLoad:
    """What :func:`load_hf` did on this rank: bytes read from the files (``bytes_read``) out of
    ``file_bytes`` in the tensors the model uses, and the keys it did not use."""

    bytes_read: int
    file_bytes: int
    reads: int
    unexpected: list[str] = field(default_factory=list)
    buffers_missing: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.bytes_read / self.file_bytes if self.file_bytes else 0.0


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Canonical parameter name (as ``named_parameters()`` gives it, first occurrence) -> every
    name of that tensor (tied weights have several)."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), name)
        out.setdefault(canon, []).append(name)
    return out


def _param_shapes(engine: StageEngine) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape: from the flat layouts (at stage 3 a parameter's own tensor is
    an empty placeholder while its unit is freed), else from the tensor itself."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layout in engine.layout():
        for slot in layout["slots"]:
            shapes[slot["name"]] = tuple(slot["shape"])
    for name, p in engine._module.named_parameters():
        shapes.setdefault(name, tuple(p.shape))
    return shapes


def load_hf(engine: StageEngine, directory: str | os.PathLike, *, strict: bool = True) -> HFLoad:
    """Collective: load a Hugging Face safetensors directory into ``engine`` at any stage.

    Each rank reads only the element ranges it keeps (guide §12.1: its 1/N slice of every flat
    buffer at stage 3), via ``safe_open(...).get_slice``. Every key is checked against the model
    first (names and shapes) so that nothing is half-loaded. ``strict``: keys of the files that are
    not parameters or buffers of the model are an error (False: a warning; they are listed in
    :attr:`HFLoad.unexpected` either way). Frozen parameters load too (at stage 3 into this rank's
    part of its unit's shard). Weights only: optimizer states the engine already has are kept as
    they are. Returns what this rank read."""
    if not isinstance(engine, StageEngine):
        raise TypeError(f"load_hf needs an engine from zerodp.parallelize, got {type(engine).__name__}; for a "
                        "plain model, load_hf_state_dict(directory) gives the tensors to load_state_dict")
    index = open_hf(directory)
    module = engine._module
    aliases = _aliases(module)
    shapes = _param_shapes(engine)
    key_of: dict[str, str] = {}
    missing, wrong = [], []
    for canon, names in aliases.items():
        key = next((n for n in names if n in index.files), None)
        if key is None:
            missing.append(canon)
            continue
        key_of[canon] = key
        if tuple(index.shapes[key]) != shapes[canon]:
            wrong.append(f"{key}: file {list(index.shapes[key])}, model {list(shapes[canon])}")
    buffer_names = [name for name, _, _ in persistent_buffers(module)]
    known = {n for names in aliases.values() for n in names} | set(buffer_names)
    unexpected = sorted(k for k in index.files if k not in known)
    if missing:
        raise HFCheckpointError(f"{index.path} has no tensor for {len(missing)} parameter(s) of the model "
                                f"(first: {missing[0]}; file keys look like {next(iter(index.files), '-')}): "
                                "the checkpoint is of another model, or its names need a prefix mapping")
    if wrong:
        raise HFCheckpointError(f"{index.path}: {len(wrong)} shape mismatch(es), first {wrong[0]}: the "
                                "checkpoint is of another model size (compare config.json)")
    if unexpected:
        msg = (f"{index.path} holds {len(unexpected)} key(s) the model does not have (first: {unexpected[0]})")
        if strict:
            raise HFCheckpointError(msg + ": pass strict=False to ignore them")
        warnings.warn(msg + "; they are ignored", stacklevel=2)
    reader = SliceReader(index)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    in_master = (engine.load_frozen_pieces(lambda name, a, b: reader.read(key_of[name], a, b), frozen)
                 if frozen else set())
    if frozen - in_master and engine.stage == 3:
        raise HFCheckpointError(f"the model has frozen parameters ({sorted(frozen - in_master)[0]}, ...) that "
                                "this engine keeps where load_hf cannot reach them: load the weights into the "
                                "model before parallelize() (model.load_state_dict(load_hf_state_dict(directory)))")
    buffers_missing = [n for n in buffer_names if n not in index.files]

    def read(name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        if kind == PARAM:
            return reader.read(key_of[name], start, stop)
        if kind == BUFFER:
            if name not in index.files:
                raise KeyError(name)  # the engine keeps the buffer's value and warns
            return reader.read(name, start, stop)
        return held[(name, kind, start, stop)]  # optimizer states: kept as they are

    # The pieces this rank holds now, so that optimizer states (present after a step) load back
    # onto themselves unchanged.
    held = {(pc.name, pc.kind, pc.start, pc.stop): pc.tensor for pc in engine.master.pieces()}

    with torch.no_grad():
        for name, p in module.named_parameters():  # stages 0-2: frozen ones are the module's own tensors
            if name in frozen and name not in in_master:
                p.copy_(reader.read(key_of[name], 0, p.numel()).reshape(p.shape))
    engine.load_state_pieces(read)
    reader.close()
    file_bytes = sum(index.nbytes(k) for k in key_of.values()) + sum(
        index.nbytes(n) for n in buffer_names if n in index.files)
    return HFLoad(reader.bytes_read, file_bytes, reader.reads, unexpected, buffers_missing)


def load_hf_state_dict(directory: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory by key, in one process (floating ones cast to
    ``dtype`` when given): for a plain model, ``model.load_state_dict(...)``."""
    index = open_hf(directory)
    reader = SliceReader(index)
    out = {}
    for key, shape in index.shapes.items():
        t = reader.read(key, 0, index.numel(key)).reshape(shape).clone()
        out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    reader.close()
    return out


# ------------------------------------------------------------------------------------- writing


def _distinct(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names of a tensor that shares its storage with an earlier one (tied weights,
    as ``module.state_dict()`` lists them), as ``save_pretrained`` does."""
    seen: set = set()
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"save_hf: {name} is a {type(t).__name__}, not a tensor")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.numel() else None
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out[name] = t
    return out


def write_hf(state: Mapping[str, torch.Tensor], directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, config: Mapping | None = None,
             metadata: Mapping[str, object] | None = None) -> Path:
    """Single process: write ``state`` as a Hugging Face directory (see :func:`save_hf`)."""
    from safetensors.torch import save as st_save

    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_hf writes float32, bfloat16 or float16, got dtype={dtype}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    state = _distinct(state)
    if not state:
        raise ValueError("save_hf got an empty state dict: there is nothing to write")
    tensors = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    # Greedy, in the state dict's order (layer by layer): a new shard when the next tensor would
    # overflow this one; a tensor larger than the limit gets a shard of its own.
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    names = [shard_file_name(i + 1, n) for i in range(n)]
    weight_map = {k: names[i] for i, shard in enumerate(shards) for k in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, **dict(metadata or {})}, "weight_map": weight_map}

    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory: save_hf writes a directory of safetensors files")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        for name, shard in zip(names, shards):
            write_durable(tmp / name, st_save(shard, metadata={"format": "pt"}))
        if config is not None:
            write_durable(tmp / CONFIG_FILE, (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode())
        write_durable(tmp / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
        fsync_dir(tmp)
        if not out.exists():
            tmp.rename(out)  # the whole directory appears at once
        else:
            # Into an existing directory (which may hold a tokenizer, a config): each file is
            # replaced atomically, the index last, so the index never names a file that is not
            # there; shards of an earlier save that the new index does not name are removed after.
            old = [p for p in out.iterdir() if p.name == SINGLE_FILE
                   or (p.name.startswith("model-") and p.name.endswith(".safetensors"))]
            for p in sorted(tmp.iterdir(), key=lambda p: p.name == INDEX_FILE):
                os.replace(p, out / p.name)
            for p in old:
                if p.name not in names:
                    p.unlink()
            tmp.rmdir()
        fsync_dir(out)
        fsync_dir(out.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_hf(source: StageEngine | Mapping[str, torch.Tensor], directory: str | os.PathLike, *,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            config: Mapping | None = None, metadata: Mapping[str, object] | None = None) -> Path | None:
    """Write a Hugging Face directory: ``model-0000i-of-0000N.safetensors`` shards of at most
    ``max_shard_bytes`` keyed by the model's own names, and ``model.safetensors.index.json``;
    ``config.json`` too when ``config`` (a dict, e.g. ``model.config.to_dict()``) is given.

    ``source`` is an engine — a collective: the full fp32 state is gathered on every rank
    (guide §12.1), rank 0 writes, and every rank returns once the files are complete (rank 0 gets
    the path, the others None; a write error is raised on every rank) — or a plain
    ``{name: tensor}`` state dict, written by this process. Floating tensors are written in
    ``dtype`` (float32 or bfloat16); tied weights once, under their first name. The directory is
    written atomically: into a temporary directory, fsynced, then renamed (see :func:`write_hf`)."""
    if not isinstance(source, StageEngine):
        if not isinstance(source, Mapping):
            raise TypeError(f"save_hf takes an engine or a {{name: tensor}} state dict, got {type(source).__name__}")
        return write_hf(source, directory, dtype=dtype, max_shard_bytes=max_shard_bytes, config=config,
                        metadata=metadata)
    engine = source
    state = _engine_state(engine)
    error = None
    path = None
    if engine.rank == 0:
        try:
            path = write_hf(state, directory, dtype=dtype, max_shard_bytes=max_shard_bytes, config=config,
                            metadata=metadata)
        except Exception as e:  # noqa: BLE001 - every rank raises the same error below
            error = f"{type(e).__name__}: {e}"
    if engine.world_size > 1:
        box = [error]
        src = dist.get_global_rank(engine.group, 0) if engine.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=engine.group)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"save_hf: rank 0 could not write {directory}: {error}")
    return path


def _engine_state(engine: StageEngine) -> dict[str, torch.Tensor]:
    """Collective: the model's parameters (fp32) and persistent buffers by name, for rank 0 (the
    other ranks may get ``{}``): ``engine.state_dict(rank0_only=True, cpu_offload=True)`` where it
    is available, else ``engine.full_state_dict()``."""
    try:
        return engine.state_dict(rank0_only=True, cpu_offload=True)
    except NotImplementedError:
        return engine.full_state_dict()
