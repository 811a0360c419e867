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

:func:`save_hf` writes the other way, streaming: the shards' files are planned from the names and
shapes alone, then filled unit by unit — each unit's full tensors summed onto rank 0 from the
ranks' disjoint checkpoint pieces, written at their offsets and dropped — so no rank holds more
than its shard plus one unit's full tensors; sharded ``model-00001-of-0000N.safetensors`` files
plus the index, in fp32 or bf16, written by rank 0 and atomically. It also takes a plain
``{name: tensor}`` state dict, or lazy :class:`TensorSource` values, in a single process, which is
what ``zerodp export --format hf`` uses (one tensor assembled from a checkpoint at a time).

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
from typing import Callable, Mapping

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
    for name, p in engine.checkpoint.module.named_parameters():
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
    module = engine.checkpoint.module
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
    in_master = (engine.checkpoint.load_frozen_pieces(lambda name, a, b: reader.read(key_of[name], a, b), frozen)
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
    engine.checkpoint.load_state_pieces(read)
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


@dataclass(frozen=True)
class TensorSource:
    """A tensor to write that is read only when its turn comes (:func:`write_hf` streams them):
    its full ``shape``, its ``dtype`` as stored, and ``load()`` returning it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...] | None = None) -> "TensorSource":
        """The same tensor through ``fn`` (a transpose, a rename's reshape), still lazy."""
        return TensorSource(tuple(self.shape if shape is None else shape), self.dtype, lambda: fn(self.load()))


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _stored(dtype: torch.dtype, floating_as: torch.dtype) -> torch.dtype:
    return floating_as if dtype.is_floating_point else dtype


class _ShardWriter:
    """Safetensors shards planned from the tensors' names, shapes and dtypes alone, written tensor
    by tensor at their offsets into a temporary directory, then committed atomically: no more than
    the tensor being written is held (guide §12.7). The headers are JSON with sorted keys, so the
    bytes depend only on the tensors and the metadata."""

    def __init__(self, entries: list[_Entry], directory: str | os.PathLike, max_shard_bytes: int,
                 config: Mapping | None, metadata: Mapping[str, object] | None):
        if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
        if not entries:
            raise ValueError("save_hf got an empty state dict: there is nothing to write")
        # Greedy, in the given order (layer by layer): a new shard when the next tensor would
        # overflow this one; a tensor larger than the limit gets a shard of its own.
        shards: list[list[_Entry]] = [[]]
        size = 0
        for e in entries:
            if shards[-1] and size + e.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        n = len(shards)
        self.names = [shard_file_name(i + 1, n) for i in range(n)]
        self.where: dict[str, tuple[int, int, _Entry]] = {}  # name -> (shard, byte offset in the file, entry)
        self.headers = []
        for i, shard in enumerate(shards):
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for e in shard:
                header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                                  "data_offsets": [offset, offset + e.nbytes]}
                offset += e.nbytes
            text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            start = 8 + len(text)
            for e in shard:
                self.where[e.name] = (i, start + header[e.name]["data_offsets"][0], e)
            self.headers.append((len(text).to_bytes(8, "little") + text, start + offset))
        weight_map = {name: self.names[i] for name, (i, _, _) in self.where.items()}
        self.index = {"metadata": {"total_size": sum(e.nbytes for e in entries), **dict(metadata or {})},
                      "weight_map": weight_map}
        self.config = config
        self.out = Path(directory)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"{self.out} exists and is not a directory: save_hf writes a directory of safetensors "
                             "files")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        self.files = []
        for name, (head, total) in zip(self.names, self.headers):
            f = open(self.tmp / name, "wb")
            f.write(head)
            f.truncate(total)
            self.files.append(f)
        self.written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        i, offset, e = self.where[name]
        t = tensor.detach().to("cpu")
        if tuple(t.shape) != e.shape:
            raise ValueError(f"save_hf: {name} has shape {tuple(t.shape)}, {list(e.shape)} was planned")
        t = t.to(e.dtype).contiguous().reshape(-1)
        f = self.files[i]
        f.seek(offset)
        f.write(memoryview(t.view(torch.uint8).numpy()))
        self.written.add(name)

    def commit(self) -> Path:
        missing = sorted(set(self.where) - self.written)
        if missing:
            raise RuntimeError(f"save_hf: {len(missing)} tensor(s) were never written (first: {missing[0]})")
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        out, tmp = self.out, self.tmp
        if self.config is not None:
            write_durable(tmp / CONFIG_FILE, (json.dumps(dict(self.config), indent=2, sort_keys=True) + "\n").encode())
        write_durable(tmp / INDEX_FILE, (json.dumps(self.index, indent=2) + "\n").encode())
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
                if p.name not in self.names:
                    p.unlink()
            tmp.rmdir()
        fsync_dir(out)
        fsync_dir(out.parent)
        return out

    def abort(self) -> None:
        for f in self.files:
            f.close()
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)


