"""The calls a script makes — state dicts, gradient norms, traces — and the engine's channel for
them and for failures: :class:`Control`, a small gloo group of the engine's own (guide §12.9).

Each call carries its name and step, so a call made on some ranks only, or two different calls on
different ranks, ends every rank with one line naming the call and its fix, and the process then
exits. A call whose result is well defined while the other ranks are elsewhere (a rank-0-only
``state_dict()``, the habit of DDP scripts) is *served*: a rank waiting in one of the step's
collectives (:class:`~zerodp.engine.comm.Pending`) reads, in the job's store, that another rank is
in such a call, joins it, and goes back to its wait (:meth:`Control.serve_pending`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import enum
import functools
import json
import pickle
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from zerodp.engine.comm import CollectiveTimeout
from zerodp.engine.trace import Recorder


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
EVAL_FORWARD = Call("a forward under torch.no_grad() at stage 3 (an evaluation)",
                    "evaluate on every rank, or on rank 0 while the others are before their next step",
                    "eval_forward")
#: inside a served evaluation: the caller gathers one unit (detail: its index), or ends the forward
UNIT_GATHER = Call("a unit's AllGather of a served evaluation", "evaluate on every rank", "eval_gather")
FORWARD_END = Call("the end of a served evaluation", "evaluate on every rank", "eval_end")
#: Every call, in a fixed order: a call's code is its place here (+1), the same on every rank.
CALLS = (STATE_DICT, OPTIMIZER_STATE_DICT, LOAD_STATE_DICT, LOAD_OPTIMIZER_STATE_DICT, FULL_STATE_DICT,
         FULL_GRAD_DICT, SCALAR_STATE, GRAD_NORM, CLIP_GRAD_NORM, CHROME_TRACE, SAVE_DCP, LOAD_DCP,
         UNIT_SCHEDULE, EVAL_FORWARD, UNIT_GATHER, FORWARD_END)


class CallMismatch(RuntimeError):
    """The ranks made different calls (or the same call at different steps): raised on every rank,
    before anything of the call ran; the process group is intact."""


def user_call(call: Call, local: Callable[[object], bool] | None = None):
    """Decorate a function whose first argument is an engine: the call runs under
    ``engine.control.call(call)`` (every rank checks that every other one makes it too) — unless
    ``local(engine)`` says that every rank holds all the call reads (stage 0's state dicts, as
    DDP's): then it runs on this rank alone, communicating nothing, as the script's own code."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(engine, *args, **kwargs):
            control = getattr(engine, "control", None)
            if control is None or (local is not None and not control.in_call and local(engine)):
                return fn(engine, *args, **kwargs)
            with control.call(call):
                return fn(engine, *args, **kwargs)
        return inner
    return wrap


#: The longest a rank whose wait ran out waits for the other ranks to say what they were doing
#: (those in the step's collectives run out at about the same time; others may never say).
POSTS_WAIT_S = 30.0
#: Columns of a control exchange: the call's code, the step, a detail (a tensor's size), a value,
#: whether the rank serves another's call (1) or made the call itself (0), and the call's number on
#: the rank that made it (so that a rank never serves the same call twice).
_ROW = 6
#: The calls a rank may make alone, served by the others (their result is well defined while the
#: other ranks are anywhere before their next optimizer step: the master values and optimizer
#: states do not change until then). Every other call made on some ranks only ends every rank.
SERVED = (STATE_DICT, OPTIMIZER_STATE_DICT, FULL_STATE_DICT, EVAL_FORWARD)
#: Calls made every step (per parameter, per unit): not announced in the store, whose round trip
#: would then be on the hot path; made on some ranks only they end every rank after ``timeout_s``.
UNANNOUNCED = (GRAD_NORM, CLIP_GRAD_NORM, UNIT_SCHEDULE)
#: How often a rank waiting in one of the step's collectives looks in the job's store for a call
#: another rank makes alone (a collective that completes sooner never looks).
POLL_S = 0.25
#: the least time the control group gets to connect when the engine is built (parallelize is collective)
CONNECT_FLOOR_S = 60.0
#: The longest a rank at the end of its script serves the others' calls made alone, waiting for
#: every rank to end (``timeout_s`` when shorter; :meth:`Control.serve_until_all_exit`): a final save
#: comes right after the last step; a rank that never ends (stalled, or failed outside the engine
#: under a launcher that exits quietly) keeps this one no longer than this.
EXIT_WAIT_S = 60.0


def _serve_at_exit(ref: "weakref.ref[Control]") -> None:
    """The interpreter is exiting: the control, if its engine still lives, serves the calls the
    other ranks make alone until every rank has ended (:meth:`Control.serve_until_all_exit`)."""
    control = ref()
    if control is not None:
        control.serve_until_all_exit()


class Routing(enum.Enum):
    """Where the collectives inside a user call go (:meth:`Control.call`)."""

    ENGINE = "engine"  # every rank made the call: the engine's own groups
    CALLER = "caller"  # this rank made it and other ranks serve it from a wait: the control group
    SERVER = "server"  # this rank serves another's call from inside a wait: the control group, and
    # nothing of its own step in flight is touched (no gradient sync, no module values folded)


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
        self.routing = Routing.ENGINE  # of the call in progress (Routing)
        self._number = 0  # calls this rank made (announced in the store, see SERVED)
        self._joined: dict[int, int] = {}  # per rank, the number of its last call this rank took part in
        #: what this rank runs to serve each of SERVED (set by the engine): the call, its results dropped
        self.servers: dict[Call, Callable[[], object]] = {}
        self.poll_s = POLL_S if self.world_size > 1 else None  # read by Pending's wait
        self.failure: str | None = None
        self.ended_by: str | None = None  # the error the script is ending with, when it says so (end_with)
        self.group = None  # connected at construction (below)
        self._job_store = self._default_store()  # kept: a script may destroy the process group before it exits
        self.name = self._name(group) if self.world_size > 1 else None
        self._comms = [c for c in comms if c is not None]
        for c in self._comms:
            c.control = self
        if self.world_size > 1:  # now, while every rank builds the engine: a call made alone later must
            self._connected(UNIT_SCHEDULE)  # not wait in a rendezvous it cannot poll (serve_pending)
            # the newest engine of this process serves at its exit (serve_until_all_exit): counted in the store
            self._newest = f"zerodp/controls/{dist.get_rank()}"
            self._number_built = self._job_store.add(self._newest, 1) if self._job_store is not None else 0
            atexit.register(_serve_at_exit, weakref.ref(self))

    def _name(self, group: dist.ProcessGroup | None) -> str:
        """This control's name in the job's store: the engine group's name and how many controls
        each of its ranks built before (every rank builds its engines in the same order)."""
        base = f"zerodp/control/{group.group_name if group is not None else 'world'}"
        return f"{base}/{self._store().add(f'{base}/built/{self.rank}', 1)}"

    def _connected(self, call: Call):
        """The gloo group of the engine's ranks, connected through the job's store under this
        control's name when the engine is built (bounded by ``timeout_s`` like any wait).
        Only the engine's ranks take part, and torch does not register it: it goes with this object."""
        if self.group is None:
            # Connecting is part of parallelize, which every rank calls: a short timeout_s (seconds,
            # for the waits) must not fail a slow start-up on a loaded machine. Waits poll their own limit.
            limit = datetime.timedelta(seconds=max(self.timeout_s or 1800, CONNECT_FLOOR_S))
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

    @property
    def in_call(self) -> bool:
        """A user call is in progress on this rank (not run locally: see :func:`user_call`)."""
        return bool(self._calls)

    @property
    def routed(self) -> bool:
        """The call in progress runs its collectives on this control group (some rank serves it)."""
        return self.routing is not Routing.ENGINE

    @property
    def serving(self) -> bool:
        return self.routing is Routing.SERVER

    @contextlib.contextmanager
    def call(self, call: Call) -> Iterator[None]:
        """Run a user call: the outermost one checks, in one exchange, that every rank makes it or
        serves it (:meth:`serve_pending`), and announces itself in the job's store first, so that a
        rank waiting in the step's collectives can serve it (SERVED) or end with its name."""
        outer = not self._calls
        self._calls.append(call)
        announced = False
        try:
            if outer:
                if not self.serving:
                    self._number += 1
                    announced = self._announce(call)
                table = self._rows(call, 0.0, 0.0)
                for r, row in enumerate(table):
                    self._joined[r] = max(self._joined.get(r, 0), int(row[5]))
                if not self.serving and any(row[4] for row in table):
                    self.routing = Routing.CALLER
            yield
        finally:
            self._calls.pop()
            if outer:
                if not self.serving:
                    self.routing = Routing.ENGINE
                if announced:
                    with contextlib.suppress(Exception):
                        self._store().delete_key(self._key("calling", self.rank))

    def _announce(self, call: Call) -> bool:
        if self.world_size == 1 or call in UNANNOUNCED:
            return False
        store = self._store()
        if store is None:
            return False
        store.set(self._key("calling", self.rank),
                  json.dumps({"code": call.code, "step": self.recorder.step, "number": self._number}))
        return True

    def serve_pending(self, what: str, at_exit: bool = False) -> None:
        """Called by a rank that has waited POLL_S in one of the step's collectives (``what``):
        a call another rank is making alone is served here — this rank joins it with its
        collectives on the control group, drops the result and goes back to its wait — when it
        is one of SERVED and the two ranks are at the same step; any other call ends this rank
        at once, and the caller with it (:meth:`_refuse`), instead of both waiting ``timeout_s``.
        So does another rank's end of its script (:meth:`_refuse_ended`), except ``at_exit``: this
        rank has ended too and serves until every rank has."""
        if self._calls or self.world_size == 1:
            return
        store = self._store()
        if store is None:
            return
        if not at_exit:
            self._refuse_ended(store, what)
        for r, post in self._posts(store, "calling"):
            if post["number"] <= self._joined.get(r, 0):
                continue
            call = CALLS[int(post["code"]) - 1]
            serve = self.servers.get(call)
            if serve is None or int(post["step"]) != self.recorder.step:
                self._refuse(call, r, post, what)
            self.routing = Routing.SERVER
            try:
                serve()
            finally:
                self.routing = Routing.ENGINE
            return

    def _refuse_ended(self, store, what: str) -> None:
        """A rank whose script has ended (it posted so at its exit: :meth:`serve_until_all_exit`)
        makes no more collectives of the step: this rank's wait in one ends now, in one line, and
        not when that rank's process goes (a bare backend error) or after ``timeout_s``."""
        for r, post in self._posts(store, "ended"):
            if post.get("error"):
                why = f"rank {r}'s script ended with {post['error'][:200]}"
                fix = "its own message says why"
            else:
                why = f"rank {r} reached the end of its script after {post.get('step')} steps"
                fix = ("every rank must take the same number of steps: give each the same number of batches "
                       "(DistributedSampler(..., drop_last=True), or drop the last uneven batch on every rank)")
            self.failure = (f"{why} while rank {self.rank} waits in {what} in step {self.recorder.step + 1}: {fix}; "
                            "the job ends")
            self.abandon()
            raise CollectiveTimeout(self.failure)

    def _posts(self, store, kind: str):
        """The other ranks' posts of ``kind`` in the job's store, as (rank, post)."""
        for r in range(self.world_size):
            key = self._key(kind, r)
            try:
                if r == self.rank or not store.check([key]):
                    continue
                post = json.loads(store.get(key))
            except Exception:  # noqa: BLE001 - the post went between check and get, or the store did
                continue
            yield r, post

    def _refuse(self, call: Call, caller: int, post: dict, what: str) -> None:
        """End this rank, and through the store the caller, with one message naming the call."""
        if call in SERVED:
            why = (f"it was made at step {post['step']} and this rank has gone on to step {self.recorder.step} "
                   "(it is served only before the other ranks' next optimizer step)")
        else:
            why = "its result needs every rank's part of the step"
        message = (f"{call.name} was called on rank {caller} only while rank {self.rank} waited in {what}: "
                   f"{why}; {call.fix}; the job ends")
        with contextlib.suppress(Exception):
            self._store().set(self._key("failed", self.rank),
                              json.dumps({"call": None, "what": what, "refused": message}))
        with contextlib.suppress(Exception):  # the caller may be connecting the control group: let it, so
            self._connected(call)  # that it reaches its wait, which reads the post above
        self.failure = message
        self.abandon()
        raise CollectiveTimeout(message)

    def members(self, group: dist.ProcessGroup | None) -> list[int]:
        """The places, in this group's rank order, of ``group``'s ranks (a shard group's)."""
        if group is None or group is self._engine_group:
            return list(range(self.world_size))
        return [self.ranks.index(r) for r in dist.get_process_group_ranks(group)]

    def exchange(self, call: Call, value: float = 0.0, detail: float = 0.0) -> list[float]:
        """One AllReduce on this group: every rank's ``(call, step, detail)`` is checked against
        every other's (:class:`CallMismatch` on every rank when they differ) and every rank's
        ``value`` comes back, by rank."""
        return [r[3] for r in self._rows(call, value, detail)]

    def _rows(self, call: Call, value: float, detail: float) -> list[list[float]]:
        if self.world_size == 1:
            return [[call.code, self.recorder.step, detail, value, 0.0, self._number]]
        group = self._connected(call)
        rows = torch.zeros(self.world_size, _ROW, dtype=torch.float64)
        rows[self.rank] = torch.tensor([call.code, self.recorder.step, detail, value, float(self.serving),
                                        self._number], dtype=torch.float64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self._wait(group.allreduce([rows], options), call)
        table = rows.tolist()
        made = [r for r in table if not r[4]]  # a serving rank's row follows the caller's
        if len({tuple(r[:3]) for r in made}) > 1:
            raise CallMismatch(self._mismatch(table))
        return table

    # ---- a served evaluation (stage 3): the caller's unit gathers, over this group ------------
    def routed_gather(self, full: torch.Tensor, shard: torch.Tensor, group, index: int) -> None:
        """The caller of a served call gathers unit ``index`` (:meth:`serve_gathers` on the others)."""
        self._rows(UNIT_GATHER, 0.0, float(index))
        self.all_gather_flat(full, shard, group)

    def end_routed(self) -> None:
        """The caller's served forward is over: the serving ranks go back to their waits."""
        self._rows(FORWARD_END, 0.0, 0.0)

    def serve_gathers(self, shard_of: Callable[[int], tuple[torch.Tensor, object]]) -> None:
        """A serving rank's part of another rank's evaluation forward: each unit it gathers
        (``shard_of(index)``: this rank's shard and its group), until the forward ends."""
        while True:
            table = self._rows(UNIT_GATHER, 0.0, -1.0)
            caller = next(row for row in table if not row[4])
            if int(caller[0]) == FORWARD_END.code:
                return
            shard, group = shard_of(int(caller[2]))
            self.all_gather_flat(None, shard, group)

    def all_gather_flat(self, flat: torch.Tensor | None, local: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """``flat`` ← the ``local`` parts of ``group``'s ranks in their order, over this control
        group (a served call's AllGather: the engine's groups have the servers' step collectives
        in flight). Every rank of the engine sends its part; each keeps its own group's (a
        serving rank, ``flat=None``, none)."""
        call = self.current or UNIT_GATHER
        parts = [torch.empty_like(local, device="cpu") for _ in range(self.world_size)]
        self._wait(self._connected(call).allgather([parts], [local.detach().cpu().contiguous()]), call)
        if flat is not None:
            flat.copy_(torch.cat([parts[r] for r in self.members(group)]).to(flat.device))

    def broadcast_from_rank0(self, t: torch.Tensor) -> None:
        """``t`` ← rank 0's ``t``, over this control group (a served call's broadcast)."""
        buf = t.detach().cpu().contiguous()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self._connected(self.current).broadcast([buf], options), self.current)
        t.copy_(buf.to(t.device))

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
        """Bounded by ``timeout_s``; every POLL_S it looks whether another rank has refused this
        call (:meth:`_refuse`), so that the caller ends within seconds of it, with its message."""
        if self.timeout_s is None:
            work.wait()
            return
        began = time.monotonic()
        while True:
            left = self.timeout_s - (time.monotonic() - began)
            try:
                work.wait(datetime.timedelta(seconds=max(min(POLL_S, left), 0.001)))
                return
            except RuntimeError as timed_out:
                error = timed_out
                if work.is_completed():  # completed as the slice ran out: its own outcome decides
                    try:
                        work.wait()
                        return
                    except RuntimeError as failed:
                        error = failed
                elif left > POLL_S and self._refusal() is None:
                    continue
                refusal = self._refusal()
                if refusal is not None:
                    self.failure = refusal
                    self.abandon()
                    raise CollectiveTimeout(refusal) from error
                own = time.monotonic() - began >= 0.9 * self.timeout_s
                self.failed(f"{call.name} ({call.label})", error, own, call)
                if call in SERVED and not own:  # the ranks that would serve it are gone
                    self.abandon()
                    raise CollectiveTimeout(
                        f"{call.name} was made on this rank alone and another rank's process ended before serving "
                        "it: the others serve such a call from their next step's collectives or, after their last "
                        "step, from the end of their script (a process that ends otherwise serves nothing) — "
                        f"{call.fix}; the job ends") from error
                raise error from None

    def _refusal(self) -> str | None:
        """The message of another rank that refused a call this rank made (:meth:`_refuse`)."""
        store = self._store()
        if store is None:
            return None
        try:
            for r in range(self.world_size):
                key = self._key("failed", r)
                if r != self.rank and store.check([key]):
                    refused = json.loads(store.get(key)).get("refused")
                    if refused:
                        return refused
        except Exception:  # noqa: BLE001 - the store went with a rank that ended
            return None
        return None

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
        return self._job_store

    def _default_store(self):
        if self.world_size == 1:
            return None
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: each rank speaks for itself
            return None

    def end_with(self, error: BaseException) -> None:
        """The script is ending with ``error`` (a training loop that caught it says so before it
        re-raises): at the exit this rank then only posts its end and serves nothing, so that its
        process ends at once and the other ranks learn of it from their collectives."""
        self.ended_by = f"{type(error).__name__}: {error}"

    def serve_until_all_exit(self) -> None:
        """At the end of the script (the interpreter's exit): serve the calls another rank makes
        alone after its last step — DDP's habit, ``if rank == 0: torch.save({"model":
        model.state_dict(), "optimizer": optimizer.state_dict()}, path)`` once training is over —
        until every rank has reached the end of its own script, at most ``timeout_s`` or
        :data:`EXIT_WAIT_S`, whichever is shorter. Each rank posts in the job's store that it has
        ended and serves (:meth:`serve_pending`) until every rank's post is there. Only the newest engine of
        the process serves; after a failure of the engine, or when the script ended with an
        exception (uncaught, or reported by :meth:`end_with`), it only posts: a call it would have
        served learns of the end from its collectives at once, as before (guide §12.9)."""
        if self.world_size == 1:
            return
        store = self._store()
        ended = [self._key("ended", r) for r in range(self.world_size)]
        try:
            last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # an uncaught exception
            error = self.failure or self.ended_by or (f"{type(last).__name__}: {last}" if last is not None else None)
            store.set(ended[self.rank], json.dumps({"step": self.recorder.step, "error": error}))  # first: the
            # others wait for no rank that has ended
            newest = store.add(self._newest, 0) == self._number_built
        except Exception:  # noqa: BLE001 - no store (the rank that hosted it has ended): nothing to serve
            return
        if (not newest or self.failure is not None or self.ended_by is not None or hasattr(sys, "last_value")
                or getattr(sys, "last_exc", None) is not None):
            return
        deadline = time.monotonic() + min(self.timeout_s or EXIT_WAIT_S, EXIT_WAIT_S)
        while time.monotonic() < deadline:
            try:
                if store.check(ended):
                    return
                self.serve_pending("the end of its script", at_exit=True)
            except CollectiveTimeout as refused:  # a call that cannot be served: the caller has its message
                print(f"zerodp: rank {self.rank}: {refused}", file=sys.stderr)
                return
            except Exception:  # noqa: BLE001 - the store went with the rank that hosted it: it has ended
                return
            time.sleep(POLL_S)

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
            + [f"rank {r} said nothing (stalled, gone, or waiting outside the engine — in a dist.barrier() or "
               "all_reduce of the script's own, which cannot serve: put it before this call)" for r in silent])
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
