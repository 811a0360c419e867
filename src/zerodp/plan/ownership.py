"""Tensor ownership priced (guide §12.3): what each rank holds when the optimizer reads whole tensors.

An elementwise optimizer (Adam, AdamW, SGD) steps any slice of a flat buffer, so ZeRO gives each
of the N ranks of a shard group Ψ/N elements and k·Ψ/N bytes of optimizer state. Muon
(Newton–Schulz on each 2-D update) and Adafactor (row and column second moments) read whole
tensors, so the engine's ownership path gives each tensor whole to one rank, its *owner*. What a
rank then holds is set by its owned set, not by Ψ/N:

* **groups**: the engine lays out one group at a time — stages 1–2 a gradient *bucket*
  (parameters in reverse registration order, one open bucket per param group, closed at
  ``min(first_bucket_mb, bucket_mb)`` MiB the first time, then ``bucket_mb``, in bytes of the
  working dtype; a bucket of a per-tensor optimizer's tensors also at N times its largest tensor
  and once they pack into N slices with at most 10% padding:
  :func:`zerodp.plan.units.plan_buckets`), stage 3 a *unit* (the root unit first — embeddings,
  head, final norm — then one per block; inside a unit by param group);
* **flat groups**: at stages 1–2 the buckets of an elementwise optimizer beside a per-tensor one
  (under ``muon``, AdamW's) are flat, as on the elementwise path: rank r holds elements
  [r·s, (r+1)·s) of the bucket (s = ⌈numel/N⌉), and the optimizer one piece of each tensor its
  slice cuts, with that piece's state and its own step scalar;
* **owners** of every other group (:meth:`zerodp.plan.units.OwnerLedger.assign`): in each
  group tensors by size, largest first (ties: the earlier), each to the rank with the fewest
  elements of this group so far (ties: the fewest owned in earlier groups, then the lower rank)
  — LPT; then, with more tensors than ranks, the same order again, each to the rank with the
  least optimizer state so far among those it fits in without the slice passing max(LPT's, 1.01
  × the even share), unless one fits nowhere;
* **padding**: every rank's slice of a group is padded to the largest owned set of that group,
  so master weights and gradient shards (stage 2) are Σ_groups max_r owned_r(group) elements
  per rank, and the collectives move N times that;
* **stage 3** keeps its units flat (rank r holds elements [r·s, (r+1)·s) of each, no padding
  beyond the even cut) and brings each tensor of a per-tensor optimizer whole to one owner for
  the step — the owner exchange (:func:`zerodp.plan.units.step_owners`: over the whole model,
  largest state first, each to the rank with the least state so far), two all-to-alls by batch
  of units (:func:`zerodp.plan.units.exchange_batches`): each rank sends its pieces of those
  tensors twice (values and gradients) and the tensors it owns once (the new values);
* **optimizer state** is per tensor, on its owner only (fp32, after the first step):
  Adam/AdamW 2·numel + a step scalar; SGD with momentum numel; Muon numel (momentum);
  Adafactor for a tensor of shape (…, m, n) row variance ∏shape[:-1] + column variance
  ∏shape[:-2]·n + a step, and numel + a step for a vector.

``muon`` prices Muon the way it is used: Muon on the blocks' 2-D weights, AdamW (param group 1)
on everything else — embeddings, head, norms, biases. Stage 0 shards nothing: every rank holds
everything. Only the model's shape is needed (:func:`model_tensors` rebuilds its tensors from a
``config.json``); torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.plan._common import InputError, ToDict, check_count
from zerodp.plan.units import STAGE_NAMES, STAGES, OwnerLedger, exchange_batches, plan_buckets, step_owners

FP32 = 4
#: the optimizers priced here: elementwise ones shard flat, per-tensor ones by ownership
ELEMENTWISE = ("adamw", "adam", "sgd")
PER_TENSOR = ("adafactor", "muon")
OPTIMIZERS = ELEMENTWISE + PER_TENSOR
#: the engine's defaults (zerodp.engine.config: DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB)
BUCKET_MB = 25.0
FIRST_BUCKET_MB = 1.0
#: per-rank lists (``owned_numel``, ``state_bytes``) are given for shard groups up to this size
MAX_LISTED = 1024


@dataclass(frozen=True)
class Tensor:
    """One parameter: its name, shape, the block it lives in (None: the root unit) and its
    param group (0, or 1 for AdamW's share under ``muon``)."""

    name: str
    shape: tuple[int, ...]
    block: int | None = None
    group: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def state_numel(optimizer: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(state elements, step scalars) one tensor of ``shape`` holds after its first step (module
    docstring); ``muon`` here is Muon itself (2-D only)."""
    n = math.prod(shape)
    check_optimizer(optimizer)
    if optimizer in ("adamw", "adam"):
        return 2 * n, 1
    if optimizer == "sgd":
        return n, 0
    if optimizer == "muon":
        if len(shape) != 2:
            raise ValueError(f"Muon steps 2-D matrices only; got a tensor of shape {tuple(shape)}")
        return n, 0
    if len(shape) < 2:  # adafactor
        return n, 1
    return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1], 1


def check_optimizer(optimizer: str) -> str:
    """``optimizer`` if it is one this module prices, else one line naming the choices."""
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}",
                         "optimizer", f"优化器必须是 {'、'.join(OPTIMIZERS)} 之一，收到的是 {optimizer!r}")
    return optimizer


def tensor_optimizer(optimizer: str, t: Tensor) -> str:
    """Which stock optimizer steps ``t``: under ``muon``, Muon for a block's 2-D weight and
    AdamW for the rest; otherwise ``optimizer`` itself."""
    if optimizer != "muon":
        return optimizer
    return "muon" if t.block is not None and len(t.shape) == 2 else "adamw"


def state_cost(optimizer: str, t: Tensor) -> int:
    """Elements + step scalars of ``t``'s optimizer state: what owners balance (the engine
    counts the same from each param group's optimizer class)."""
    return sum(state_numel(tensor_optimizer(optimizer, t), t.shape))


def state_bytes(optimizer: str, t: Tensor) -> int:
    """fp32 bytes of ``t``'s optimizer state after the first step (elements + step scalars)."""
    elements, scalars = state_numel(tensor_optimizer(optimizer, t), t.shape)
    return FP32 * (elements + scalars)


# ------------------------------------------------------------------------------------------
# The model's tensors, rebuilt from its shape

def model_tensors(model, optimizer: str = "adamw") -> list[Tensor]:
    """Every parameter of ``model`` (a :class:`~zerodp.plan.Model` read from a config.json) in
    registration order, with its block: GPT-2 style (the GPT ``zerodp train`` builds: learned
    positions, fused q/k/v, LayerNorm with bias, a 2-matrix GELU MLP, biases) or Llama style
    (separate q/k/v/o, a gated MLP — or a router and ``experts`` routed experts held, as
    transformers holds them, in two 3-D tensors per layer — RMSNorm).
    ``optimizer="muon"`` puts the tensors AdamW steps in param group 1."""
    cfg = getattr(model, "config", None) or {}
    m = model
    if not (m.layers and m.hidden and m.heads and m.vocab):
        raise InputError(f"{m.name} has no shape: tensor ownership is priced tensor by tensor; give "
                         "a config.json (--config) or a preset with a shape",
                         "model", f"{m.name} 没有结构信息：张量分配要按每个张量计算，请给出 config.json "
                         "或带结构的预设模型")
    if cfg.get("kv_lora_rank"):
        raise InputError(f"{m.name} uses multi-head latent attention, whose tensors this planner "
                         "does not rebuild: price it with an elementwise optimizer (adamw)",
                         "optimizer", f"{m.name} 用的是多头隐式注意力，规划器无法给出其张量：请用按元素的"
                         "优化器（adamw）计算")
    h, ffn, vocab = m.hidden, m.ffn or 4 * m.hidden, m.vocab
    mt = str(cfg.get("model_type", "")).lower()
    out: list[Tensor] = []

    def add(name, shape, block=None):
        out.append(Tensor(name, tuple(int(s) for s in shape), block))

    if not m.gated_mlp:  # GPT-2 / zerodp's GPT / a hand-typed 2-matrix MLP
        bias = mt in ("gpt2", "zerodp-gpt")
        positions = int(cfg.get("n_positions", 0) or 0) if bias else 0
        add("tok_emb.weight", (vocab, h))
        if positions:
            add("pos_emb.weight", (positions, h))
        for i in range(m.layers):
            p = f"blocks.{i}."
            add(p + "ln1.weight", (h,), i)
            if bias:
                add(p + "ln1.bias", (h,), i)
            add(p + "attn.qkv.weight", (3 * h, h), i)
            if bias:
                add(p + "attn.qkv.bias", (3 * h,), i)
            add(p + "attn.proj.weight", (h, h), i)
            if bias:
                add(p + "attn.proj.bias", (h,), i)
            add(p + "ln2.weight", (h,), i)
            if bias:
                add(p + "ln2.bias", (h,), i)
            add(p + "mlp.fc.weight", (ffn, h), i)
            if bias:
                add(p + "mlp.fc.bias", (ffn,), i)
            add(p + "mlp.proj.weight", (h, ffn), i)
            if bias:
                add(p + "mlp.proj.bias", (h,), i)
        add("ln_f.weight", (h,))
        if bias:
            add("ln_f.bias", (h,))
        if not m.tied_embeddings:
            add("head.weight", (vocab, h))
    else:  # Llama / Mistral / Qwen2 / Mixtral
        q_dim, kv_dim = m.q_dim, m.kv_dim
        qkv_bias = bool(cfg.get("attention_bias")) or mt.startswith("qwen2")
        mlp_bias = bool(cfg.get("mlp_bias"))
        experts = m.experts
        width = m.expert_ffn or ffn
        add("model.embed_tokens.weight", (vocab, h))
        for i in range(m.layers):
            p = f"model.layers.{i}."
            for proj, shape in (("q_proj", (q_dim, h)), ("k_proj", (kv_dim, h)),
                                ("v_proj", (kv_dim, h))):
                add(p + f"self_attn.{proj}.weight", shape, i)
                if qkv_bias:
                    add(p + f"self_attn.{proj}.bias", shape[:1], i)
            add(p + "self_attn.o_proj.weight", (h, q_dim), i)
            if cfg.get("attention_bias"):
                add(p + "self_attn.o_proj.bias", (h,), i)
            if experts > 1:  # transformers' layout: a router, then every expert in two 3-D tensors
                add(p + "mlp.gate.weight", (experts, h), i)
                add(p + "mlp.experts.gate_up_proj", (experts, 2 * width, h), i)
                add(p + "mlp.experts.down_proj", (experts, h, width), i)
            else:
                for proj, shape in (("gate_proj", (ffn, h)), ("up_proj", (ffn, h)), ("down_proj", (h, ffn))):
                    add(p + "mlp." + proj + ".weight", shape, i)
                    if mlp_bias:
                        add(p + "mlp." + proj + ".bias", shape[:1], i)
            add(p + "input_layernorm.weight", (h,), i)
            add(p + "post_attention_layernorm.weight", (h,), i)
        add("model.norm.weight", (h,))
        if not m.tied_embeddings:
            add("lm_head.weight", (vocab, h))
    if optimizer == "muon":
        out = [Tensor(t.name, t.shape, t.block, 0 if tensor_optimizer("muon", t) == "muon" else 1)
               for t in out]
    return out


# ------------------------------------------------------------------------------------------
# Groups and owners, as the engine forms them

def whole_groups(tensors: list[Tensor], stage: int, optimizer: str) -> frozenset[int]:
    """The param groups whose tensors are stepped whole on one rank: those of a per-tensor
    optimizer — under ``muon`` Muon's, AdamW's staying flat — or, for an elementwise
    ``optimizer`` priced here (declared per-tensor, ``optimizer_layout="owner"``), all of them.
    At stages 1–2 they lie in owner-aligned buckets; at stage 3 the owner exchange brings them
    whole to their owner for the step."""
    everything = frozenset(t.group for t in tensors)
    if optimizer in ELEMENTWISE:
        return everything
    return frozenset(t.group for t in tensors if tensor_optimizer(optimizer, t) in PER_TENSOR)


def plan_groups(tensors: list[Tensor], stage: int, bucket_mb: float = BUCKET_MB,
                first_bucket_mb: float = FIRST_BUCKET_MB, elem_bytes: float = 2,
                whole: frozenset[int] = frozenset(), n: int = 1) -> list[list[int]]:
    """Indices of ``tensors`` per group in the order the engine lays them out (module
    docstring): buckets at stages 1–2 — those of the param groups in ``whole`` sized to a shard
    group of ``n`` (:func:`zerodp.plan.units.plan_buckets`) — units at stage 3."""
    if stage == 3:
        blocks = sorted({t.block for t in tensors if t.block is not None})
        members = [[i for i, t in enumerate(tensors) if t.block is None]] + \
            [[i for i, t in enumerate(tensors) if t.block == b] for b in blocks]
        return [sorted(g, key=lambda i: (tensors[i].group, i)) for g in members if g]
    return plan_buckets([t.numel for t in tensors], [t.group for t in tensors], elem_bytes, "bucketed",
                        bucket_mb, first_bucket_mb, whole_groups=whole, shard_size=n)


def assign_owners(sizes: list[list[int]], n: int,
                  costs: list[list[int]] | None = None) -> tuple[list[list[int]], list[dict[int, int]]]:
    """Owners of each group of element counts in turn (:meth:`zerodp.plan.units.OwnerLedger.assign`,
    module docstring), ``costs`` the optimizer state of each tensor (default: its size): per
    group, the owner of each tensor and ``{rank: elements}`` for the ranks that own any."""
    ledger = OwnerLedger(n)
    owners, owned = [], []
    for k, group in enumerate(sizes):
        own = ledger.assign(group, None if costs is None else costs[k])
        mine: dict[int, int] = {}
        for size, r in zip(group, own):
            mine[r] = mine.get(r, 0) + size
        owners.append(own)
        owned.append(mine)
    return owners, owned


@dataclass(frozen=True)
class GroupLayout:
    """One group (a bucket or a unit) as the engine lays it out for a shard group of ``n``: its
    tensors (``members``, indices in layout order) and either each one's owner rank (``owners``:
    owner-aligned, every tensor whole in its owner's slice, guide §12.3) or None (flat: back to
    back, cut into N even slices). ``slice_numel``: each rank's padded slice."""

    members: tuple[int, ...]
    owners: tuple[int, ...] | None
    n: int
    numel: int
    slice_numel: int

    @property
    def padded_numel(self) -> int:
        return self.n * self.slice_numel

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def group_layouts(tensors: list[Tensor], n: int, stage: int, optimizer: str, bucket_mb: float = BUCKET_MB,
                  first_bucket_mb: float = FIRST_BUCKET_MB, elem_bytes: float = 2) -> list[GroupLayout]:
    """Every group of ``tensors`` at ``stage`` (1–3) as the engine lays it out for ``n`` ranks
    under ``optimizer`` (:func:`whole_groups`, :func:`plan_groups`); owners by
    :func:`assign_owners`, loads carried across the owner-aligned groups only."""
    whole = whole_groups(tensors, stage, optimizer) if stage < 3 else frozenset()  # stage 3: flat units
    groups = plan_groups(tensors, stage, bucket_mb, first_bucket_mb, elem_bytes, whole, n)
    aligned = [g for g in groups if tensors[g[0]].group in whole]
    owners, owned = assign_owners([[tensors[i].numel for i in g] for g in aligned], n,
                                  [[state_cost(optimizer, tensors[i]) for i in g] for g in aligned])
    by_group = {id(g): (own, mine) for g, own, mine in zip(aligned, owners, owned)}
    out = []
    for g in groups:
        numel = sum(tensors[i].numel for i in g)
        if id(g) in by_group:
            own, mine = by_group[id(g)]
            out.append(GroupLayout(tuple(g), tuple(own), n, numel, max(mine.values(), default=0)))
        else:
            out.append(GroupLayout(tuple(g), None, n, numel, -(-numel // n)))
    return out


class _RankFigures:
    """Elements and optimizer-state bytes per rank of a shard group of ``n`` (up to a million):
    a sparse part (the owners of whole tensors) plus piecewise-constant runs over ranks (the flat
    groups' even slices), so that the fullest rank is found without a list of n entries."""

    def __init__(self, n: int):
        self.n = n
        self.sparse: dict[int, list[int]] = {}  # rank -> [elements, state bytes]
        self.steps: dict[int, list[int]] = {}  # rank -> change of [elements, state bytes] from rank - 1 on

    def add(self, rank: int, elements: int, state: int) -> None:
        e = self.sparse.setdefault(rank, [0, 0])
        e[0] += elements
        e[1] += state

    def add_run(self, lo: int, hi: int, elements: int, state: int) -> None:
        """Ranks ``lo`` to ``hi - 1`` each hold ``elements`` more and ``state`` bytes more."""
        if lo >= hi:
            return
        for r, sign in ((lo, 1), (hi, -1)):
            d = self.steps.setdefault(r, [0, 0])
            d[0] += sign * elements
            d[1] += sign * state

    def runs(self) -> list[tuple[int, int, int, int]]:
        """(lo, hi, elements, state) of the flat part, constant over ranks lo to hi - 1."""
        out, at, level = [], 0, [0, 0]
        for r in sorted(self.steps) + [self.n]:
            if r > at:
                out.append((at, min(r, self.n), level[0], level[1]))
                at = r
            if r < self.n:
                level = [a + b for a, b in zip(level, self.steps[r])]
        return [run for run in out if run[0] < self.n]

    def listed(self) -> tuple[list[int], list[int]]:
        """Elements and state bytes of every rank (for n up to :data:`MAX_LISTED`)."""
        elements, state = [0] * self.n, [0] * self.n
        for lo, hi, e, b in self.runs():
            for r in range(lo, hi):
                elements[r], state[r] = e, b
        for r, (e, b) in self.sparse.items():
            elements[r] += e
            state[r] += b
        return elements, state

    def most_state(self) -> int:
        """The fullest rank's state bytes."""
        most = 0
        for lo, hi, _, b in self.runs():
            inside = [s for r, (_, s) in self.sparse.items() if lo <= r < hi]
            if len(inside) < hi - lo:
                inside.append(0)
            most = max(most, b + max(inside))
        return most


def _spread(figures: _RankFigures, at: int, size: int, s: int, per_element: int) -> None:
    """``per_element`` state bytes on each rank for each element of a tensor at ``at`` (``size``
    elements) of a flat group cut into slices of ``s``."""
    q0, q1 = at // s, (at + size - 1) // s
    if q0 == q1:
        figures.add_run(q0, q0 + 1, 0, per_element * size)
        return
    figures.add_run(q0, q0 + 1, 0, per_element * ((q0 + 1) * s - at))
    figures.add_run(q0 + 1, q1, 0, per_element * s)
    figures.add_run(q1, q1 + 1, 0, per_element * (at + size - q1 * s))


def _unit_runs(figures: _RankFigures, moved: _RankFigures, held: _RankFigures | None, layout: GroupLayout,
               tensors: list[Tensor], optimizer: str, owners: dict[int, int], per: list[int]) -> None:
    """A stage-3 unit, flat: rank r holds elements [r·s, (r+1)·s); an elementwise tensor's state
    lies with its pieces (one step scalar each), a tensor stepped whole all on its owner
    (``owners``), and the exchange moves (``moved``, as its state bytes) each such tensor's pieces
    twice from their holders and the whole tensor once from its owner; ``held`` (the unit's
    batch) counts the elements its buffers hold: the pieces sent twice, and on the owner the
    whole tensor four times (received values and gradient, then the proxy and its ``.grad``)."""
    s, numel = layout.slice_numel, layout.numel
    full = numel // s if s else 0
    figures.add_run(0, full, s, 0)
    if full < layout.n and numel > full * s:
        figures.add_run(full, full + 1, numel - full * s, 0)
    at = 0
    for i in layout.members:
        size = tensors[i].numel
        if size and i in owners:
            figures.add(owners[i], 0, per[i])
            _spread(moved, at, size, s, 2)
            moved.add(owners[i], 0, size)
            _spread(held, at, size, s, 2)
            held.add(owners[i], 0, 4 * size)
        elif size:
            elements, scalars = state_numel(tensor_optimizer(optimizer, tensors[i]), (1,))
            _spread(figures, at, size, s, FP32 * elements)
            if scalars:
                figures.add_run(at // s, (at + size - 1) // s + 1, 0, FP32 * scalars)
        at += size


def _flat_runs(figures: _RankFigures, layout: GroupLayout, tensors: list[Tensor], optimizer: str) -> None:
    """A flat group's share per rank: rank r holds elements [r·s, (r+1)·s) of the group (s its
    slice), and the optimizer one piece per tensor those cut (its own step scalars, as the
    engine's per-parameter targets)."""
    s, numel = layout.slice_numel, layout.numel
    full = numel // s if s else 0
    per, scalars = state_numel(tensor_optimizer(optimizer, tensors[layout.members[0]]), (1,))
    figures.add_run(0, full, s, FP32 * per * s)
    if full < layout.n and numel > full * s:
        figures.add_run(full, full + 1, numel - full * s, FP32 * per * (numel - full * s))
    at = 0
    for i in layout.members:
        size = tensors[i].numel
        if size and scalars:
            figures.add_run(at // s, (at + size - 1) // s + 1, 0, FP32 * scalars)
        at += size


@dataclass(frozen=True)
class Ownership(ToDict):
    """One stage's bill under tensor ownership, per rank of a shard group of ``n``.
    ``to_dict()`` keys: ``optimizer``, ``stage``, ``stage_name``, ``n``, ``tensors``,
    ``groups``, ``params`` (Σ numel), ``owned_numel`` (per rank; null above
    :data:`MAX_LISTED`), ``shard_numel`` (Σ_groups the largest owned set: each rank's padded
    slice), ``padded_numel`` (N·shard_numel: what the collectives move), ``padding``,
    ``state_bytes`` (optimizer state per rank, or null), ``max_state_bytes`` (the fullest rank:
    what decides the fit), ``mean_state_bytes`` (the Ψ/N share), ``imbalance`` (max/mean
    state), ``master_bytes`` (fp32 master per rank: 4·shard_numel) and
    ``comm_elements_per_step`` (2 padded_numel at stages 1–2, 3 at stage 3 plus the fullest
    rank's exchange, 2Ψ at stage 0), ``exchange_elements`` (stage 3: what each rank sends in the
    owner exchange — its pieces of the tensors stepped whole, twice, and the tensors it owns,
    once; null above :data:`MAX_LISTED`, 0 elsewhere), ``max_exchange_elements`` (the fullest
    rank's), ``exchange_peak_bytes`` (stage 3: the most the exchange holds at once on one rank,
    a batch of units at a time — the owner's tensors received and assembled with their gradients, and
    the pieces sent; fp32) and ``largest_group_numel`` (the padded elements of the largest group: at stage 2
    its full gradient is held from its first gradient to its ReduceScatter; Ψ at stage 0)."""

    optimizer: str
    stage: int
    stage_name: str
    n: int
    tensors: int
    groups: int
    params: int
    owned_numel: list
    shard_numel: int
    padded_numel: int
    padding: int
    state_bytes: list
    max_state_bytes: int
    mean_state_bytes: float
    imbalance: float
    master_bytes: int
    comm_elements_per_step: int
    largest_group_numel: int
    exchange_elements: list | None = None
    max_exchange_elements: int = 0
    exchange_peak_bytes: int = 0


def ownership(tensors: list[Tensor], n: int, stage: int, optimizer: str,
              bucket_mb: float = BUCKET_MB, first_bucket_mb: float = FIRST_BUCKET_MB,
              elem_bytes: float = 2) -> Ownership:
    """What each of ``n`` ranks holds at ``stage`` when ``optimizer`` steps whole tensors
    (stages 1–3; the tensors of an elementwise optimizer beside it flat at stages 1–2) — or,
    stage 0, everything on every rank. ``elem_bytes``: bytes of one working parameter, which
    sizes the buckets (bf16: 2)."""
    n = check_count("n (ranks per shard group)", n)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0 (DP), 1, 2, 3 (ZeRO-1/2/3); got {stage!r}")
    check_optimizer(optimizer)
    if not tensors:
        raise ValueError("no tensors to price")
    per = [state_bytes(optimizer, t) for t in tensors]
    total = sum(t.numel for t in tensors)
    listed = n <= MAX_LISTED
    if stage == 0:
        everything = sum(per)
        return Ownership(optimizer, 0, STAGE_NAMES[0], n, len(tensors), 0, total,
                         [total] * n if listed else None, total, total, 0,
                         [everything] * n if listed else None, everything, float(everything), 1.0,
                         FP32 * total, 2 * total, total)
    layouts = group_layouts(tensors, n, stage, optimizer, bucket_mb, first_bucket_mb, elem_bytes)
    figures, moved = _RankFigures(n), _RankFigures(n)
    exchange_peak = 0
    if stage == 3:  # flat units; the owner exchange's tensors in layout order, owners by state
        whole = whole_groups(tensors, stage, optimizer)
        order = [i for layout in layouts for i in layout.members if tensors[i].group in whole]
        owners = dict(zip(order, step_owners([per[i] for i in order], n)))
        # the step's transient buffers, a batch of units at a time (exchange_batches): on the
        # owner the whole tensors and their gradients, received (2 copies) then assembled (2
        # more); the pieces sent (2) — ``held``, one per batch
        exchanging = [k for k, layout in enumerate(layouts) if any(i in owners for i in layout.members)]
        batches = exchange_batches([sum(tensors[i].numel for i in layouts[k].members if i in owners)
                                    for k in exchanging])
        held = [_RankFigures(n) for _ in batches]
        held_in = {exchanging[j]: held[b] for b, batch in enumerate(batches) for j in batch}
        for k, layout in enumerate(layouts):
            _unit_runs(figures, moved, held_in.get(k), layout, tensors, optimizer, owners, per)
        exchange_peak = max((FP32 * h.most_state() for h in held), default=0)
    for layout in layouts if stage < 3 else ():
        if layout.owners is None:
            _flat_runs(figures, layout, tensors, optimizer)
            continue
        for i, r in zip(layout.members, layout.owners):
            figures.add(r, tensors[i].numel, per[i])
    shard = sum(layout.slice_numel for layout in layouts)
    owned, states = figures.listed() if listed else (None, None)
    everything = sum(b for _, b in figures.sparse.values()) + sum((hi - lo) * b for lo, hi, _, b in figures.runs())
    mean = everything / n
    most = figures.most_state()
    exchange = moved.listed()[1] if listed else None
    most_moved = moved.most_state()
    return Ownership(optimizer, stage, STAGE_NAMES[stage], n, len(tensors), len(layouts), total, owned, shard,
                     n * shard, n * shard - total, states, most, mean, round(most / mean, 6) if mean else 1.0,
                     FP32 * shard, (3 if stage == 3 else 2) * n * shard + most_moved,
                     max(layout.padded_numel for layout in layouts), exchange, most_moved, exchange_peak)
