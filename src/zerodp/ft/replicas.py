"""The replica-group side of hybrid sharding when each replica group is a job of its own.

A :class:`ReplicaGroups` is what ``parallelize(model, ..., replicas=ReplicaGroups(...))`` talks to
across the groups; inside the group (this job's ``torch.distributed`` world of g ranks) the engine
runs its stage as always (flat ZeRO over the group). One object per rank, built before the engine:

* **communication**: the engine calls :meth:`all_reduce_mean` where hybrid sharding averages a
  gradient shard across the replicas (``zerodp.engine.gradbuf``: stages 1-3 the ReduceScatter's
  shard, stage 0 the AllReduced bucket). It goes through ``torchft.Manager.allreduce`` on a
  reconfigurable ``torchft.ProcessGroupGloo`` that joins the ranks with this rank's shard index
  in every live group: the sum divided by the number of groups in the quorum, so the step is
  data parallelism over the live groups. An error there (a peer died) is swallowed by the
  manager and makes the step not commit.
* **commit**: the engine calls :meth:`should_commit` in ``step()`` after the gradients are final
  and before the optimizer; False (an error in this group, too few groups) skips the step on
  every rank of the group, as a non-finite gradient does (no parameter, optimizer state or step
  count changes). torchft's step count then stays behind; a group behind the quorum's
  ``max_step`` heals at the next quorum.
* **quorum and healing**: the training loop calls :meth:`start_step` before each step's forward
  (``Manager.start_quorum``). A group that joins (restarted after a failure, or behind) receives,
  on every rank, the state of the rank with the same shard index in a live group — torchft's
  checkpoint transport (HTTP) carrying the engine's own pieces: master values and optimizer
  states of everything the rank holds (its shard at stages 1-3, the whole model at stage 0), the
  optimizer's scalars, the module's buffers, the CPU RNG, torchft's step and committed-batch
  count, and what the loop registered with :meth:`attach` (data position, LR scheduler), each as
  it was at the start of the peer's step. The group loads it with ``engine.checkpoint``
  (collective inside the group: every rank of a healing group heals in the same quorum) while no
  step is in flight, and steps on bitwise equal to its peers.
* **the quorum behind the forward** (``overlap_quorum=True``, the default; not under DiLoCo): the
  quorum forms while the step computes (torchft's asynchronous quorum) and the step waits for it
  at its first cross-group collective or its vote, so the step no longer pays the quorum's round
  trip to the lighthouse (docs/reliability.md measures it). The step's batch is chosen before the
  quorum is known, from the last step's (this group's rank among the participants, the
  committed-batch count). A step whose participants or rank differ from the last step's — a
  fresh run's first step, the step in which a group left, the step after a group healed — does
  not commit, in every group alike (the participants are the quorum's, the same everywhere), and
  is taken again, so no batch is taken twice or skipped; a step that does not commit leaves the
  CPU RNG and the module's buffers as they were at its start. A healing group takes no part in
  the step its peer's state arrives in (torchft's asynchronous heal: its gradient is left out of
  the mean, :attr:`took_part` is False): it loads that state inside its vote, before its
  optimizer applies the step's mean as the peer's does, and commits when the peer does. Its CPU
  RNG is then the peer's at that step's start: parameters and optimizer states are bitwise the
  peer's, but a forward that draws random numbers (dropout) draws others than a fault-free run.
  ``overlap_quorum=False`` (every group of the job alike): the quorum is waited for in
  :meth:`start_step` and a joining group heals before its forward.

**Data.** :meth:`batch_index` is the global index of the batch this group takes this step:
torchft's committed-batch count (the same in every live group, carried to a healing group) plus
this group's rank among the participants. A committed step advances the count by the number of
groups that took part, so over the committed steps every batch index is taken exactly once —
none twice, none skipped; a step that does not commit is taken again with the same indices.

**DiLoCo** (``outer=zerodp.DiLoCo(every=H)``, fp32, τ = 0): the inner steps send nothing across
the groups; a sync's pseudo-gradient mean is the only cross-group collective, and the step's vote
comes after it (``zerodp.engine.outer.OuterLoop.step``): a sync whose exchange failed applies no
outer update. A healing group receives the outer state too (θ_outer, momentum, the outer step
count) with the peer's inner state — it carries on as a copy of that peer, at any step of a round.

The engine's hook receives its collaborators only (:meth:`bind`: the recorder, the group's comm);
the healing state is read through the engine given to :meth:`attach`.
"""

from __future__ import annotations