def write_hf(state: Mapping[str, "torch.Tensor | TensorSource"], directory: str | os.PathLike, *,
             dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
             config: Mapping | None = None, metadata: Mapping[str, object] | None = None) -> Path:
    """Single process: write ``state`` as a Hugging Face directory (see :func:`save_hf`), one
    tensor at a time: a :class:`TensorSource` is loaded only when it is written, and each tensor
    is cast on its own, so the process holds what ``state`` holds plus one tensor."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_hf writes float32, bfloat16 or float16, got dtype={dtype}")
    for name, t in state.items():
        if not isinstance(t, (torch.Tensor, TensorSource)):
            raise TypeError(f"save_hf: {name} is a {type(t).__name__}, not a tensor")
    tensors = _distinct({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    seen: set[int] = set()  # a source under two names (tied weights) is written once, as a tensor is
    items = {}
    for k, v in state.items():
        if k in tensors or (isinstance(v, TensorSource) and id(v) not in seen):
            items[k] = v
            seen.add(id(v))
    entries = [_Entry(k, tuple(v.shape), _stored(v.dtype, dtype)) for k, v in items.items()]
    writer = _ShardWriter(entries, directory, max_shard_bytes, config, metadata)
    try:
        for name, v in items.items():
            writer.write(name, v.load() if isinstance(v, TensorSource) else v)
        return writer.commit()
    finally:
        writer.abort()


def save_hf(source: StageEngine | Mapping[str, "torch.Tensor | TensorSource"], directory: str | os.PathLike, *,
            dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            config: Mapping | None = None, metadata: Mapping[str, object] | None = None) -> Path | None:
    """Write a Hugging Face directory: ``model-0000i-of-0000N.safetensors`` shards of at most
    ``max_shard_bytes`` keyed by the model's own names, and ``model.safetensors.index.json``;
    ``config.json`` too when ``config`` (a dict, e.g. ``model.config.to_dict()``) is given.

    ``source`` is an engine — a collective that streams (guide §12.1, §12.7): unit by unit (a
    flat group, or a run of its tensors of at most the largest unit's size), every rank lays the
    pieces of its shard (``engine.checkpoint.state_pieces()``) into a zero buffer of the unit's full tensors
    and the buffers are summed onto rank 0 (the pieces are disjoint, so the sum is exact), which
    writes them at their planned offsets and drops them; so no rank holds more than its shard plus
    one unit's full tensors. Rank 0 gets the path, the others None; a write error is raised on
    every rank. Frozen parameters that stage 3 keeps inside its units are not in the pieces: an
    engine with those is exported through ``engine.state_dict()`` (the whole model on rank 0),
    with a warning. ``source`` may instead be a ``{name: tensor or TensorSource}`` mapping,
    written by this process one tensor at a time (:func:`write_hf`). Floating tensors are written
    in ``dtype`` (float32, bfloat16 or float16); tied weights once, under their first name. The
    directory is written atomically: into a temporary directory, fsynced, then renamed."""
    if not isinstance(source, StageEngine):
        if not isinstance(source, Mapping):
            raise TypeError(f"save_hf takes an engine or a {{name: tensor}} state dict, got {type(source).__name__}")
        return write_hf(source, directory, dtype=dtype, max_shard_bytes=max_shard_bytes, config=config,
                        metadata=metadata)
    engine = source
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_hf writes float32, bfloat16 or float16, got dtype={dtype}")
    error = None
    path = None
    if _frozen_inside_units(engine):
        warnings.warn("save_hf: frozen parameters inside stage 3's units are not in the checkpoint pieces; "
                      "the export gathers the whole model on rank 0 (engine.state_dict())", stacklevel=2)
        state = _engine_state(engine)
        if engine.rank == 0:
            try:
                path = write_hf(state, directory, dtype=dtype, max_shard_bytes=max_shard_bytes, config=config,
                                metadata=metadata)
            except Exception as e:  # noqa: BLE001 - every rank raises the same error below
                error = f"{type(e).__name__}: {e}"
    else:
        path, error = _stream_engine(engine, directory, dtype, max_shard_bytes, config, metadata)
    if engine.world_size > 1:
        box = [error]
        src = dist.get_global_rank(engine.group, 0) if engine.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=engine.group)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"save_hf: rank 0 could not write {directory}: {error}")
    return path


def _frozen_inside_units(engine: StageEngine) -> bool:
    """Whether a frozen parameter sits in a flat group of a stage-3 engine (kept in its units'
    shards, outside the checkpoint pieces)."""
    if engine.stage != 3:
        return False
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    return any(slot["name"] in frozen for layout in engine.layout() for slot in layout["slots"])


def _stream_engine(engine: StageEngine, directory, dtype: torch.dtype, max_shard_bytes: int,
                   config: Mapping | None, metadata: Mapping | None) -> tuple[Path | None, str | None]:
    """Collective (every rank, the same reductions in the same order): see :func:`save_hf`."""
    lead = engine.rank == 0
    pieces: dict[str, list] = {}
    buffers: dict[str, torch.Tensor] = {}
    for pc in engine.checkpoint.state_pieces():
        if pc.kind == PARAM:
            pieces.setdefault(pc.name, []).append(pc)
        elif pc.kind == BUFFER:
            buffers[pc.name] = pc.tensor.reshape(pc.shape)
    # Runs of tensors, each run summed onto rank 0 at once: a flat group's slots, cut where a run
    # would outgrow the largest group (a stage 0-2 engine built with one huge bucket still streams).
    groups = [[(slot["name"], tuple(slot["shape"])) for slot in layout["slots"]] for layout in engine.layout()]
    limit = max((sum(math.prod(s) for _, s in g) for g in groups), default=0)
    limit = min(limit, max((math.prod(s) for g in groups for _, s in g), default=0) + (1 << 24))
    runs: list[list[tuple[str, tuple[int, ...]]]] = []
    for g in groups:
        runs.append([])
        for name, shape in g:
            if runs[-1] and sum(math.prod(s) for _, s in runs[-1]) + math.prod(shape) > limit:
                runs.append([])
            runs[-1].append((name, shape))
    in_groups = {name for run in runs for name, _ in run}
    outside = {n: p for n, p in engine.module.named_parameters() if n not in in_groups}  # full on every rank
    writer, error = None, None
    if lead:
        entries = [_Entry(n, s, dtype) for run in runs for n, s in run]
        entries += [_Entry(n, tuple(p.shape), _stored(p.dtype, dtype)) for n, p in outside.items()]
        entries += [_Entry(n, tuple(b.shape), _stored(b.dtype, dtype)) for n, b in buffers.items()]
        try:
            writer = _ShardWriter(entries, directory, max_shard_bytes, config, metadata)
        except Exception as e:  # noqa: BLE001 - raised on every rank by save_hf
            error = f"{type(e).__name__}: {e}"
    dst = dist.get_global_rank(engine.group, 0) if engine.group is not None and engine.world_size > 1 else 0
    device = next((pc.tensor.device for pcs in pieces.values() for pc in pcs), torch.device("cpu"))
    try:
        # One buffer for every run, zeroed in between: the allocator sees one allocation, not one per unit.
        flat = buffer = torch.empty(max((sum(math.prod(s) for _, s in run) for run in runs), default=0),
                             dtype=torch.float32, device=device)
        for run in runs:
            flat = buffer[:sum(math.prod(s) for _, s in run)].zero_()
            at = 0
            for name, shape in run:
                for pc in pieces.get(name, []):
                    flat[at + pc.start:at + pc.stop].copy_(pc.tensor.reshape(-1))
                at += math.prod(shape)
            if engine.world_size > 1:
                dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=engine.group)
            if writer is not None and error is None:
                try:
                    at = 0
                    for name, shape in run:
                        writer.write(name, flat[at:at + math.prod(shape)].view(shape))
                        at += math.prod(shape)
                except Exception as e:  # noqa: BLE001 - keep taking part in the reductions
                    error = f"{type(e).__name__}: {e}"
        del buffer, flat
        if writer is not None and error is None:
            for n, p in outside.items():
                writer.write(n, p)
            for n, b in buffers.items():
                writer.write(n, b)
            return writer.commit(), None
        return None, error
    except Exception as e:  # noqa: BLE001
        if writer is None:
            raise
        return None, f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.abort()


def _engine_state(engine: StageEngine) -> dict[str, torch.Tensor]:
    """Collective: the model's parameters (fp32) and persistent buffers by name, for rank 0 (the
    other ranks may get ``{}``): ``engine.state_dict(rank0_only=True, cpu_offload=True)`` where it
    is available, else ``engine.full_state_dict()``."""
    try:
        return engine.state_dict(rank0_only=True, cpu_offload=True)
    except NotImplementedError:
        return engine.full_state_dict()
