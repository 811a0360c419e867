"""The three collectives of data parallelism, with accounting: AllReduce, ReduceScatter, AllGather.

Guide §2.4 and §9: a ring AllReduce of V bytes on N ranks sends 2(N−1)/N·V bytes per rank;
ReduceScatter and AllGather each send (N−1)/N·V, and AllReduce = ReduceScatter + AllGather.
Every call here records an :class:`~zerodp.engine.trace.Event` on the comm lane with

- ``kind``: ``all_reduce`` | ``reduce_scatter`` | ``all_gather``
- ``bytes``: V, the size of the full (unsharded) buffer
- ``sent_bytes``: what the ring algorithm sends per rank, as above
- ``label``: which bucket or unit it served
- ``leg``: ``intra`` inside a shard group, ``inter`` across replicas (hybrid sharding, guide §14)
- ``wait_s``: how long the host was blocked waiting for it — the *exposed* part

Averages are done as SUM followed by a division by N on our side: ``ReduceOp.AVG`` is missing
on gloo or has been silently wrong there in several releases.

Calls a script makes (state dicts, gradient norms, traces) run through :class:`Control`, a small
process group of the engine's own (guide §12.9): each carries its call's name and step, so a call
made on some ranks only, or two different calls on different ranks, end every rank within
``timeout_s`` with one line naming the call and its fix, and the process then exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import json
import pickle
import time

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from zerodp.engine import quant
from zerodp.engine.trace import COMM, Event, Recorder
from zerodp.plan.collectives import bus_factor

ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
#: stage 3's owner exchange (zerodp.engine.exchange): pieces of whole tensors to and from their owners
ALL_TO_ALL = "all_to_all"

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ring_sent_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends in a ring collective over a V-byte buffer (guide §2.4); for an
    all-to-all, V is what this rank sends (its own block included, which stays here)."""
    if kind == ALL_TO_ALL:
        return (world_size - 1) / world_size * nbytes
    return bus_factor(kind, world_size) * nbytes


class CollectiveTimeout(RuntimeError):
    """A collective of the engine waited longer than its ``timeout_s``: named, with what to do."""


@dataclass
class Pending:
    """An issued collective. :meth:`wait` blocks until done and applies any post-processing once."""

    event: Event
    recorder: Recorder
    work: object | None = None
    after: Callable[[], None] | None = None
    done: bool = field(default=False)
    timeout_s: float | None = None  # the engine's timeout_s: a collective other ranks never issue
    control: "Control | None" = None  # names the failure on every rank and lets the process exit

    def wait(self) -> None:
        """Block until done (CPU/gloo), or make the current CUDA stream wait for NCCL's (CUDA);
        ``wait_s`` is how long the host, or the stream, stood still for it: the trace's
        :meth:`~zerodp.engine.trace.Recorder.end_wait` times both (guide §13.3)."""
        if self.done:
            return
        mark = self.recorder.mark()
        if self.work is not None:
            if self.timeout_s is None:
                self.work.wait()
            else:
                began = time.monotonic()
                try:
                    self.work.wait(datetime.timedelta(seconds=self.timeout_s))
                except RuntimeError as e:
                    # only this wait's own limit is named here; an abort from elsewhere (the
                    # training app's watchdog) passes through as it is, unless another rank said why
                    own = time.monotonic() - began >= 0.9 * self.timeout_s
                    a = getattr(self.event, "args", None) or {}
                    if self.control is not None:
                        self.control.failed(f"{a.get('kind', 'collective')} {a.get('label', '')!r}", e, own)
                    if not own:
                        raise
                    raise CollectiveTimeout(
                        f"{a.get('kind', 'collective')} {a.get('label', '')!r} did not complete within "
                        f"{self.timeout_s:g} s: another rank never issued it — a forward, evaluation or save run on "
                        "some ranks only (at stage 3 every forward gathers each unit on every rank; run it on every "
                        "rank, or under the model outside the engine), or a rank that died or stalled. "
                        "parallelize(..., timeout_s=...) sets this limit") from e
        if self.after is not None:
            self.after()
        self.recorder.end_wait(self.event, mark)
        self.done = True