import enum
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from zerodp.engine.comm import ALL_REDUCE, ring_sent_bytes
from zerodp.engine.outer import OuterState
from zerodp.engine.state_dict import BUFFER
from zerodp.engine.states import moved, transitions
from zerodp.engine.trace import COMM

#: the state-dict key zerodp's healing state is registered under in the torchft manager
STATE_KEY = "zerodp"


def _torchft():
    try:
        import torchft
    except ImportError as exc:  # pragma: no cover - the ft extra is in make setup
        raise ImportError("fault-tolerant replica groups need torchft: pip install 'zerodp[ft]' "
                          f"(torchft>=0.2) ({exc})") from None
    return torchft


def _forget_the_last_manager() -> None:
    """torchrun keeps its store across the restarts of a job, and in it the address of the torchft
    manager server that rank 0 of the previous attempt published (``Manager`` reads it from
    ``MASTER_ADDR:MASTER_PORT``): the other ranks of a restarted group would connect to that dead
    server and fail after torchft's connect timeout. Rank 0 deletes it before any rank of the group
    builds its manager (a barrier of the group's process group, when one is initialized)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or "MASTER_ADDR" not in os.environ:
        return
    from torch.distributed import TCPStore
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if dist.get_rank() == 0:
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         wait_for_workers=False)
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    dist.barrier()


class Turn(enum.Enum):
    """Where a :class:`ReplicaGroups` is in the step (module docstring): ``BETWEEN`` steps;
    ``FORMING``: the step started, its quorum still forming (the batch chosen from the last one);
    ``JOINED``: the quorum known; ``VOTING``: inside torchft's ``should_commit``. A step abandoned
    before its vote (an exception the loop caught) may be started again."""

    BETWEEN = "between"
    FORMING = "forming"
    JOINED = "joined"
    VOTING = "voting"


TURNS = transitions(Turn, """
    between -> forming joined
    forming -> joined forming
    joined  -> voting forming joined
    voting  -> between
""")


class _Done:
    """A finished collective's handle (the cross-group mean runs at once; the outer loop waits on it)."""

    def wait(self) -> bool:
        return True


