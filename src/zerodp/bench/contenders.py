"""Who runs in ``zerodp bench``: the names, roles and labels of the contenders, torch-free.

The builders are in :mod:`zerodp.bench.peers`; this module only says what exists. Three kinds:

- **the fixed contenders** (:data:`CONTENDERS`): the floor, our engine per stage, its PyTorch
  peers (:data:`COMPARISONS` pairs them, guide §9), and the ``bucket_mb="auto"`` row;
- **variants of ours** (:class:`Variant`, :data:`VARIANTS`): our engine at a stage with compressed
  collectives and/or hybrid sharding (guide §14-§15), or compiled (``model.compile()`` before
  ``parallelize``, :func:`zerodp.engine.compiled.compile_in_place`), built and timed beside
  ``ours{stage}``;
- **compiled peers** (:func:`compiled_peer`): each stage's reference peer with its model compiled
  the same way before the peer wraps it (``ddp_bucket_view_compiled``, ``fsdp2_compiled``, ...).

A new kind of variant (as ``compiled`` was) is one new field of :class:`Variant`: its name,
label, engine options and where it applies are all read from there, and :func:`variants_for` is
the one enumeration the bench spec calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.train.config import Mode

#: name → (stage, role, label). Roles: "ours", "peer", "floor". The variants are added below.
CONTENDERS: dict[str, tuple[int | None, str, str]] = {
    "floor": (None, "floor", "no communication (floor)"),
    "ours0": (0, "ours", "zerodp stage 0"),
    "ddp": (0, "peer", "DDP default"),
    "ddp_bucket_view": (0, "peer", "DDP gradient_as_bucket_view=True"),
    "ours1": (1, "ours", "zerodp stage 1"),
    "zero_ddp": (1, "peer", "ZeroRedundancyOptimizer(AdamW) + DDP"),
    "ours2": (2, "ours", "zerodp stage 2"),
    "fsdp2_keep": (2, "peer", "FSDP2 reshard_after_forward=False"),
    "ours3": (3, "ours", "zerodp stage 3"),
    "fsdp2": (3, "peer", "FSDP2 reshard_after_forward=True"),
    "ours0_auto": (0, "ours", "zerodp stage 0, bucket_mb=auto"),
}

#: stage → (ours, peers): the comparisons ``zerodp bench`` prints, the first peer is the reference.
COMPARISONS: dict[int, tuple[str, tuple[str, ...]]] = {
    0: ("ours0", ("ddp_bucket_view", "ddp")),
    1: ("ours1", ("zero_ddp",)),
    2: ("ours2", ("fsdp2_keep",)),
    3: ("ours3", ("fsdp2",)),
}


class Optimizer(Mode):
    """``zerodp bench --optimizer``: what every contender steps with. ``adamw``: AdamW over every
    parameter (the bench as it was). ``muon``: ``torch.optim.Muon`` over the transformer blocks'
    2-D weights and AdamW over the rest (embeddings, LayerNorms, biases, the LM head), the way Muon
    is used (:func:`zerodp.bench.peers.optimizers_for`)."""

    ADAMW = "adamw"
    MUON = "muon"


#: ``--optimizer muon``'s one PyTorch peer: DDP with stock Muon + AdamW, their state replicated on
#: every rank. It is the reference of every stage (ZeRO-opt, FSDP2 have no Muon pairing here).
MUON_PEER = "ddp_muon"
CONTENDERS[MUON_PEER] = (0, "peer", "DDP + Muon/AdamW (replicated state)")

#: stage → (ours, peers) under ``--optimizer muon``: ours at each stage against DDP + Muon.
MUON_COMPARISONS: dict[int, tuple[str, tuple[str, ...]]] = {s: (ours, (MUON_PEER,))
                                                            for s, (ours, _) in COMPARISONS.items()}


def comparisons(optimizer: "Optimizer | str" = Optimizer.ADAMW) -> dict[int, tuple[str, tuple[str, ...]]]:
    """The comparisons a bench with ``optimizer`` prints: :data:`COMPARISONS`, or under ``muon``
    :data:`MUON_COMPARISONS`."""
    return MUON_COMPARISONS if Optimizer.parse(optimizer, "optimizer", optional=False) is Optimizer.MUON \
        else COMPARISONS



class Compression(Mode):
    """``zerodp bench --compress`` and ``zerodp predict --compress``: the planner's compression names
    (``zerodp.plan.hybrid.COMPRESSIONS``, guide §15)."""

    NONE = "none"
    BF16_REDUCE = "bf16-reduce"
    INT8_PARAMS = "int8-params"
    INT8_GRADS = "int8-grads"
    INT8 = "int8"


#: compression → (name suffix, the engine options that put it on the wire, guide §15).
COMPRESS_OPTIONS: dict[Compression, tuple[str, dict]] = {
    Compression.BF16_REDUCE: ("bf16", {"reduce_dtype": "bf16"}),
    Compression.INT8_PARAMS: ("int8p", {"quantize_params": True}),
    Compression.INT8_GRADS: ("int8g", {"quantize_grads": True}),
    Compression.INT8: ("int8", {"quantize_params": True, "quantize_grads": True}),
}

COMPILED = "compiled"  # the name suffix and label part of compiled contenders (zerodp bench --compile)

SHORT_LABELS = {"floor": "floor", "ours0": "zerodp", "ddp": "DDP", "ddp_bucket_view": "DDP bucket view",
                "ours1": "zerodp", "zero_ddp": "ZeRO-opt + DDP", "ours2": "zerodp", "fsdp2_keep": "FSDP2 keep",
                "ours3": "zerodp", "fsdp2": "FSDP2", "ours0_auto": "zerodp auto bucket",
                MUON_PEER: "DDP + Muon"}


@dataclass(frozen=True)
class Variant:
    """Our engine at ``stage`` with ``compress`` on its collectives and, with ``hybrid``, shard
    groups of ``--shard-size`` ranks (guide §14-§15); with ``compiled``, the model compiled in
    place before ``parallelize`` (``zerodp bench --compile``)."""

    stage: int
    compress: Compression = Compression.NONE
    hybrid: bool = False
    compiled: bool = False

    def __post_init__(self):
        object.__setattr__(self, "compress", Compression.parse(self.compress, "compress", optional=False))

    @property
    def plain(self) -> bool:
        """Neither compressed, hybrid nor compiled: ``ours{stage}`` itself, not a variant."""
        return self.compress is Compression.NONE and not self.hybrid and not self.compiled

    @property
    def applies(self) -> bool:
        """Whether the engine accepts it: stage 0 shards nothing and has no AllGather nor
        ReduceScatter to quantize, so only ``bf16-reduce`` applies there."""
        return self.stage != 0 or (not self.hybrid and self.compress in (Compression.NONE, Compression.BF16_REDUCE))

    @property
    def parts(self) -> list[str]:
        compressed = [] if self.compress is Compression.NONE else [self.compress.value]
        return (["hybrid"] if self.hybrid else []) + compressed + ([COMPILED] if self.compiled else [])

    @property
    def name(self) -> str:
        """``ours3_int8``, ``ours0_bf16``, ``ours3_hybrid``, ``ours3_hybrid_int8``, ``ours0_compiled``;
        ``ours{stage}`` when plain."""
        suffix = (["hybrid"] if self.hybrid else []) + (
            [COMPRESS_OPTIONS[self.compress][0]] if self.compress is not Compression.NONE else []) + (
            [COMPILED] if self.compiled else [])
        return "_".join([f"ours{self.stage}", *suffix])

    @property
    def label(self) -> str:
        return f"zerodp stage {self.stage}, {' + '.join(self.parts)}"

    @property
    def short_label(self) -> str:
        return "zerodp " + " ".join(self.name.split("_")[1:])

    def engine_options(self, shard_size: int | None = None) -> dict:
        """The :func:`zerodp.parallelize` keywords that make this variant."""
        out = dict(COMPRESS_OPTIONS[self.compress][1]) if self.compress is not Compression.NONE else {}
        if self.hybrid:
            if shard_size is None:
                raise ValueError(f"contender {self.name} is hybrid: give shard_size (zerodp bench --shard-size G)")
            out["shard_size"] = shard_size
        return out


def variants_for(stage: int, compress: tuple[Compression, ...], hybrid: bool,
                 compiled: bool = False) -> list[Variant]:
    """The variants a bench asking for ``compress`` (and, with ``hybrid``, hybrid sharding) runs at
    ``stage``: flat ones first, then hybrid ones, each in the order ``compress`` names them; with
    ``compiled``, then ``ours{stage}`` compiled (compiled rows are of the plain engine only)."""
    out = []
    for h in (False, True) if hybrid else (False,):
        for c in dict.fromkeys(compress):
            v = Variant(stage, c, h)
            if not v.plain and v.applies:
                out.append(v)
    if compiled:
        out.append(Variant(stage, compiled=True))
    return out


#: name → :class:`Variant`: every variant any bench can run.
VARIANTS: dict[str, Variant] = {v.name: v for stage in COMPARISONS
                                for v in variants_for(stage, tuple(Compression), True, True)}
CONTENDERS.update({n: (v.stage, "ours", v.label) for n, v in VARIANTS.items()})


def compiled_peer(stage: int) -> str:
    """The compiled form of ``stage``'s reference peer (the first of :data:`COMPARISONS`): its model
    compiled in place (:func:`zerodp.engine.compiled.compile_in_place`) before the peer wraps it."""
    return f"{COMPARISONS[stage][1][0]}_{COMPILED}"


def is_compiled(name: str) -> bool:
    """Whether contender ``name`` runs a compiled model (ours or a peer)."""
    return name.endswith(f"_{COMPILED}")


def eager_form(name: str) -> str:
    """``name`` without its compile: ``fsdp2_compiled`` -> ``fsdp2``, ``ours0_compiled`` -> ``ours0``."""
    return name.removesuffix(f"_{COMPILED}")


for _stage in COMPARISONS:
    _peer = COMPARISONS[_stage][1][0]
    CONTENDERS[compiled_peer(_stage)] = (_stage, "peer", CONTENDERS[_peer][2] + ", compiled")


def variant_name(stage: int, compress: Compression = Compression.NONE, hybrid: bool = False) -> str:
    return Variant(stage, compress, hybrid).name


def engine_options(name: str, shard_size: int | None = None) -> dict:
    """The :func:`zerodp.parallelize` keywords of contender ``name`` ({} for all but the variants)."""
    return VARIANTS[name].engine_options(shard_size) if name in VARIANTS else {}


def variant_of(name: str) -> Variant:
    """The variant ``name`` is, or the plain ``ours{stage}`` for any other contender of ours."""
    return VARIANTS.get(name) or Variant(CONTENDERS[name][0])


def short_label(name: str) -> str:
    """A bar's label: :data:`SHORT_LABELS`, or "zerodp int8", "zerodp hybrid bf16" for the variants."""
    if name in SHORT_LABELS:
        return SHORT_LABELS[name]
    if name in VARIANTS:
        return VARIANTS[name].short_label
    return SHORT_LABELS[eager_form(name)] + " " + COMPILED
