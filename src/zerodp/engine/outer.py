"""The outer loop of DiLoCo and Streaming DiLoCo over hybrid ZeRO (guide §16), its whole life in one object.

``parallelize(..., shard_size=g, outer=DiLoCo(every=H, ...))`` makes the R = N/g shard groups
(ranks ``[i·g, (i+1)·g)``) *replica groups that talk rarely*. The inner step is plain ZeRO at the
engine's stage inside the shard group — the engine builds no cross-replica reduction then
(``engine.replica_comm`` is None, so :meth:`~zerodp.engine.gradbuf.GradBuffers.reduce` never takes
its hybrid path) — and only :class:`OuterLoop` talks across the groups, on the replica group of
guide §14.2 (the R ranks with this rank's shard index; the comm recorder's ``"inter"`` leg):

* **what a rank syncs**: its *outer shard*, the slices it owns of the flat groups, in group order —
  the fp32 master shard at stages 1-3, slice ``shard index`` of the replicated flat buffers at
  stage 0 — Ψ/g elements, padding of each group to a multiple of g included (Ψ the padded flat
  numel, as the planner counts it);
* **fragments** (F): the outer shard cut into F equal contiguous ranges ``[⌊f·S/F⌋, ⌊(f+1)·S/F⌋)``
  (S = Ψ/g); in each group's flat buffer, fragment f is the same range of every rank's slice.
  Fragment f syncs after the inner steps k = 1, 2, ... with (k − ⌊f·H/F⌋) mod H = 0
  (:func:`zerodp.plan.diloco.fragments_due`, the planner's schedule);
* **a sync** of fragment f after inner step k: Δ = θ_outer − θ_local (fp32) over the fragment,
  averaged over the R replica peers — one fp32 AllReduce, 2(R−1)/R·4·Ψ_f/g bytes sent per rank, or
  the engine's int8 AllReduce (guide §14.4: the int8 all-to-all of
  :func:`~zerodp.engine.quant.reduce_scatter_int8`, then the int8 AllGather of the reduced chunks,
  :func:`~zerodp.engine.quant.all_gather_int8`, one fp32 scale per ``QUANT_BLOCK`` = 256 elements;
  the fragment is zero-padded to a multiple of R·256 so that every chunk is whole blocks,
  2(R−1)/R·(1 + 4/256)·Ψ_f/g bytes); then ``torch.optim.SGD(lr, momentum, nesterov)`` over θ_outer
  steps with Δ as its gradient, θ_local ← θ_outer over the fragment (the master, and the published
  parameters: at stage 0 an fp32 AllGather of the fragment inside the shard group,
  (g−1)/g·4·Ψ_f bytes); every replica computes the same θ_outer from the same averaged Δ;
* **delay** (τ): the exchange is launched at the sync step and its update applied after inner step
  k + τ; what the fragment learned locally in those τ steps is replaced by the delayed outer update
  (Streaming DiLoCo's merge with α = 1). The int8 AllReduce's second half is launched one inner step
  after its first (τ ≥ 2) or at the apply (τ = 1): every rank issues the same collectives in the same
  order, so the replica group never needs to agree on what completed when;
* **outer state**: θ_outer and the momentum buffer, fp32 (fp64 with an fp64 master), 8Ψ/g bytes
  per rank (4Ψ/g with momentum 0) — :meth:`state_tensors`, ``engine.stats().memory["outer_states"]``.

θ_outer is taken from the parameters as the first ``step()`` finds them (after a
``load_state_dict``, a pretrained model's values), or loaded from a checkpoint of the engine
(:meth:`pieces` / :meth:`load_pieces`: by parameter name and element range, like the master's, so
they load at another world size, stage or g; the replica groups' own inner states travel as kinds
``<kind>@replica<i>``, so a changed number of replica groups is refused in one line). Loading model
weights with ``engine.load_state_dict`` restarts the outer loop from them (:meth:`restart`).

The object's state is one :class:`OuterState` value, changed only through checked transitions
(:func:`~zerodp.engine.states.moved`, as the engine's step state). It receives its collaborators —
the shard and replica :class:`~zerodp.engine.comm.Collectives` (which record to the engine's
recorder), the flat groups, and the queue of parameter AllGathers — not the engine; the engine calls
:meth:`step` around its inner optimizer step (``StageEngine.step``).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Callable

import torch

from zerodp.engine.comm import Collectives, InFlight, Pending
from zerodp.engine.config import DiLoCo
from zerodp.engine.group import FROZEN, FlatGroup
from zerodp.engine.master import Piece
from zerodp.engine.states import moved, transitions
from zerodp.engine.trace import COMPUTE
from zerodp.plan.diloco import fragments_due
from zerodp.plan.hybrid import QUANT_BLOCK

#: checkpoint piece kinds of the outer state (by parameter name and element range, replica 0's)
OUTER, MOMENTUM, DELTA = "outer", "outer_momentum", "outer_delta"
#: the kind under which replica group i > 0 saves its own inner state (master values, optimizer states)
REPLICA_KIND = "{kind}@replica{replica}"


class OuterState(enum.Enum):
    """Where the outer loop is (module docstring). ``FRESH``: θ_outer not taken yet — it is the
    parameters as the next ``step()`` finds them (at construction, after ``load_state_dict``).
    ``LOCAL``: the groups train alone; no exchange in flight. ``EXCHANGING``: a fragment's
    pseudo-gradient exchange is in flight, to be applied after a later inner step (delay τ)."""

    FRESH = "fresh"
    LOCAL = "local"
    EXCHANGING = "exchanging"


OUTER_MOVES = transitions(OuterState, """
    fresh      -> fresh local
    local      -> local exchanging fresh
    exchanging -> exchanging local