class ReplicaGroups:
    """This rank's view of R replica groups that are jobs of their own (module docstring).

    ``group``: this group's index (0..R-1, fixed for the group across restarts); ``groups``: R;
    ``lighthouse``: the torchft lighthouse's address (default ``$TORCHFT_LIGHTHOUSE``). ``rank``,
    ``world_size``, ``store_addr``, ``store_port``: this rank in its group and the group's own
    TCPStore (default: torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
    ``timeout_s``: the cross-group collectives and the checkpoint transfer; ``quorum_timeout_s``:
    how long a quorum may take to form; ``min_replicas``: the fewest groups a step commits with.
    ``overlap_quorum``: the quorum forms behind the step's forward (module docstring); False: it is
    waited for in :meth:`start_step`. ``init_sync``: torchft's first-quorum sync, off: every group
    builds its model from the same seed (torchft would otherwise pick the source per shard index, and
    a group whose ranks do not all heal together cannot load its shards collectively); a group that
    is behind heals on every rank at once. ``start_groups``: the groups the first committed step needs (default
    ``min_replicas``): jobs started apart (one ``torchrun`` per group) take their first step
    together instead of the first one training alone; after it, ``min_replicas``.
    """

    leg = "inter"  # the engine's trace: across replica groups
    #: the cross-group reduction through ``Manager.allreduce`` (True) or straight on its process
    #: group (False, the default: the same sum, division and error handling, a few ms less per
    #: call on a loaded CPU — tools/ft_overhead.py measures both)
    via_manager = False
    rank = 0  # every group saves a complete checkpoint of its own (no replica skips its pieces)

    def __init__(self, group: int, groups: int, lighthouse: str | None = None, *, rank: int | None = None,
                 world_size: int | None = None, store_addr: str | None = None, store_port: int | None = None,
                 timeout_s: float = 30.0, quorum_timeout_s: float = 300.0, connect_timeout_s: float = 60.0,
                 min_replicas: int = 1, init_sync: bool = False, start_groups: int | None = None,
                 overlap_quorum: bool = True):
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
            raise ValueError(f"groups={groups!r}: replica groups that heal from a peer need at least 2")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
            raise ValueError(f"group={group!r}: this group's index, 0 to {groups - 1}")
        ft = _torchft()
        self.group, self.groups = group, groups
        if start_groups is not None and not min_replicas <= start_groups <= groups:
            raise ValueError(f"start_groups={start_groups!r}: from min_replicas ({min_replicas}) to groups ({groups})")
        self.min_replicas = min_replicas
        self._starting = start_groups is not None and start_groups > min_replicas
        if store_addr is None:
            _forget_the_last_manager()
        self.pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self.overlap = bool(overlap_quorum)  # torchft's asynchronous quorum (DiLoCo turns it off: bind)
        self.manager = ft.Manager(
            pg=self.pg, min_replica_size=start_groups or min_replicas, load_state_dict=None, state_dict=None,
            replica_id=f"zerodp_group{group}", store_addr=store_addr, store_port=store_port, rank=rank,
            world_size=world_size, lighthouse_addr=lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
            use_async_quorum=self.overlap, init_sync=init_sync, timeout=timedelta(seconds=timeout_s),
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=connect_timeout_s))
        self.manager.register_state_dict_fn(STATE_KEY, self._load, self._save)
        self.recorder = None
        self._engine = None
        self._extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.turn = Turn.BETWEEN
        # the last step's quorum: (participants, this group's rank); None before the first
        self._last: tuple[int, int | None] | None = None
        self._stale: str | None = None  # why this step's quorum is not the one its batch was chosen for
        self._start: dict[str, Any] = {}  # the step's start, for a healing peer and a step that does not commit
        self.heals = 0  # states received from a peer
        self.last_heal_s: float | None = None
        self.last_quorum_s: float | None = None
        self.commits = self.aborted = 0  # steps this group committed / did not
        self._outer = False  # DiLoCo over the groups (bind)
        self._last_quorum: int | None = None  # torchft's quorum id at the last synchronous join

    # ---- the engine's hook ------------------------------------------------------------------------
    def bind(self, recorder, *, comm, shard, outer=None) -> "ReplicaGroups":
        """Called by the engine at construction with its collaborators: the recorder its trace
        goes to, the group's comm and the shard comm (the same: ZeRO over the whole job)."""
        if outer is not None and (outer.compress is not None or outer.delay):
            raise ValueError(f"replicas=ReplicaGroups(...) with outer=DiLoCo(compress={outer.compress!r}, "
                             f"delay={outer.delay}): its syncs cross the groups through torchft's managed group in "
                             "fp32 and at once; pass compress=None and delay=0")
        self._outer = outer is not None
        if self._outer and self.overlap:
            # DiLoCo's inner steps cross nothing: each step waits for its quorum in start_step, and
            # a joining group heals before its forward (torchft's synchronous quorum; the manager
            # reads the switch at each quorum)
            if not hasattr(self.manager, "_use_async_quorum"):
                raise ValueError("replicas=ReplicaGroups(...) with outer=DiLoCo(...): this torchft cannot switch "
                                 "its quorum to synchronous; build ReplicaGroups(..., overlap_quorum=False)")
            self.overlap = False
            self.manager._use_async_quorum = False
        if shard is not comm:
            raise ValueError("replicas=ReplicaGroups(...): each replica group is a job of its own, so the engine "
                             "shards over this job's whole process group; drop shard_size (or set it to the "
                             "job's world size)")
        self.recorder = recorder
        return self

    @property
    def world_size(self) -> int:
        """R, the groups the job was laid out for (the live count varies: :attr:`participants`)."""
        return self.groups

    def all_reduce_mean(self, tensor: torch.Tensor, label: str, async_op: bool = False) -> "_Done | None":
        """Average ``tensor`` in place over the live replica groups (torchft's managed allreduce)."""
        if self.turn is Turn.BETWEEN or self.turn is Turn.VOTING:
            raise RuntimeError("ReplicaGroups: call replicas.start_step() at the start of every step, before "
                               "its forward (it joins the quorum and heals this group if it is behind)")
        nbytes = tensor.numel() * tensor.element_size()
        ev = mark = None
        if self.recorder is not None:
            ev = self.recorder.begin(ALL_REDUCE, COMM, kind=ALL_REDUCE, label=label, bytes=nbytes,
                                     sent_bytes=ring_sent_bytes(ALL_REDUCE, nbytes, max(self.participants, 1)),
                                     leg=self.leg)
            mark = self.recorder.mark()
        if self.turn is Turn.FORMING:
            self._join()
        if self.via_manager:
            self.manager.allreduce(tensor).wait()
        else:
            self._allreduce(tensor)
        if ev is not None:
            self.recorder.end_wait(ev, mark)
        return _Done() if async_op else None

    def _allreduce(self, tensor: torch.Tensor) -> None:
        """``Manager.allreduce`` without its future chain: the sum on torchft's reconfigured gloo group
        (its timeout is ``timeout_s``), divided by the live count; an error (a peer died) goes to
        the manager, which then votes against the commit, as ``Manager.allreduce`` does with it."""
        if self.manager.errored() is not None:
            return  # this step will not commit: the tensor is not read
        if not self.manager.is_participating():
            tensor.zero_()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            self.pg.allreduce([tensor], opts).wait()
        except Exception as exc:  # noqa: BLE001 - whatever the transport raised: no commit
            self.manager.report_error(exc)
            return
        tensor /= self.participants

    def should_commit(self) -> bool:
        """The quorum's word on this step (every rank of the group gets the same answer)."""
        if self.turn is Turn.BETWEEN:
            raise RuntimeError("ReplicaGroups: call replicas.start_step() at the start of every step, before "
                               "its forward (it joins the quorum and heals this group if it is behind)")
        if self.turn is Turn.FORMING:
            self._join()
        self._move(Turn.VOTING)
        try:
            if self._stale is not None:
                self.manager.report_error(RuntimeError(self._stale))
            ok = bool(self.manager.should_commit())
        finally:
            self._move(Turn.BETWEEN)
        if not ok and self.overlap:  # taken again as it began (module docstring)
            self._restore()
        if ok:
            self.commits += 1
            if self._starting:  # the first step committed with start_groups: from now on min_replicas
                self._starting = False
                self.manager._min_replica_size = self.min_replicas  # torchft reads it at each commit
        else:
            self.aborted += 1
        return ok

    # ---- the training loop's side -----------------------------------------------------------------
    def attach(self, engine, state: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] | None = None) -> None:
        """The engine whose state a healing peer fetches, and the loop's own state by name:
        ``{"data": (save, load)}`` (what save returns must be picklable or tensors)."""
        if engine.config.replicas is not self:
            raise ValueError("attach(engine): the engine was built with another replicas= object")
        self._engine = engine
        self._extra = dict(state or {})

    def start_step(self) -> None:
        """Join this step's quorum — behind the forward with ``overlap_quorum``, else at once; a
        group behind the quorum heals (module docstring)."""
        if self._engine is None:
            raise RuntimeError("ReplicaGroups: call replicas.attach(engine) before the first step")
        self._remember_start()
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self.last_quorum_s = time.perf_counter() - t0
        if self.overlap and self._last is not None and self._last[1] is not None:
            self._move(Turn.FORMING)  # the batch from the last quorum; _join checks it
            return
        self._join()
        quorum = getattr(self.manager, "_quorum_id", None)  # None: not exposed; meet at every step
        if self._outer and (quorum is None or quorum != self._last_quorum):
            # DiLoCo's inner steps cross nothing, so a live group would reach its vote — which
            # closes its checkpoint to readers — before a healing group has fetched it: the groups
            # of a new quorum meet first (one element, the healing one after its fetch)
            self._allreduce(torch.zeros(1))
        self._last_quorum = quorum

    def _join(self) -> None:
        """Wait for this step's quorum (at once when torchft waited in start_quorum) and compare it
        with the last step's: a different one makes the step not commit (module docstring)."""
        t0 = time.perf_counter()
        self.manager.wait_quorum()
        self.last_quorum_s = (self.last_quorum_s or 0.0) + time.perf_counter() - t0
        errored = self.manager.errored()
        if errored is not None:
            raise RuntimeError(f"the quorum or the heal failed: {errored}") from None
        # what the batch depends on: the participants and this group's rank among them (torchft's
        # quorum id also moves after any step that did not commit, the groups unchanged)
        now = (self.manager.num_participants(), self.manager.participating_rank())
        self._stale = None
        # a synchronous quorum: the batch is chosen after it. A healing group (no rank: torchft's
        # asynchronous heal) takes no part in this step's mean; whether the step commits is read
        # off its peer's last quorum when the peer's state arrives
        if self.overlap and now[1] is not None and (self._last is None or now != self._last):
            self._stale = (f"the quorum changed (participants, this group's rank: {self._last} -> {now}); the "
                           "step's batch was chosen for the last one: it is taken again")
        self._last = now
        self._move(Turn.JOINED)

    def _move(self, to: Turn) -> None:
        self.turn = moved(TURNS, self.turn, to, "ReplicaGroups")

    def _remember_start(self) -> None:
        """The step's start, as a healing peer receives it and a step that does not commit leaves
        it: the CPU RNG, the module's buffers, the loop's registered state (module docstring)."""
        # with the synchronous quorum torchft reads them inside start_step, before anything moved:
        # the live buffers, and the loop's state when it does (_save)
        copy = (lambda t: t.detach().clone()) if self.overlap else (lambda t: t.detach())
        self._start = {"last": self._last, "rng": torch.get_rng_state(),
                       "buffers": {name: copy(getattr(sub, local)).reshape(-1)
                                   for name, sub, local in self._engine.state_buffers},
                       "extra": {k: save() for k, (save, _) in self._extra.items()} if self.overlap else None}

    def _restore(self) -> None:
        torch.set_rng_state(self._start["rng"])
        with torch.no_grad():
            for name, sub, local in self._engine.state_buffers:
                getattr(sub, local).copy_(self._start["buffers"][name].view_as(getattr(sub, local)))

    @property
    def took_part(self) -> bool:
        """Whether this group's batch counted in the step (False in the step a group heals during,
        with torchft's asynchronous quorum: its gradient is left out). Read after the step."""
        return self._last is not None and self._last[1] is not None

    @property
    def step(self) -> int:
        """Committed steps (torchft's count, the same in every live group)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    @property
    def batches_committed(self) -> int:
        """Batches committed over all groups and steps (torchft's count: the data position)."""
        return self.manager.batches_committed()

    def batch_index(self) -> int:
        """The global index of the batch this group takes this step (module docstring)."""
        rank = self._last[1] if self.turn is Turn.FORMING else self.manager.participating_rank()
        return self.manager.batches_committed() + (rank or 0)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ---- healing ----------------------------------------------------------------------------------
    def _save(self) -> dict:
        """What a healing peer with this rank's shard index receives (torchft's quorum thread; the
        tensors are the live ones: nothing changes them before this group's vote, which waits for
        a transfer in progress and then closes the checkpoint to readers — except under DiLoCo,
        below). Under DiLoCo also the outer state
        (θ_outer, momentum, the outer step count) once taken: the healed group carries on from the
        peer's inner and outer state."""
        e = self._engine
        held = list(e.master.pieces())
        scalars = e.master.scalar_state()
        # Under DiLoCo the live groups' inner steps wait for no other group, so they would change
        # these tensors while the healing group still reads them: it is sent a copy taken now
        # (torchft calls this inside the quorum, before this group's next step)
        keep = (lambda t: t.detach().clone()) if e.outer is not None else (lambda t: t.detach())
        if e.outer is not None and e.outer.state is not OuterState.FRESH:
            held += e.outer.pieces()  # no exchange is in flight between steps (τ = 0)
            scalars["outer"] = e.outer.scalars()
        pieces = [(p.name, p.kind, p.start, p.stop, keep(p.tensor)) for p in held]
        # the RNG, buffers and loop state as the step began (torchft's quorum thread may call this
        # while the step computes: they may have moved since)
        start = self._start
        extra = start["extra"]
        if extra is None:  # the synchronous quorum: read now, at the step's start
            extra = {k: save() for k, (save, _) in self._extra.items()}
        return {"scalars": scalars, "pieces": pieces, "buffers": {k: keep(v) for k, v in start["buffers"].items()},
                "rng": start["rng"], "extra": extra, "last": start["last"]}

    def _load(self, state: dict) -> None:
        """Load a peer's state (the main thread; collective in the group): inside start_step, or —
        torchft's asynchronous heal — inside the vote, before this group's optimizer applies the
        step's mean, as the peer's does. That step commits here as it does in the peer's group:
        unless the participants changed since the peer's last step (module docstring)."""
        if self.turn is Turn.VOTING:
            peer, now = state.get("last"), self.manager.num_participants()
            if peer is None or peer[0] != now:
                self.manager.report_error(RuntimeError(
                    f"the quorum changed (the participants at the peer's last step {peer} -> {now}): the step is "
                    "taken again"))
        # a step that does not commit now leaves what was loaded (the peer's start of the step)
        self._start = {"last": self._last, "rng": state["rng"], "buffers": state["buffers"], "extra": state["extra"]}
        t0 = time.perf_counter()
        e = self._engine
        index: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
        for name, kind, start, stop, tensor in state["pieces"]:
            index.setdefault((name, kind), []).append((start, stop, tensor))
        buffers = state["buffers"]

        def read(name: str, kind: str, start: int, stop: int) -> torch.Tensor:
            if kind == BUFFER:
                return buffers[name]
            for a, b, t in index.get((name, kind), ()):
                if a <= start and stop <= b:
                    return t[start - a:stop - a]
            raise KeyError(f"the peer sent no {kind} of {name}[{start}:{stop}]: the groups' layouts differ "
                           "(same model, stage, optimizer and group size in every group?)")

        e.checkpoint.load_scalar_state(state["scalars"])
        e.checkpoint.load_state_pieces(read)
        torch.set_rng_state(state["rng"])
        for key, (_, load) in self._extra.items():
            load(state["extra"][key])
        self.heals += 1
        self.last_heal_s = time.perf_counter() - t0
