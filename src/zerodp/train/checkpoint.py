"""Sharded checkpoints that survive a crash mid-save and load at any world size and stage.

Under ZeRO every rank holds a different 1/N of the optimizer state (and, from ZeRO-3, of the
parameters — guide §9). So each rank saves only what it owns: the engine lists it as *pieces*,
element ranges ``[start, stop)`` of the flattened full tensors (``engine.checkpoint.state_pieces()``). The pieces
of all ranks are disjoint and together cover every tensor, so a loader can rebuild any range of
any tensor from them — which is what lets a checkpoint saved at world 4, stage 3 load at world 2,
stage 1: the new engine asks ``read(name, kind, start, stop)`` for the ranges *it* owns.

On disk, one directory per checkpoint::

    checkpoints/step_00000020/
        rank00000.safetensors   the pieces of rank 0 (plus its RNG state), one tensor per piece
        rank00001.safetensors
        manifest.json           every piece (file, key, name, kind, range, shape, dtype), each file's
                                size and SHA-256, world size, stage, step, model and run config,
                                optimizer scalars, data position
        COMPLETE                written last

A save writes into ``.tmp-step_…``, fsyncs every file and the directory, renames it to its final
name (atomic on POSIX), then writes ``COMPLETE``. Older checkpoints are deleted only after that, so
a process killed at any moment leaves the previous checkpoint whole; a directory without
``COMPLETE`` is skipped with a message. A save that meets a filesystem error (a full disk, no
permission, an I/O error, a directory removed meanwhile) ends on every rank with one
:class:`CheckpointWriteError` naming the rank, the path and the error, and removes what it wrote.
Loading validates everything (model config, every file's presence, size and checksum, piece
coverage) before anything is applied: a bad checkpoint is refused with the file and the problem
named, never half-loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from zerodp.engine.durable import fsync_dir, write_durable
from zerodp.train.hooks import NO_HOOKS, Hooks

FORMAT = "zerodp-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
# where a save puts the complete checkpoint of the same step while it replaces it
REPLACED_PREFIX = TMP_PREFIX + "replaced-"
RNG_CPU = "__rng__/cpu"
RNG_CUDA = "__rng__/cuda"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


# ---------------------------------------------------------------------------------------- saving


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj) -> None:
    write_durable(path, json.dumps(obj, indent=1).encode())


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (stored in its rank file)."""
    state = {RNG_CPU: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[RNG_CUDA] = torch.cuda.get_rng_state()
    return state


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written: the filesystem returned an error on some rank. Raised on
    every rank with the same sentence; the checkpoints saved before are untouched."""


def _problem(rank: int, exc: BaseException, path: Path) -> dict:
    """What went wrong on this rank, picklable, for the other ranks to report."""
    if isinstance(exc, OSError):
        name = errno.errorcode.get(exc.errno or 0, "")
        what = f"{exc.strerror or exc}" + (f" ({name})" if name else "")
        path = Path(exc.filename) if exc.filename else path
    else:
        what = f"{type(exc).__name__}: {exc}"
    return dict(rank=rank, path=str(path), error=what)


def _previous(root: Path, step: int) -> str:
    """The newest complete checkpoint after a failed save, in words. (One of ``step`` itself can
    only be the checkpoint the failed save was to replace, put back.)"""
    try:
        older = complete_checkpoints(root)
    except OSError:
        older = []
    return (f"the previous checkpoint {older[-1]} is intact" if older else
            "no earlier checkpoint exists")


def _agree(problem: dict | None, step: int, root: Path) -> None:
    """Every rank learns whether any rank failed; if one did, every rank raises the same sentence."""
    problems = [p for p in _gather(problem) if p]
    if problems:
        met = "; ".join(f"rank {p['rank']} met \"{p['error']}\" at {p['path']}" for p in problems)
        raise CheckpointWriteError(f"the checkpoint of step {step} was not saved: {met}; "
                                   f"{_previous(root, step)}")


def save(pieces: Iterable, root: str | Path, step: int, meta: dict, keep: int = 2,
         hooks: Hooks = NO_HOOKS) -> Path:
    """Write this rank's ``pieces`` into checkpoint ``root/step_…``; collective on every rank.

    ``meta`` (JSON-able: model/run config, stage, scalar optimizer state, data position) goes into
    the manifest. ``keep`` complete checkpoints are kept, counting the new one. ``hooks``
    (:class:`zerodp.train.hooks.Hooks`) hears of each phase of the protocol (``save_phase``:
    "files", "manifest", "renamed", "complete") and of each filesystem operation before it runs
    (``before_fs``) — the tests' seams to kill the writer or make the filesystem fail at chosen
    points.

    A filesystem error on any rank (a full disk, no permission, an I/O error, a directory removed
    meanwhile) ends the save on every rank with the same :class:`CheckpointWriteError`, which
    names the rank, the path and the error: the ranks exchange their outcome after writing their
    files and again after rank 0 completes the checkpoint, so none is left waiting in a collective.
    What the failed save wrote is removed (best effort); older checkpoints are never touched.
    """
    rank, world = _rank_world()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (TMP_PREFIX + final.name)
    _agree(_make_tmp(rank, root, step, tmp, hooks) if rank == 0 else None, step, root)  # the barrier, too
    info, problem = _write_shard(rank, step, tmp / rank_file(rank), *_cpu_tensors(pieces), hooks)
    hooks.save_phase(step, "files")
    everyone = _gather((info, problem))
    if any(p for _, p in everyone):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _agree(problem, step, root)  # raises the same sentence on every rank
    problem = None
    if rank == 0:
        manifest = dict(format=FORMAT, version=VERSION, step=int(step), world_size=world, **meta,
                        files=[{k: r[k] for k in ("rank", "file", "bytes", "sha256")} for r, _ in everyone],
                        pieces=[dict(file=r["file"], **rec) for r, _ in everyone for rec in r["pieces"]])
        problem = _complete(rank, root, step, tmp, final, manifest, keep, hooks)
    _agree(problem, step, root)
    return final


def _make_tmp(rank: int, root: Path, step: int, tmp: Path, hooks: Hooks) -> dict | None:
    """Rank 0: an empty ``tmp`` directory for the new checkpoint (None, or the problem met)."""
    try:
        hooks.before_fs("mkdir", step, tmp)
        _put_back_replaced(root)
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that was killed
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        return _problem(rank, e, tmp)
    return None


def _cpu_tensors(pieces: Iterable) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """CPU copies of this rank's pieces and RNG state, keyed for the shard file, and the pieces'
    records for the manifest."""
    tensors: dict[str, torch.Tensor] = {}
    records = []
    for i, p in enumerate(pieces):
        t = p.tensor.detach()
        if t.dim() != 1 or t.numel() != p.stop - p.start:
            raise ValueError(f"piece {p.name}/{p.kind} [{p.start}:{p.stop}) holds a tensor of shape "
                             f"{tuple(t.shape)}; expected 1-D with {p.stop - p.start} elements")
        key = f"p{i}"
        tensors[key] = t.to("cpu", copy=True).contiguous()
        records.append(dict(key=key, name=p.name, kind=p.kind, start=int(p.start), stop=int(p.stop),
                            shape=[int(s) for s in p.shape], dtype=str(t.dtype).replace("torch.", "")))
    for k, v in rng_state().items():
        tensors[k] = v.clone()
    return tensors, records


def _write_shard(rank: int, step: int, path: Path, tensors: dict, records: list[dict], hooks: Hooks
                 ) -> tuple[dict | None, dict | None]:
    """This rank's shard file, fsynced: (its manifest entry, None) or (None, the problem met)."""
    from safetensors.torch import save as to_bytes

    try:
        # serialised in memory and written with plain file calls, so that a filesystem error
        # arrives as an OSError with its errno and path
        data = to_bytes(tensors, metadata={"format": FORMAT, "rank": str(rank)})
        hooks.before_fs("shard", step, path)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            hooks.before_fs("fsync", step, path)
            os.fsync(f.fileno())
        return dict(rank=rank, file=path.name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                    pieces=records), None
    except Exception as e:  # noqa: BLE001 - reported to every rank below, never left unmatched
        return None, _problem(rank, e, path)


def _complete(rank: int, root: Path, step: int, tmp: Path, final: Path, manifest: dict, keep: int,
              hooks: Hooks) -> dict | None:
    """Rank 0: the manifest, the rename of ``tmp`` to ``final`` (a checkpoint of the same step moved
    aside first, put back on failure), the completion marker, then pruning to ``keep``."""
    aside = root / (REPLACED_PREFIX + final.name)
    moved = renamed = False
    where = tmp / MANIFEST
    try:
        hooks.before_fs("manifest", step, where)
        _write_json(where, manifest)
        fsync_dir(tmp)
        hooks.save_phase(step, "manifest")
        if final.exists():  # the same step saved before (a resumed run redid these steps)
            if aside.exists():
                shutil.rmtree(aside)
            where = final
            os.rename(final, aside)
            moved = True
        where = final
        hooks.before_fs("rename", step, final)
        os.rename(tmp, final)
        renamed = True
        fsync_dir(root)
        hooks.save_phase(step, "renamed")
        where = final / COMPLETE
        hooks.before_fs("complete", step, where)
        where.write_text(f"step {step}\n")
        _fsync_file(where)
        fsync_dir(final)
        hooks.save_phase(step, "complete")
    except OSError as e:
        shutil.rmtree(final if renamed else tmp, ignore_errors=True)
        if moved:  # put back the complete checkpoint of the same step that was moved aside
            try:
                os.rename(aside, final)
            except OSError:
                pass
        return _problem(rank, e, where)
    try:
        if aside.exists():
            shutil.rmtree(aside)
        _prune(root, keep)
    except OSError:  # the new checkpoint is complete; old ones go at the next save
        pass
    return None


def _put_back_replaced(root: Path) -> None:
    """Undo what a save killed while replacing a checkpoint of the same step left: the complete
    old checkpoint moved aside (``.tmp-replaced-step_…``) goes back to its name, unless the new one
    was completed (then the aside copy is stale and goes)."""
    if not root.is_dir():
        return
    for aside in root.iterdir():
        if not (aside.is_dir() and aside.name.startswith(REPLACED_PREFIX)):
            continue
        final = root / aside.name[len(REPLACED_PREFIX):]
        if (final / COMPLETE).exists() or not (aside / COMPLETE).exists():
            shutil.rmtree(aside, ignore_errors=True)
            continue
        if final.exists():
            shutil.rmtree(final)
        os.rename(aside, final)
        fsync_dir(root)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, and what interrupted saves left."""
    complete = complete_checkpoints(root)
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    newest = checkpoint_step(complete[-1]) if complete else None
    for d in root.iterdir():
        partial = (newest is not None and _step_of(d) is not None and not (d / COMPLETE).exists()
                   and _step_of(d) < newest)
        if d.is_dir() and d not in complete and (d.name.startswith(TMP_PREFIX) or partial):
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------- finding


def _step_of(d: Path) -> int | None:
    if not d.name.startswith(PREFIX):
        return None
    try:
        return int(d.name[len(PREFIX):])
    except ValueError:
        return None


def checkpoint_step(d: Path) -> int | None:
    """The step of a checkpoint directory, also of one a save moved aside to replace it."""
    name = d.name[len(REPLACED_PREFIX):] if d.name.startswith(REPLACED_PREFIX) else d.name
    return _step_of(Path(name))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first. A complete checkpoint that a save of the
    same step moved aside and could not replace (it was killed) counts, under its aside name, when
    no complete one of that step exists (the next save puts it back)."""
    if not Path(root).is_dir():
        return []
    found: dict[int, Path] = {}
    for d in sorted(Path(root).iterdir(), key=lambda d: d.name.startswith(REPLACED_PREFIX)):
        step = checkpoint_step(d)
        if step is not None and step not in found and d.is_dir() and (d / COMPLETE).exists():
            found[step] = d
    return [found[s] for s in sorted(found)]


def find(path: str | Path, log: Callable[[str], None] = print) -> Path:
    """The checkpoint ``path`` means: a checkpoint directory itself, or the newest complete one in a
    run directory (``path/checkpoints``) or a checkpoints directory. Incomplete ones are reported
    through ``log`` and skipped."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if (p / MANIFEST).exists() or _step_of(p) is not None:
        if not (p / COMPLETE).exists():
            raise CheckpointError(f"checkpoint {p} is incomplete (no {COMPLETE} marker): its save was "
                                  "interrupted; use an earlier checkpoint")
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    complete = complete_checkpoints(root)
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_dir() and d not in complete and (d.name.startswith(TMP_PREFIX) or
                                                 (_step_of(d) is not None and not (d / COMPLETE).exists())):
            log(f"ignoring incomplete checkpoint {d} (its save was interrupted)")
    if not complete:
        raise CheckpointError(f"no complete checkpoint in {root}")
    return complete[-1]


# --------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class _Span:
    start: int
    stop: int
    file: str
    key: str


class Checkpoint:
    """A validated checkpoint: its manifest, and ``read`` that assembles any range from the pieces."""

    def __init__(self, path: Path, manifest: dict, spans: dict, shapes: dict, dtypes: dict):
        self.path, self.manifest = path, manifest
        self._spans, self.shapes, self.dtypes = spans, shapes, dtypes
        self._handles: dict = {}

    # -- opening and validation
    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> "Checkpoint":
        """Open and validate; ``verify`` also checks every file's SHA-256 (reads every byte)."""
        try:
            return cls._open(Path(path), verify)
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{Path(path) / MANIFEST} is malformed ({type(e).__name__}: {e}): "
                                  "it was not written by this version of zerodp, or was edited") from None

    @classmethod
    def _open(cls, path: Path, verify: bool) -> "Checkpoint":
        mpath = path / MANIFEST
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker)")
        try:
            manifest = json.loads(mpath.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{mpath} is missing: {path} is not a zerodp checkpoint") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{mpath} is not valid JSON ({e}): the manifest is corrupt") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise CheckpointError(f"{mpath} is not a {FORMAT} version {VERSION} manifest")
        for rec in manifest["files"]:
            f = path / rec["file"]
            if not f.exists():
                n = manifest["world_size"]
                raise CheckpointError(f"{f} is missing: the checkpoint was saved by {n} rank{'s' if n != 1 else ''} "
                                      f"and rank {rec['rank']}'s shard file is gone; copy it back, or "
                                      "resume from another checkpoint")
            size = f.stat().st_size
            if size != rec["bytes"]:
                raise CheckpointError(f"{f} has {size} bytes but the manifest says {rec['bytes']}: "
                                      "the file is truncated or was overwritten")
            if verify and _sha256(f) != rec["sha256"]:
                raise CheckpointError(f"{f} fails its SHA-256 check: the file is corrupt")
        spans: dict[tuple[str, str], list[_Span]] = {}
        shapes: dict[str, tuple] = {}
        dtypes: dict[tuple[str, str], str] = {}
        for pc in manifest["pieces"]:
            k = (pc["name"], pc["kind"])
            spans.setdefault(k, []).append(_Span(pc["start"], pc["stop"], pc["file"], pc["key"]))
            shape = tuple(pc["shape"])
            if shapes.setdefault(pc["name"], shape) != shape:
                raise CheckpointError(f"{mpath}: {pc['name']} has shapes {shapes[pc['name']]} and {shape}")
            dtypes[k] = pc["dtype"]
        for (name, kind), lst in spans.items():
            lst.sort(key=lambda s: s.start)
            numel = _numel(shapes[name])
            at = 0
            for s in lst:
                if s.start != at:
                    what = "overlap" if s.start < at else "a gap"
                    raise CheckpointError(f"{mpath}: pieces of {name}/{kind} have {what} at element {at}")
                at = s.stop
            if at != numel:
                raise CheckpointError(f"{mpath}: pieces of {name}/{kind} cover {at} of {numel} elements")
        return cls(path, manifest, spans, shapes, dtypes)

    # -- facts
    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def model_config(self) -> dict:
        return dict(self.manifest.get("model", {}))

    def names(self) -> list[str]:
        return list(self.shapes)

    def kinds(self, name: str) -> list[str]:
        return [k for (n, k) in self._spans if n == name]

    def check_model(self, config: dict) -> None:
        """Refuse a checkpoint of another model: name every setting that differs."""
        saved = self.model_config
        diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {config.get(k)!r}"
                for k in sorted(set(saved) | set(config)) if saved.get(k) != config.get(k)]
        if diff:
            raise CheckpointError(f"{self.path / MANIFEST} is a checkpoint of another model ("
                                  + "; ".join(diff) + "): start a new run, or resume with the same "
                                  "model settings")

    def check_pieces(self, pieces: Iterable) -> None:
        """Check, before loading, that every piece an engine owns can be served with its shape."""
        for p in pieces:
            if (p.name, p.kind) not in self._spans:
                raise CheckpointError(f"{self.path / MANIFEST} holds no {p.kind!r} state for {p.name}")
            if tuple(self.shapes[p.name]) != tuple(p.shape):
                raise CheckpointError(f"{self.path / MANIFEST}: {p.name} has shape "
                                      f"{tuple(self.shapes[p.name])}, the model has {tuple(p.shape)}")

    # -- reading
    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as e:  # header damage that the size check could not see
                raise CheckpointError(f"{self.path / file} cannot be read as safetensors: {e}") from None
        return self._handles[file]

    def read(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened full tensor ``name``/``kind``, from any ranks' pieces."""
        spans = self._spans.get((name, kind))
        if spans is None:
            raise CheckpointError(f"{self.path / MANIFEST} holds no {kind!r} state for {name}")
        numel = _numel(self.shapes[name])
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(f"range [{start}:{stop}) is outside {name} ({numel} elements)")
        out = None
        for s in spans:
            lo, hi = max(start, s.start), min(stop, s.stop)
            if lo >= hi:
                continue
            part = self._handle(s.file).get_slice(s.key)[lo - s.start: hi - s.start]
            if out is None:
                out = torch.empty(stop - start, dtype=part.dtype)
            out[lo - start: hi - start] = part
        if out is None:
            out = torch.empty(0, dtype=getattr(torch, self.dtypes[(name, kind)]))
        return out

    def full(self, name: str, kind: str = "param") -> torch.Tensor:
        shape = self.shapes[name]
        return self.read(name, kind, 0, _numel(shape)).view(shape)

    def rng(self, rank: int) -> dict[str, torch.Tensor]:
        """The RNG states rank ``rank`` saved (rank 0's when the checkpoint had fewer ranks)."""
        file = rank_file(rank if rank < self.world_size else 0)
        h = self._handle(file)
        return {k: h.get_tensor(k) for k in (RNG_CPU, RNG_CUDA) if k in h.keys()}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def resume_hint(out: str | None) -> str:
    """Where a stopped run can continue from, in words."""
    found = complete_checkpoints(Path(out) / "checkpoints") if out else []
    if not found:
        return "No checkpoint had been completed yet."
    return (f"The newest complete checkpoint is {found[-1]}; continue with: "
            f"zerodp train --out {out} --resume (with the same options)")