def gather_into(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> object:
    """Launch ``full`` ← every rank's ``shard`` in rank order (asynchronously; returns the work).

    On CPU tensors (gloo), whose AllGather gathers into a new buffer the size of ``full`` and
    copies it out — a whole group's worth of transient memory per gather in flight — it runs as
    one in-place broadcast per rank, each rank's slice of ``full`` sent from where it lies: every
    rank sends the same (N − 1)/N·V bytes as in the ring, and nothing is allocated (guide §12.5).
    Elsewhere it is one AllGather into ``full``. The calibration sweep times this same function."""
    n = dist.get_world_size(group)
    if full.device.type != "cpu" or n == 1:
        return all_gather_flat(full, shard, group=group, async_op=True)
    step = shard.numel()
    if full.numel() != n * step:
        raise ValueError(f"gathering {n} shards of {step} elements into {full.numel()}")
    r = dist.get_rank(group)
    mine = full[r * step:(r + 1) * step]
    if mine.data_ptr() != shard.data_ptr():  # (stages 1-2 in fp32: the shard is that slice)
        mine.copy_(shard)
    return _Works([dist.broadcast(full[r * step:(r + 1) * step], group=group, async_op=True, group_src=r)
                   for r in range(n)])


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
                        received: torch.Tensor | None = None) -> object:
    """Launch ``shard`` ← the sum over ranks of this rank's slice of ``full`` (asynchronously;
    returns the work, whose ``wait`` leaves the sum in ``shard``).

    On CPU tensors (gloo), whose ReduceScatter is an AllReduce of a copy of the input — twice
    the ring's bytes on the wire — it runs as one all-to-all of the slices: rank q sends its
    slice r of ``full`` to rank r, every rank sends the ring's (N − 1)/N·V bytes, and this rank
    adds the N slices it received in rank order (a receive buffer of V while it runs: ``received``
    when given, guide §12.5). Elsewhere it is one ReduceScatter. The calibration sweep times this
    same function."""
    n = dist.get_world_size(group)
    if full.device.type != "cpu" or n == 1:
        return reduce_scatter_flat(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if full.numel() != n * shard.numel():
        raise ValueError(f"reducing {full.numel()} elements into {n} slices of {shard.numel()}")
    if received is None:
        received = torch.empty_like(full)
    elif received.numel() != full.numel() or received.dtype != full.dtype:
        raise ValueError(f"a receive buffer of {received.numel()} {received.dtype} for {full.numel()} {full.dtype}")
    return _Summed(dist.all_to_all_single(received, full, group=group, async_op=True), received, shard, n)


class _Summed:
    """An all-to-all of slices whose ``wait`` then sums the N slices received into ``shard``
    (:func:`reduce_scatter_into`)."""

    def __init__(self, work, received: torch.Tensor, shard: torch.Tensor, n: int):
        self.work, self.received, self.shard, self.n = work, received, shard, n

    def wait(self, timeout=None) -> bool:
        self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.received is not None:
            pieces = self.received.view(self.n, -1)
            self.shard.copy_(pieces[0])
            for q in range(1, self.n):
                self.shard.add_(pieces[q])
            self.received = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _Works:
    """Several issued collectives waited for as one (the in-place AllGather's broadcasts)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class InFlight:
    """The collectives issued and not yet waited for, oldest first, each with a finisher to run
    once it completed. The engine keeps one for gradient reductions (buckets and units alike)
    and one for the parameter AllGathers after the step."""

    def __init__(self):
        self._items: deque[tuple[Pending, Callable[[], None] | None]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, pending: Pending, finish: Callable[[], None] | None = None) -> None:
        self._items.append((pending, finish))

    def wait_oldest(self) -> None:
        pending, finish = self._items.popleft()
        pending.wait()
        if finish is not None:
            finish()

    def wait_all(self) -> None:
        while self._items:
            self.wait_oldest()


class Collectives:
    """Collectives on one process group, each recorded. ``async_op=True`` returns a :class:`Pending`."""

    def __init__(self, recorder: Recorder, group: dist.ProcessGroup | None = None, leg: str = "intra",
                 timeout_s: float | None = None):
        self.timeout_s = timeout_s  # how long a wait may take before it ends with CollectiveTimeout
        self.group = group
        self.leg = leg  # hybrid sharding (guide §14): "intra" inside a shard group, "inter" across replicas
        self.recorder = recorder
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.control: Control | None = None  # set by the engine's Control: user calls and failures

    def _issue(self, kind: str, label: str, nbytes: int, launch: Callable[[], object],
               after: Callable[[], None] | None, async_op: bool) -> Pending:
        ev = self.recorder.begin(
            kind, COMM, kind=kind, label=label, bytes=nbytes,
            sent_bytes=ring_sent_bytes(kind, nbytes, self.world_size), leg=self.leg,
        )
        # Always launched asynchronously, so that a blocking call's whole duration shows as wait_s.
        # On CUDA, begin() recorded the start event on the current stream before the launch: NCCL's
        # stream waits for that point, so the event marks when the collective may start (guide §13.3).
        pending = Pending(ev, self.recorder, launch(), after, timeout_s=self.timeout_s, control=self.control)
        if not async_op:
            pending.wait()
        return pending

    def all_reduce_mean(self, tensor: torch.Tensor, label: str, async_op: bool = True) -> Pending:
        """Average ``tensor`` in place across ranks (stage 0's gradient sync, guide §3-§4)."""
        n = self.world_size
        return self._issue(
            ALL_REDUCE, label, tensor.numel() * tensor.element_size(),
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
            (lambda: tensor.div_(n)) if n > 1 else None, async_op,
        )

    def reduces_in_place(self, full: torch.Tensor, quant_block: int = 0, average_full: bool = True) -> bool:
        """Whether :meth:`reduce_scatter_grad` with ``clobber=True`` runs as an in-place AllReduce
        (CPU tensors, more than one rank, no int8, and the caller keeps ``full``: the mean is
        left there): the caller then needs no scratch. Otherwise a CPU ReduceScatter is an
        all-to-all (:func:`reduce_scatter_into`)."""
        return average_full and not quant_block and full.device.type == "cpu" and self.world_size > 1

    def reduce_scatter_grad(self, shard: torch.Tensor, full: torch.Tensor, label: str, overwrite: bool,
                            scratch: torch.Tensor | None = None, quant_block: int = 0,
                            clobber: bool = False, average_full: bool = False,
                            receive: torch.Tensor | None = None) -> Pending:
        """The gradient ReduceScatter of every stage (guide §9.1-§9.2, §10): ``shard`` ← (its
        value +) the mean over ranks of this rank's 1/N slice of ``full``.

        Lands straight in ``shard`` when it is to be overwritten and the dtypes agree; otherwise in
        ``scratch`` (a shard-sized buffer of ``full``'s dtype, allocated here if not given), which
        is then copied or added into ``shard`` — gradient accumulation across micro-batches, or an
        fp32 accumulator under a bf16 reduction.

        ``quant_block`` > 0: ZeRO++ qgZ (guide §15) — an all-to-all of int8 chunks with one scale
        per block, each rank averaging its own chunk in fp32 and adding it into ``shard`` (or
        writing it there); recorded as a ReduceScatter of the bytes on the wire.

        ``clobber`` with ``average_full`` (the caller keeps ``full``: gradients at rest, stage 1):
        on CPU tensors (gloo) the reduction is an AllReduce in place on ``full``, which is left
        holding the mean, as after stage 0's AllReduce, and this rank's slice is taken from it.
        Otherwise, on CPU, an all-to-all of the slices summed here (:func:`reduce_scatter_into`:
        the ring's bytes, half an AllReduce's, where gloo's own ReduceScatter sends an AllReduce's),
        into ``receive`` when given (a buffer of ``full``'s size and dtype)."""
        n = self.world_size
        if clobber and self.reduces_in_place(full, quant_block, average_full):
            lo = self.rank * shard.numel()
            piece = full[lo:lo + shard.numel()]

            def after_in_place() -> None:
                (full if average_full else piece).div_(n)
                if shard.data_ptr() != piece.data_ptr():  # else the shard is that slice (stage 1)
                    shard.copy_(piece) if overwrite else shard.add_(piece)

            return self._issue(
                REDUCE_SCATTER, label, full.numel() * full.element_size(),
                lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                after_in_place, True,
            )
        if quant_block:
            return self._issue(
                REDUCE_SCATTER, label, quant.int8_collective_bytes(full.numel(), n, quant_block),
                lambda: quant.reduce_scatter_int8(shard, full, self.group, block=quant_block, async_op=True,
                                                  accumulate=not overwrite),
                None, True)
        direct = overwrite and shard.dtype == full.dtype
        out = shard if direct else (scratch[:shard.numel()] if scratch is not None else
                                    torch.empty(shard.numel(), dtype=full.dtype, device=full.device))

        def after() -> None:
            if n > 1:
                out.div_(n)
            if not direct:
                shard.copy_(out) if overwrite else shard.add_(out)

        return self._issue(
            REDUCE_SCATTER, label, full.numel() * full.element_size(),
            lambda: reduce_scatter_into(out, full, self.group, receive),
            after, True,
        )

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, label: str,
                   async_op: bool = True, quant_block: int = 0) -> Pending:
        """``full`` ← every rank's ``shard`` concatenated in rank order (guide §9.1, §9.3); with
        ``quant_block`` > 0 as int8 blocks with one scale each (ZeRO++ qwZ, guide §15), every
        rank — this one included — dequantizing every piece, so all ranks compute alike.

        On CPU tensors it runs in place (:func:`gather_into`)."""
        n = self.world_size
        if quant_block:
            return self._issue(
                ALL_GATHER, label, quant.int8_collective_bytes(full.numel(), n, quant_block),
                lambda: quant.all_gather_int8(full, shard, self.group, block=quant_block, async_op=True),
                None, async_op)
        return self._issue(
            ALL_GATHER, label, full.numel() * full.element_size(),
            lambda: gather_into(full, shard, self.group), None, async_op,
        )

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int],
                   label: str) -> None:
        """Blocking: ``inp``'s block r (``in_sizes[r]`` elements, in rank order) to rank r, and
        ``out`` ← the blocks every rank sent here, in rank order (``out_sizes``); recorded with
        the bytes this rank sends (stage 3's owner exchange, :mod:`zerodp.engine.exchange`)."""
        self._issue(
            ALL_TO_ALL, label, inp.numel() * inp.element_size(),
            lambda: dist.all_to_all_single(out, inp, output_split_sizes=list(out_sizes),
                                           input_split_sizes=list(in_sizes), group=self.group, async_op=True),
            None, False,
        )

    def all_reduce_max(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Blocking MAX AllReduce for small control values (flags: MAX is a logical OR)."""
        self._issue(
            ALL_REDUCE, label, tensor.numel() * tensor.element_size(),
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True), None, False,
        )
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Blocking SUM AllReduce for small control values (norms, flags); recorded too."""
        self._issue(
            ALL_REDUCE, label, tensor.numel() * tensor.element_size(),
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True), None, False,
        )
        return tensor

    def reduce_for(self, call: "Call", tensor: torch.Tensor, op: str = "sum", detail: float = 0.0) -> torch.Tensor:
        """A user call's SUM (``op="sum"``) or MAX of a one-element ``tensor`` over this group's
        ranks, in place, through the engine's :class:`Control` (tagged with ``call``, bounded, and
        apart from the step's collectives); without one, a plain recorded AllReduce."""
        if self.world_size == 1:
            return tensor
        if self.control is None:
            reduce = self.all_reduce_sum if op == "sum" else self.all_reduce_max
            return reduce(tensor, call.label)
        values = self.control.exchange(call, float(tensor.reshape(-1)[0]), detail)
        mine = torch.tensor([values[r] for r in self.control.members(self.group)], dtype=torch.float64)
        tensor.fill_(mine.sum() if op == "sum" else mine.max())
        return tensor