""")


def outer_shard_size(outer: DiLoCo, world: int, resolved: int, stage: int, asked: int | None) -> int:
    """The shard-group size g of an engine with an outer loop: ``resolved`` (the engine's rule,
    stages 1-3), at stage 0 — which shards nothing — ``shard_size`` (or one node, torchrun's
    ``LOCAL_WORLD_SIZE``); refused in one line unless there are at least two replica groups."""
    g = resolved
    if stage == 0:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        g = asked if asked is not None else (int(local) if local.isdigit() and int(local) > 0 else world)
        if world % g:
            raise ValueError(f"shard_size={g} does not divide the {world} ranks: use a divisor of the world size")
    if world // g < 2:
        raise ValueError(f"outer=DiLoCo(every={outer.every}) needs hybrid sharding with at least two replica groups: "
                         f"shard_size={g} on {world} ranks makes {world // g}; pass shard_size=g with g at most "
                         f"{world // 2} (the groups of g ranks then sync every {outer.every} steps, guide §16)")
    return g


@dataclass(frozen=True)
class Segment:
    """Where part of a fragment lies: elements ``[at, at + n)`` of fragment ``fragment``'s θ_outer
    are elements ``[lo, lo + n)`` of flat group ``group``'s layout (this rank's slice)."""

    fragment: int
    at: int
    group: int
    lo: int
    n: int


@dataclass
class Exchange:
    """One fragment's pseudo-gradient on its way across the replicas: launched after inner step
    ``launched``, applied after inner step ``due``. ``delta`` (zero-padded) holds Δ, then — once
    ``done`` — its mean over the replicas; int8: ``chunk`` is this rank's reduced chunk between the
    two halves, ``first``/``second`` their collectives."""

    fragment: int
    launched: int
    due: int
    delta: torch.Tensor
    first: Pending | None = None
    second: Pending | None = None
    chunk: torch.Tensor | None = None
    done: bool = False


class OuterLoop:
    """DiLoCo's outer loop on one rank (module docstring)."""

    def __init__(self, settings: DiLoCo, *, stage: int, shard: Collectives, replicas: Collectives,
                 block: int = QUANT_BLOCK):
        self.settings = settings
        self.stage = stage
        self.shard = shard  # the shard group: stage 0's AllGather of a synced fragment
        self.replicas = replicas  # the replica group: the pseudo-gradient exchange ("inter" leg)
        self.block = block
        self.int8 = settings.compress == "int8"
        self.state = OuterState.FRESH
        self.step_count = 0  # inner steps taken; the next one is step_count + 1 (the planner counts from 1)
        self.pending: dict[int, Exchange] = {}
        self.loading: dict | None = None  # a checkpoint's outer scalars, until its pieces are loaded
        self.groups: list[FlatGroup] = []
        self.gathers: InFlight | None = None

    # ---- set up, once the flat groups exist ----------------------------------------------------
    @property
    def replica(self) -> int:
        """This rank's replica group (its index among the R groups)."""
        return self.replicas.rank

    @property
    def replica_count(self) -> int:
        return self.replicas.world_size

    def bind(self, groups: list[FlatGroup], gathers: InFlight, dtype: torch.dtype) -> None:
        """The flat groups this loop syncs and the queue its parameter AllGathers join; allocates
        θ_outer and the momentum buffers (their values are taken at the first step)."""
        self.groups, self.gathers = groups, gathers
        self.dtype = torch.float64 if dtype == torch.float64 else torch.float32
        ranges = [self._own_range(g) for g in groups]
        total = sum(hi - lo for lo, hi in ranges)
        F = self.settings.fragments
        if total < F:
            raise ValueError(f"outer=DiLoCo(fragments={F}) cuts each rank's {total} elements into more fragments "
                             "than elements: use fewer fragments")
        cuts = [f * total // F for f in range(F + 1)]
        self.sizes = [cuts[f + 1] - cuts[f] for f in range(F)]
        unit = self.replica_count * (self.block if self.int8 else 1)
        self.wire_sizes = [-(-s // unit) * unit for s in self.sizes]  # what each exchange carries (padded)
        self.segments: list[list[Segment]] = [[] for _ in range(F)]
        at = 0
        for i, (lo, hi) in enumerate(ranges):  # the rank's outer shard, group after group
            pos = lo
            while pos < hi:
                f = bisect.bisect_right(cuts, at) - 1  # cuts[f] <= at < cuts[f + 1] (every fragment holds one at least)
                n = min(hi - pos, cuts[f + 1] - at)
                self.segments[f].append(Segment(f, at - cuts[f], i, pos, n))
                pos, at = pos + n, at + n
        device = groups[0].master.device
        self.params = [torch.zeros(s, dtype=self.dtype, device=device) for s in self.sizes]
        opts = dict(lr=self.settings.lr, momentum=self.settings.momentum)
        if self.settings.momentum > 0:
            opts["nesterov"] = self.settings.nesterov
        self.optimizer = torch.optim.SGD(self.params, **opts)
        if self.settings.momentum > 0:  # created now (zeros: SGD's first update is then its own, bitwise)
            for p in self.params:
                self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def _own_range(self, g: FlatGroup) -> tuple[int, int]:
        """The flat range of group ``g`` this rank syncs: its master shard (stages 1-3), or slice
        ``shard index`` of the replicated buffer (stage 0)."""
        if self.stage == 0:
            return g.layout.shard_range(self.shard.rank)
        return g.master_start, g.master_start + g.master.numel()

    def _master(self, seg: Segment, shift: int = 0) -> torch.Tensor:
        """The master's elements of a segment (``shift`` shard slices over, for stage 0's gather)."""
        g = self.groups[seg.group]
        lo = seg.lo + shift * g.layout.shard_numel - g.master_start
        return g.master[lo:lo + seg.n]

    def _move(self, to: OuterState) -> None:
        self.state = moved(OUTER_MOVES, self.state, to, "outer loop")

    # ---- the schedule ----------------------------------------------------------------------------
    @torch.no_grad()
    def start(self) -> None:
        """θ_outer ← the parameters as they are now (master values), where not yet taken."""
        if self.state is not OuterState.FRESH:
            return
        for f, segs in enumerate(self.segments):
            for seg in segs:
                self.params[f][seg.at:seg.at + seg.n].copy_(self._master(seg))
        self._move(OuterState.LOCAL)

    def restart(self) -> None:
        """Model weights were loaded (``engine.load_state_dict``): exchanges in flight are finished
        and dropped, the momentum cleared, and θ_outer is taken again at the next step."""
        for x in self.pending.values():
            self._finish(x)
        self.pending.clear()
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                buf.zero_()
        if self.state is OuterState.EXCHANGING:
            self._move(OuterState.LOCAL)
        self._move(OuterState.FRESH)

    def step(self, inner: Callable[[], None], commit: Callable[[], bool] | None = None) -> None:
        """One inner step k (``inner``: the engine's master step and publish), then what the
        schedule asks after it: the syncs launched at k (fragments due), the int8 second halves due,
        the outer updates applied at k (launched at k − τ). The groups an update rewrites publish
        after it, not before (one parameter AllGather at stages 1-2, as without the outer loop).

        ``commit``: replica groups that are jobs of their own (``zerodp.ft``, fp32, τ = 0) vote
        once a step, after the exchanges and before the updates: a step the quorum does not commit
        (its exchange failed: a peer died in it) applies no outer update — θ_outer stays, the
        groups keep their local progress, and the next sync carries it."""
        self.start()
        k = self.step_count + 1
        every, F, delay = self.settings.every, self.settings.fragments, self.settings.delay
        launch = fragments_due(k, every, F)
        apply = sorted([f for f, x in self.pending.items() if x.due == k] + (launch if delay == 0 else []))
        held = sorted({seg.group for f in apply for seg in self.segments[f]})
        for i in held:
            self.groups[i].held = True
        try:
            inner()
        finally:
            for i in held:
                self.groups[i].held = False
        self.step_count = k
        if not (launch or apply or self.pending):
            if commit is not None:
                commit()
            return
        with self.replicas.recorder.span("outer", COMPUTE):  # the trace's "outer" span: all of it, waits included
            for f in launch:
                self._launch(f, k)
            for f in sorted(self.pending):
                x = self.pending[f]
                if self.int8 and x.second is None and x.launched < k < x.due:
                    self._second_half(x)
            if commit is not None and not commit():
                for f in apply:
                    self._finish(self.pending.pop(f))  # dropped: no outer update this round
                apply = []
            for f in apply:
                self._apply(f)
            for i in reversed(held):  # in the order the next forward needs them, as the engine publishes
                pending = self.groups[i].publish()
                if pending is not None:
                    self.gathers.add(pending)
        if self.state is OuterState.EXCHANGING and not self.pending:
            self._move(OuterState.LOCAL)

    # ---- one fragment's sync ---------------------------------------------------------------------
    @torch.no_grad()
    def _launch(self, f: int, k: int) -> None:
        """Δ = θ_outer − θ_local over fragment ``f`` (zero-padded), its average launched."""
        delta = torch.zeros(self.wire_sizes[f], dtype=self.dtype, device=self.params[f].device)
        theta = self.params[f]
        for seg in self.segments[f]:
            torch.sub(theta[seg.at:seg.at + seg.n], self._master(seg).to(self.dtype), out=delta[seg.at:seg.at + seg.n])
        x = Exchange(f, k, k + self.settings.delay, delta)
        label = f"outer fragment {f}"
        if self.int8:
            x.chunk = torch.empty(delta.numel() // self.replica_count, dtype=self.dtype, device=delta.device)
            x.first = self.replicas.reduce_scatter_grad(x.chunk, delta, label, overwrite=True, quant_block=self.block)
        else:
            x.first = self.replicas.all_reduce_mean(delta, label, async_op=True)
        self.pending[f] = x
        self._move(OuterState.EXCHANGING)

    def _second_half(self, x: Exchange) -> None:
        """int8: the reduced chunk back to every replica, an int8 AllGather (guide §14.4)."""
        x.first.wait()
        x.second = self.replicas.all_gather(x.delta, x.chunk, f"outer fragment {x.fragment}", async_op=True,
                                            quant_block=self.block)

    def _finish(self, x: Exchange) -> None:
        """Wait for a fragment's exchange: ``x.delta`` then holds the mean over the replicas."""
        if x.done:
            return
        if self.int8 and x.second is None:
            self._second_half(x)
        (x.second or x.first).wait()
        x.first = x.second = x.chunk = None
        x.done = True

    @torch.no_grad()
    def _apply(self, f: int) -> None:
        """The outer SGD step over fragment ``f`` with the averaged Δ as its gradient, then
        θ_local ← θ_outer there (stage 0: AllGathered inside the shard group)."""
        x = self.pending.pop(f)
        self._finish(x)
        theta = self.params[f]
        theta.grad = x.delta[:theta.numel()]
        self.optimizer.step()  # only this fragment has a gradient: SGD skips the others
        theta.grad = None
        for seg in self.segments[f]:
            self._master(seg).copy_(theta[seg.at:seg.at + seg.n])
        g = self.shard.world_size
        if self.stage == 0 and g > 1:
            everyone = torch.empty(g * theta.numel(), dtype=theta.dtype, device=theta.device)
            self.shard.all_gather(everyone, theta, f"outer fragment {f} gather", async_op=False)
            me = self.shard.rank
            for r in range(g):
                if r == me:
                    continue
                mine = everyone[r * theta.numel():(r + 1) * theta.numel()]
                for seg in self.segments[f]:
                    self._master(seg, r - me).copy_(mine[seg.at:seg.at + seg.n])

    # ---- state: memory, checkpoints --------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """θ_outer and the momentum buffers: the outer state this rank holds (8Ψ/g bytes in fp32)."""
        out = list(self.params)
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out.append(buf)
        return out

    def fragment_numels(self) -> list[int]:
        """Ψ_f per fragment as the planner takes it (``fragment_sizes`` of
        :func:`zerodp.plan.diloco.diloco_bytes`): g × the elements each rank sends, padding to whole
        int8 chunks included."""
        return [self.shard.world_size * s for s in self.wire_sizes]

    def describe(self) -> dict:
        """The outer loop for ``engine.stats()``: its settings, where it is, and its state's bytes."""
        momentum = self.settings.momentum > 0
        numel = self.shard.world_size * sum(self.sizes) if self.groups else 0
        return {"settings": dataclasses.asdict(self.settings), "state": self.state.value, "step": self.step_count,
                "replicas": self.replica_count, "replica": self.replica, "shard_size": self.shard.world_size,
                "numel": numel, "fragment_sizes": list(getattr(self, "sizes", [])),
                "fragment_numels": self.fragment_numels() if self.groups else [],
                "pending": sorted(self.pending),
                "state_bytes": sum(t.numel() * t.element_size() for t in self.state_tensors()) if self.groups else 0,
                "expected_state_bytes": (2 if momentum else 1) * 4 * numel // self.shard.world_size}

    def scalars(self) -> dict:
        """What a checkpoint's manifest keeps of the outer loop (beside :meth:`pieces`)."""
        return {"step": self.step_count, "replicas": self.replica_count, "shard_size": self.shard.world_size,
                "stage": self.stage, "settings": dataclasses.asdict(self.settings),
                "momentum": self.settings.momentum > 0,
                "pending": [[x.fragment, x.launched, x.due] for _, x in sorted(self.pending.items())]}

    def replica_pieces(self, pieces: list[Piece]) -> list[Piece]:
        """This replica group's own inner state: as it is on replica 0, under ``<kind>@replica<i>`` elsewhere."""
        if self.replica == 0:
            return pieces
        return [dataclasses.replace(p, kind=REPLICA_KIND.format(kind=p.kind, replica=self.replica)) for p in pieces]

    def replica_read(self, read: Callable[[str, str, int, int], torch.Tensor]):
        """``read`` for this replica group's inner state: its own kinds when the checkpoint being
        loaded holds one per replica group, else the plain ones (every group starts alike)."""
        if self.loading is None or self.replica == 0:
            return read
        return lambda name, kind, start, stop: read(name, REPLICA_KIND.format(kind=kind, replica=self.replica),
                                                    start, stop)

    def _spans(self):
        """(fragment, offset in it, parameter span) of every trainable parameter run in this rank's
        outer shard, fragment by fragment (frozen parameters never move: θ_outer keeps them)."""
        for f, segs in enumerate(self.segments):
            for seg in segs:
                g = self.groups[seg.group]
                frozen = {g.layout.slots[i].name for i, grp in enumerate(g.groups) if grp == FROZEN}
                for span in g.layout.spans(seg.lo, seg.lo + seg.n):
                    if span.slot.name not in frozen:
                        yield f, seg.at + span.flat_start - seg.lo, span

    def fragment_spans(self) -> list[tuple[str, int, int, int]]:
        """Which fragment each trainable parameter element of this rank's outer shard is in:
        ``(name, start, stop, fragment)`` over the flattened parameter."""
        return [(span.slot.name, span.param_start, span.param_stop, f) for f, _, span in self._spans()]

    def _kinds(self) -> list[tuple[str, list[torch.Tensor]]]:
        kinds = [(OUTER, self.params)]
        if self.settings.momentum > 0:
            kinds.append((MOMENTUM, [self.optimizer.state[p]["momentum_buffer"] for p in self.params]))
        return kinds

    def pieces(self) -> list[Piece]:
        """The outer state as checkpoint pieces (replica 0's; every replica holds the same): θ_outer,
        the momentum, and — for exchanges still in flight, which are finished here — the averaged Δ
        (zeros outside those fragments). Collective over the replica group when an exchange is in
        flight (every rank saves at the same step)."""
        self.start()
        for x in self.pending.values():
            self._finish(x)
        if self.replica != 0:
            return []
        kinds = self._kinds()
        if self.pending:
            deltas = [self.pending[f].delta[:p.numel()] if f in self.pending else torch.zeros_like(p)
                      for f, p in enumerate(self.params)]
            kinds.append((DELTA, deltas))
        out = []
        for f, at, span in self._spans():
            for kind, tensors in kinds:
                out.append(Piece(span.slot.name, kind, span.param_start, span.param_stop, span.slot.shape,
                                 tensors[f][at:at + span.numel]))
        return out

    def load_scalars(self, saved: dict) -> None:
        """A checkpoint's outer scalars, checked before anything is loaded: the same number of
        replica groups (each group's inner state is its own), and the same fragments, H, τ and layout
        where an exchange was in flight."""
        if int(saved.get("replicas", 0)) != self.replica_count:
            raise ValueError(f"the checkpoint holds the inner state of {saved.get('replicas')} replica groups and "
                             f"this engine has {self.replica_count}: resume an outer loop (DiLoCo) with as many "
                             "replica groups (world size / shard_size) as it was saved with")
        if saved.get("pending"):
            before = saved.get("settings", {})
            same = all(before.get(k) == getattr(self.settings, k) for k in ("every", "fragments", "delay")) \
                and saved.get("shard_size") == self.shard.world_size and saved.get("stage") == self.stage
            if not same:
                raise ValueError("the checkpoint was saved while an outer exchange was in flight (delay τ): resume "
                                 "with the same every, fragments, delay, stage and shard_size, or from a checkpoint "
                                 "saved where no exchange is in flight")
        self.loading = dict(saved)

    @torch.no_grad()
    def load_pieces(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """θ_outer, momentum, exchanges in flight and the step count from a checkpoint whose outer
        scalars :meth:`load_scalars` took (every replica reads replica 0's). A checkpoint with no
        outer scalars (saved without the outer loop) restarts it from the loaded weights
        (:meth:`restart`), as ``engine.load_state_dict`` does."""
        saved, self.loading = self.loading, None
        if saved is None:  # a checkpoint without an outer loop (a plain run's: a data-parallel warm-up)
            self.restart()  # θ_outer from the weights just loaded, not from any taken before the load
            return
        self.pending.clear()
        if self.state is not OuterState.FRESH:
            if self.state is OuterState.EXCHANGING:
                self._move(OuterState.LOCAL)
            self._move(OuterState.FRESH)
        self.start()  # every element from the loaded master first: frozen ones, and any not in the pieces
        kinds = self._kinds()
        if not saved.get("momentum"):
            kinds = kinds[:1]
            for p in self.params:
                buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buf.zero_()
        pending = {int(f): (int(a), int(b)) for f, a, b in saved.get("pending", [])}
        deltas = {f: torch.zeros(self.wire_sizes[f], dtype=self.dtype, device=self.params[f].device) for f in pending}
        for f, at, span in self._spans():
            for kind, tensors in kinds:
                tensors[f][at:at + span.numel].copy_(read(span.slot.name, kind, span.param_start, span.param_stop))
            if f in deltas:
                deltas[f][at:at + span.numel].copy_(read(span.slot.name, DELTA, span.param_start, span.param_stop))
        for f, (launched, due) in pending.items():
            self.pending[f] = Exchange(f, launched, due, deltas[f], done=True)
        if self.pending:
            self._move(OuterState.EXCHANGING)
        self.step_count = int(saved.get("step", 0))


__all__ = ["OuterLoop", "OuterState", "OUTER_MOVES", "Segment", "Exchange", "outer_shard_size", "OUTER",
           "MOMENTUM", "DELTA", "REPLICA_KIND"]
