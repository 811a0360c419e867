"""Stage 3's owner exchange: whole tensors brought to one rank for a per-tensor optimizer's step.

Guide §12.3. At stage 3 the units keep flat, even shards — the AllGathers and ReduceScatters
move no padding — but Muon's Newton–Schulz and Adafactor's factored moments read a tensor whole.
So each tensor of a per-tensor optimizer has an *owner* (:func:`zerodp.plan.units.step_owners`,
balanced by optimizer state), and :class:`OwnerExchange` runs its step there:

1. :meth:`OwnerExchange.bring` — one all-to-all: every rank sends the pieces of each such
   tensor that lie in its shards (fp32 master values, then the averaged gradient) to the
   tensor's owner, which assembles them into a whole tensor (the *proxy*, with its shape) and
   its ``.grad``;
2. the stock optimizer steps the proxies (its state lives on them, whole, on the owner only);
3. :meth:`OwnerExchange.send_back` — one all-to-all of the updated values back into the shards.

Each rank sends its own pieces twice and receives them once more: 3·Ψ_m/N elements per step
for Ψ_m elements of per-tensor tensors, beside the units' 3Ψ. It runs a batch of consecutive
units at a time (:meth:`OwnerExchange.batches`, up to a bounded number of elements), so that the
transient buffers hold a batch's tensors, not the model's, and the ranks — whose owned work
differs from unit to unit, balanced over the model — wait for each other once per batch. The
proxies' storage lives only during their batch's step (at rest each is an empty
storage with its shape, so torch's optimizer state stays keyed by it); the shards stay the
master's truth, so checkpoints read values from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodp.plan.units import exchange_batches, step_owners

#: the label of both all-to-alls in the trace and the collective counts
EXCHANGE = "owner_exchange"


@dataclass(frozen=True)
class Share:
    """A rank's share of a tensor the exchange brings whole: elements ``[start, stop)`` of tensor
    ``entry`` (an index into :attr:`OwnerExchange.entries`), held by rank ``holder`` at ``local``
    in its master shard of unit ``group`` (a checkpoint's :class:`~zerodp.engine.master.Piece` is
    another thing: state by parameter name)."""

    entry: int
    start: int
    stop: int
    holder: int
    group: int
    local: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Entry:
    """One tensor of a per-tensor optimizer: its name, shape, param group and owner rank."""

    name: str
    shape: tuple[int, ...]
    group: int
    owner: int


class OwnerExchange:
    """The owner exchange of one engine (module docstring): which rank steps which whole tensor,
    the proxies this rank steps, and the two all-to-alls of a step.

    ``groups``: the engine's flat groups (stage 3's units), each with ``layout``, ``master`` (this
    rank's fp32 shard, starting at element ``master_start`` of the layout) and ``grads``;
    ``exchanged(name)``: the param group of a tensor to bring whole, or None; ``costs(name,
    shape)``: the optimizer state elements of a tensor (or piece) of that shape, 0 for a frozen
    one — the owners balance it; ``comm``: the shard group's
    collectives; ``dtype``, ``device``: the master's."""

    def __init__(self, groups, exchanged, costs, comm, dtype: torch.dtype, device: torch.device):
        self.groups = list(groups)
        self.comm = comm
        self.n, self.rank = comm.world_size, comm.rank
        self.dtype, self.device = dtype, device
        found = [(slot, g) for unit in self.groups for slot in unit.layout.slots
                 if (g := exchanged(slot.name)) is not None]
        state_costs = [costs(slot.name, slot.shape) for slot, _ in found]
        owners = step_owners(state_costs, self.n)
        self.entries = [Entry(slot.name, slot.shape, g, r) for (slot, g), r in zip(found, owners)]
        index = {e.name: i for i, e in enumerate(self.entries)}
        # every share of every entry, in one order all ranks agree on (by unit, by slot, by holder);
        # and the optimizer state elements per rank after a step: the owners' whole tensors, and the
        # pieces of the other trainable tensors where the flat slices cut them (a step scalar each)
        self.shares: list[Share] = []
        self.state_numel = [0] * self.n
        for e, c in zip(self.entries, state_costs):
            self.state_numel[e.owner] += c
        for k, unit in enumerate(self.groups):
            s = unit.layout.shard_numel
            for slot in unit.layout.slots:
                for q in unit.layout.owners_of(slot):  # (none for an empty slot)
                    a, b = max(slot.offset, q * s), min(slot.stop, (q + 1) * s)
                    if slot.name in index:
                        self.shares.append(Share(index[slot.name], a - slot.offset, b - slot.offset, q, k, a - q * s))
                    else:
                        self.state_numel[q] += costs(slot.name, (b - a,))
        #: the whole tensors this rank steps, by entry index: empty storages at rest
        self.proxies: dict[int, torch.Tensor] = {}
        for i, e in enumerate(self.entries):
            if e.owner == self.rank:
                t = torch.empty(e.shape or (1,), dtype=dtype, device=device)
                t.untyped_storage().resize_(0)
                self.proxies[i] = t
        self._stepped: set[int] = set()

    # ---- what the optimizer and checkpoints see --------------------------------------------
    def proxy_items(self) -> list[tuple[Entry, torch.Tensor]]:
        """(entry, proxy) of each tensor this rank steps, in entry order."""
        return [(self.entries[i], t) for i, t in self.proxies.items()]

    def batches(self) -> list[set[int]]:
        """The units holding tensors to exchange, in order, grouped up to
        :data:`~zerodp.plan.units.EXCHANGE_BATCH_NUMEL` elements: one bring, step and send_back
        per batch (:func:`~zerodp.plan.units.exchange_batches`, the planner's rule)."""
        units = sorted({p.group for p in self.shares})
        sizes = [sum(p.numel for p in self.shares if p.group == k) for k in units]
        return [{units[i] for i in batch} for batch in exchange_batches(sizes)]

    def sent_elements(self) -> int:
        """Elements this rank sends per step when every tensor is stepped: its pieces twice
        (values and gradients to the owners), and what it owns once (values back)."""
        mine = sum(p.numel for p in self.shares if p.holder == self.rank)
        owned = sum(p.numel for p in self.shares if self.entries[p.entry].owner == self.rank)
        return 2 * mine + owned

    def cost(self) -> dict:
        """What the exchange costs (``engine.stats().layout``): the elements it steps whole
        (Ψ_m), what this rank sends per step and how far that is from the even share 3Ψ_m/N, and
        how far the fullest rank's optimizer state (fp32: the owners' whole tensors and the other
        tensors' pieces in each slice) is above the mean."""
        numel = sum(p.numel for p in self.shares)
        owned = self.state_numel
        sent = self.sent_elements()
        return {"exchange_numel": numel, "exchange_sent_elements": sent,
                "exchange_imbalance_bytes": round(4 * abs(sent - 3 * numel / self.n), 3),
                "state_imbalance_bytes": round(4 * (max(owned) - sum(owned) / self.n), 3)}

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def bring(self, skip: set[str], units: set[int] | None = None) -> None:
        """All-to-all 1: each stepped tensor's master values and averaged gradient, whole, on its
        owner (``proxy`` and ``proxy.grad``). ``skip``: tensors no rank computed a gradient for
        this step (or whose gradients were dropped): left unstepped, as torch skips a ``.grad``
        of None — the same set on every rank. ``units``: those units' tensors only (default all)."""
        within = [p for p in self.shares if units is None or p.group in units]
        grads = {k: self.groups[k].grads.read() for k in {p.group for p in within}}
        stepped = {p.entry for p in within if self.entries[p.entry].name not in skip}
        stepped -= {p.entry for p in within if grads[p.group] is None}
        self._stepped = stepped
        pieces = [p for p in self.shares if p.entry in stepped]
        send, sizes = [], [0] * self.n
        for dest in range(self.n):  # to each owner: the values of its pieces here, then the gradients
            mine = [p for p in pieces if p.holder == self.rank and self.entries[p.entry].owner == dest]
            send += [self.groups[p.group].master[p.local:p.local + p.numel] for p in mine]
            send += [grads[p.group][p.local:p.local + p.numel].to(self.dtype) for p in mine]
            sizes[dest] = 2 * sum(p.numel for p in mine)
        coming = [[p for p in pieces if p.holder == src and self.entries[p.entry].owner == self.rank]
                  for src in range(self.n)]
        received = self._all_to_all(send, sizes, [2 * sum(p.numel for p in c) for c in coming])
        for i in stepped & set(self.proxies):
            t = self.proxies[i]
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.grad = torch.empty_like(t)
        at = 0
        for c in coming:
            half = sum(p.numel for p in c)
            for part, field in ((received[at:at + half], "value"), (received[at + half:at + 2 * half], "grad")):
                k = 0
                for p in c:
                    t = self.proxies[p.entry]
                    (t if field == "value" else t.grad).view(-1)[p.start:p.stop].copy_(part[k:k + p.numel])
                    k += p.numel
            at += 2 * half

    @torch.no_grad()
    def send_back(self) -> None:
        """All-to-all 2: the stepped tensors' new values from their owners into every holder's
        master shard; the proxies' storage and gradients are freed."""
        pieces = [p for p in self.shares if p.entry in self._stepped]
        send, sizes = [], [0] * self.n
        for dest in range(self.n):
            mine = [p for p in pieces if p.holder == dest and self.entries[p.entry].owner == self.rank]
            send += [self.proxies[p.entry].view(-1)[p.start:p.stop] for p in mine]
            sizes[dest] = sum(p.numel for p in mine)
        coming = [[p for p in pieces if p.holder == self.rank and self.entries[p.entry].owner == src]
                  for src in range(self.n)]
        received = self._all_to_all(send, sizes, [sum(p.numel for p in c) for c in coming])
        at = 0
        for c in coming:
            for p in c:
                self.groups[p.group].master[p.local:p.local + p.numel].copy_(received[at:at + p.numel])
                at += p.numel
        self.release()

    def release(self) -> None:
        """The proxies back to empty storages with their shapes (their optimizer state stays)."""
        for t in self.proxies.values():
            t.grad = None
            t.untyped_storage().resize_(0)
        self._stepped = set()

    def _all_to_all(self, send: list[torch.Tensor], send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        flat = torch.cat(send) if send else torch.empty(0, dtype=self.dtype, device=self.device)
        if self.n == 1:
            return flat
        out = torch.empty(sum(recv_sizes), dtype=self.dtype, device=self.device)
        self.comm.all_to_all(out, flat, recv_sizes, send_sizes, EXCHANGE)
        return out