# ---- calls a script makes: named, bounded, on a group of their own (guide §12.9) -----------------
@dataclass(frozen=True)
class Call:
    """A collective call a script makes, as the script spells it, and the one-line fix when it is
    made on some ranks only."""

    name: str
    fix: str
    label: str  # how the trace names its collectives

    @property
    def code(self) -> int:
        return CALLS.index(self) + 1


STATE_DICT = Call("engine.state_dict()", "take the state dict on every rank, save it on rank 0", "state_dict")
OPTIMIZER_STATE_DICT = Call(
    "engine.optimizer.state_dict() (engine.optimizer_state_dict())",
    "take the optimizer state dict on every rank, save it on rank 0", "optimizer_state_dict")
LOAD_STATE_DICT = Call("engine.load_state_dict()", "load on every rank, each passing the whole dict",
                       "load_state_dict")
LOAD_OPTIMIZER_STATE_DICT = Call(
    "engine.optimizer.load_state_dict() (engine.load_optimizer_state_dict())",
    "load on every rank, each passing the whole dict", "load_optimizer_state_dict")
FULL_STATE_DICT = Call("engine.full_state_dict()", "call it on every rank, use the result on rank 0",
                       "full_state_dict")
FULL_GRAD_DICT = Call("engine.full_grad_dict()", "call it on every rank, use the result on rank 0",
                      "full_grad_dict")
SCALAR_STATE = Call("engine.checkpoint.scalar_state()", "call it on every rank", "scalar_state")
GRAD_NORM = Call(
    "the norm of a sharded gradient (p.grad.norm(), torch.linalg.vector_norm(p.grad), "
    "torch.nn.utils.clip_grad_norm_ over the model's parameters)",
    "compute gradient norms on every rank (each is an AllReduce across the ranks), log them on rank 0",
    "grad_norm")
CLIP_GRAD_NORM = Call("engine.clip_grad_norm_()", "clip on every rank", "grad_norm")
CHROME_TRACE = Call("engine.export_chrome_trace()", "call it on every rank; rank 0 writes the file",
                    "chrome_trace")
SAVE_DCP = Call("zerodp.save_dcp(engine, ...)", "call it on every rank: each writes its part", "save_dcp")
LOAD_DCP = Call("zerodp.load_dcp(engine, ...)", "call it on every rank", "load_dcp")
UNIT_SCHEDULE = Call("the stage-3 unit schedule check of a forward or step",
                     "run every forward and step on every rank", "unit_schedule")
#: Every call, in a fixed order: a call's code is its place here (+1), the same on every rank.
CALLS = (STATE_DICT, OPTIMIZER_STATE_DICT, LOAD_STATE_DICT, LOAD_OPTIMIZER_STATE_DICT, FULL_STATE_DICT,
         FULL_GRAD_DICT, SCALAR_STATE, GRAD_NORM, CLIP_GRAD_NORM, CHROME_TRACE, SAVE_DCP, LOAD_DCP,
         UNIT_SCHEDULE)


class CallMismatch(RuntimeError):
    """The ranks made different calls (or the same call at different steps): raised on every rank,
    before anything of the call ran; the process group is intact."""


def user_call(call: Call):
    """Decorate a function whose first argument is an engine: the call runs under
    ``engine.control.call(call)`` (every rank checks that every other one makes it too)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(engine, *args, **kwargs):
            control = getattr(engine, "control", None)
            if control is None:
                return fn(engine, *args, **kwargs)
            with control.call(call):
                return fn(engine, *args, **kwargs)
        return inner
    return wrap


#: The longest a rank whose wait ran out waits for the other ranks to say what they were doing
#: (those in the step's collectives run out at about the same time; others may never say).
POSTS_WAIT_S = 30.0
#: Columns of a control exchange: the call's code, the step, a detail (a tensor's size), a value.
_ROW = 4


class Control:
    """The engine's process group for the calls a script makes, and its failure channel (guide §12.9).

    - Every user call (:func:`user_call`) starts with one tiny AllReduce on this group of
      ``(code, step)`` per rank, so every rank checks that every other one makes the same call at
      the same step; small values (gradient norms, :meth:`Collectives.reduce_for`) ride on that same
      AllReduce; objects are gathered here too (:meth:`all_gather_object`). Nothing here pairs with
      the step's collectives on the engine's groups, and no gradient bucket or unit gather runs
      here: the hot path keeps its collectives as they were.
    - Every wait is bounded by ``timeout_s``. When one runs out — here or on the engine's groups
      (:class:`Pending`) — this rank posts what it was doing in the job's store, reads what the
      other ranks posted (waiting up to ``timeout_s``, at most POSTS_WAIT_S, for them), and raises one
      :class:`CollectiveTimeout` naming the call made on some ranks only and its fix; it then keeps
      its process groups from being destroyed, whose destructors would wait for the collective
      that never completes, so that the process exits as soon as the script ends.
    """

    def __init__(self, recorder: Recorder, group: dist.ProcessGroup | None, timeout_s: float | None,
                 comms=()):
        self.recorder = recorder  # its step count tags every call
        self.timeout_s = timeout_s
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self._engine_group = group
        self._calls: list[Call] = []  # the user calls in progress on this rank, outermost first
        self.failure: str | None = None
        self.group = None  # connected at the first call (most engines never make one)
        self.name = self._name(group) if self.world_size > 1 else None
        self._comms = [c for c in comms if c is not None]
        for c in self._comms:
            c.control = self

    def _name(self, group: dist.ProcessGroup | None) -> str:
        """This control's name in the job's store: the engine group's name and how many controls
        each of its ranks built before (every rank builds its engines in the same order)."""
        base = f"zerodp/control/{group.group_name if group is not None else 'world'}"
        return f"{base}/{self._store().add(f'{base}/built/{self.rank}', 1)}"

    def _connected(self, call: Call):
        """The gloo group of the engine's ranks, connected through the job's store under this
        control's name at the first call that needs it (bounded by ``timeout_s`` like any wait).
        Only the engine's ranks take part, and torch does not register it: it goes with this object."""
        if self.group is None:
            limit = datetime.timedelta(seconds=self.timeout_s or 1800)
            try:
                self.group = dist.ProcessGroupGloo(dist.PrefixStore(self.name, self._store()), self.rank,
                                                   self.world_size, limit)
            except RuntimeError as e:
                self.failed(f"{call.name} (connecting the ranks)", e, True, call)
                raise
        return self.group

    # ---- calls ----------------------------------------------------------------------------------
    @property
    def current(self) -> Call | None:
        return self._calls[0] if self._calls else None

    @contextlib.contextmanager
    def call(self, call: Call) -> Iterator[None]:
        """Run a user call: the outermost one checks, in one exchange, that every rank makes it."""
        outer = not self._calls
        self._calls.append(call)
        try:
            if outer:
                self.exchange(call)
            yield
        finally:
            self._calls.pop()

    def members(self, group: dist.ProcessGroup | None) -> list[int]:
        """The places, in this group's rank order, of ``group``'s ranks (a shard group's)."""
        if group is None or group is self._engine_group:
            return list(range(self.world_size))
        return [self.ranks.index(r) for r in dist.get_process_group_ranks(group)]

    def exchange(self, call: Call, value: float = 0.0, detail: float = 0.0) -> list[float]:
        """One AllReduce on this group: every rank's ``(call, step, detail)`` is checked against
        every other's (:class:`CallMismatch` on every rank when they differ) and every rank's
        ``value`` comes back, by rank."""
        if self.world_size == 1:
            return [value]
        group = self._connected(call)
        rows = torch.zeros(self.world_size, _ROW, dtype=torch.float64)
        rows[self.rank] = torch.tensor([call.code, self.recorder.step, detail, value], dtype=torch.float64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self._wait(group.allreduce([rows], options), call)
        table = rows.tolist()
        if len({tuple(r[:3]) for r in table}) > 1:
            raise CallMismatch(self._mismatch(table))
        return [r[3] for r in table]

    def all_gather_object(self, obj, call: Call | None = None) -> list:
        """``dist.all_gather_object`` on this group, bounded and tagged (the current call's name)."""
        call = call or self.current or UNIT_SCHEDULE
        if self.world_size == 1:
            return [obj]
        data = pickle.dumps(obj)
        sizes = [int(n) for n in self.exchange(call, float(len(data)))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(self._connected(call).allgather([out], [padded]), call)
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(out, sizes)]

    def _wait(self, work, call: Call) -> None:
        if self.timeout_s is None:
            work.wait()
            return
        began = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            self.failed(f"{call.name} ({call.label})", e, time.monotonic() - began >= 0.9 * self.timeout_s, call)
            raise

    def _mismatch(self, table: list[list[float]]) -> str:
        def said(r: int) -> str:
            code, step = int(table[r][0]), int(table[r][1])
            name = CALLS[code - 1].name if 0 < code <= len(CALLS) else f"call #{code}"
            return f"rank {r} made {name} at step {step}"

        calls = {int(r[0]) for r in table}
        fixes = "; ".join(dict.fromkeys(CALLS[c - 1].fix for c in sorted(calls) if 0 < c <= len(CALLS)))
        return (f"the ranks made different collective calls ({'; '.join(said(r) for r in range(len(table)))}): "
                f"every rank must make the same engine calls in the same order — {fixes}")

    # ---- failures --------------------------------------------------------------------------------
    def failed(self, what: str, error: BaseException, own_timeout: bool, call: Call | None = None) -> None:
        """A wait on one of the engine's groups ended with ``error``: after its own ``timeout_s``
        (``own_timeout``), or early (a rank gone, a watchdog's abort). Raise the named
        :class:`CollectiveTimeout` on this rank once the ranks have said what each was doing; an
        early error that no other rank explained returns, for the caller to raise as it is."""
        store = self._store()
        posts: dict[int, dict] | None = {}
        if not own_timeout:
            posts = self._read(store, wait_s=0.0)
            if posts is None:  # the store went with the rank that hosted it: that rank's process ended
                self.abandon()
                said = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise CollectiveTimeout(
                    f"{what} failed: another rank's process ended (its own message says why: a call made on "
                    f"some ranks only, a crash, or a stall); the job ends (backend said: {said[:300]})") from error
            if not posts:
                return
        call = call or self.current
        mine = {"call": call.name if call else None, "what": what}
        with contextlib.suppress(Exception):
            store.set(self._key("failed", self.rank), json.dumps(mine))
        posts = self._read(store, wait_s=min(self.timeout_s or 0.0, POSTS_WAIT_S)) or {}
        posts[self.rank] = mine
        with contextlib.suppress(Exception):  # the store may live in this process: the others read first
            store.set(self._key("read", self.rank), "1")
            store.wait([self._key("read", r) for r in range(self.world_size) if r in posts],
                       datetime.timedelta(seconds=min(self.timeout_s or 1.0, 10.0)))
        self.failure = self._message(posts, what)
        self.abandon()
        raise CollectiveTimeout(self.failure) from error

    def _store(self):
        if self.world_size == 1:
            return None
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: each rank speaks for itself
            return None

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.name}/{kind}/{rank}"

    def _read(self, store, wait_s: float) -> dict[int, dict] | None:
        """What the other ranks posted, waiting up to ``wait_s`` for every one of them (None: the
        store cannot be reached)."""
        if store is None:
            return {}
        keys = {r: self._key("failed", r) for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + wait_s
        posts: dict[int, dict] = {}
        try:
            while True:
                for r, key in keys.items():
                    if r not in posts and store.check([key]):
                        posts[r] = json.loads(store.get(key))
                if len(posts) == len(keys) or time.monotonic() >= deadline:
                    return posts
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store went with a rank that ended
            return posts or None

    def _message(self, posts: dict[int, dict], what: str) -> str:
        limit = f"{self.timeout_s:g} s" if self.timeout_s else "its limit"
        called = {}
        for r in sorted(posts):
            if posts[r]["call"]:
                called.setdefault(posts[r]["call"], []).append(r)
        silent = [r for r in range(self.world_size) if r not in posts]
        elsewhere = "; ".join(
            [f"rank {r} was in {posts[r]['what']}" for r in sorted(posts) if not posts[r]["call"]]
            + [f"rank {r} said nothing (stalled, gone, or outside the engine)" for r in silent])
        after = "; the job ends (parallelize(..., timeout_s=...) sets the limit)"
        if len(called) == 1 and (silent or len(posts) > len(next(iter(called.values())))):
            name, ranks = next(iter(called.items()))
            fix = next(c.fix for c in CALLS if c.name == name)
            return (f"{name} was called on rank {', '.join(map(str, ranks))} only, and waited {limit} for the "
                    f"others ({elsewhere}): {fix}{after}")
        if called:
            names = "; ".join(f"{n} on rank {', '.join(map(str, rs))}" for n, rs in called.items())
            return (f"the ranks made different collective calls ({names}; {elsewhere or 'no other'}), waited "
                    f"{limit}: every rank must make the same engine calls in the same order{after}")
        return (f"{what} did not complete within {limit}: another rank never issued it — a forward, "
                "evaluation or save run on some ranks only (at stage 3 every forward gathers each unit on every "
                "rank; run it on every rank, or under the model outside the engine), or a rank that died or "
                f"stalled ({elsewhere or 'every rank waited'}){after}")

    def abandon(self) -> None:
        """Keep the engine's process groups from ever being destroyed: a group with a collective
        that never completes blocks in its destructor (gloo waits for its worker threads) and the
        process would never exit. Torch's ``abort`` does not end gloo's work; a reference that is
        never released does (the groups are unusable from here on anyway)."""
        groups = [self._engine_group] + [c.group for c in self._comms]
        with contextlib.suppress(Exception):
            groups.append(dist.distributed_c10d._get_default_group())
        kept: set[int] = set()
        for g in [self.group] + groups:
            if g is None or id(g) in kept:
                continue
            kept.add(id(g))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))
            for device_type in getattr(g, "_device_types", []):
                with contextlib.suppress(Exception):
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(g._get_backend(device_type)))
