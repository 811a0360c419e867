"""What ``zerodp bench`` measured, as data: per contender (:class:`ContenderResult`), per regime, the
whole run (:class:`BenchResult`, to and from ``bench.json``), and the rows derived from it — ours
against each peer (:func:`summary_rows`) and the compressed and hybrid variants against our plain
row of their stage (:func:`compressed_rows`), and the compiled rows against the eager ones and ours
against the peer (:func:`compiled_rows`). The text and the plot are :mod:`zerodp.bench.tables`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from zerodp.bench.contenders import COMPARISONS, MUON_PEER, VARIANTS, Optimizer, compiled_peer, is_compiled
from zerodp.bench.spec import BenchSpec, Regime

RATIO_TARGET = 1.05  # ours/PyTorch median step time for stages 0 and 3
# --optimizer muon at stage 2 (issue 36): optimizer state per rank about N× less than DDP + Muon's
# (at least this share of N), and bytes sent per step at most this multiple of DDP + Muon's
MUON_STATE_SHARE = 0.9
MUON_SENT_TARGET = 1.1
PREDICTION_TOLERANCE = 0.25  # predicted within ±25 % of measured


@dataclass
class ContenderResult:
    name: str
    label: str
    stage: int | None
    role: str
    times_s: list[float]  # per timed step, max over ranks
    median_s: float
    peak_rss_bytes: list[int | None]  # per rank
    model_state_bytes: list[int]  # per rank
    sent_bytes_per_step: list[float | None]  # per rank, median over timed steps
    options: dict = field(default_factory=dict)
    own_comm: dict = field(default_factory=dict)  # ours: the engine's own accounting, rank 0
    first_loss: float = float("nan")
    predicted_s: float | None = None
    # ours: bytes this rank sent per step by leg ("intra", "inter"), summed over the step's
    # collectives in the engine's trace (``sent_bytes``), median over timed steps; rank 0
    wire_bytes: dict | None = None
    predicted_wire_bytes: dict | None = None  # the planner's, by leg (bench.predict)
    first_step_s: float | None = None  # the untimed build step (a compiled model compiles in it), max over ranks
    timed_compiles: int | None = None  # graphs dynamo compiled during the timed steps, max over ranks (0 expected)
    # per rank: bytes of the optimizer's state alone (counted with the model states, after the
    # second step's backward); None where not counted (a bench.json from before)
    optimizer_state_bytes: list[int | None] | None = None
    last_loss: float = float("nan")  # rank 0's loss of the last step run (same batches for every contender)

    @property
    def wire_total(self) -> float | None:
        return None if self.wire_bytes is None else sum(self.wire_bytes.values())


@dataclass
class RegimeResult:
    regime: Regime
    contenders: dict[str, ContenderResult]
    wall_s: float


@dataclass
class Row:
    """One line of the summary: ours against one peer in one regime (ratios from the medians)."""

    regime: str
    tokens_per_rank: int
    stage: int
    ours: str
    peer: str
    ours_ms: float
    peer_ms: float
    ratio: float  # ours / peer
    floor_ms: float | None
    ours_overhead: float | None  # ours / floor
    peer_overhead: float | None
    predicted_ms: float | None = None
    predicted_error: float | None = None  # (predicted − measured) / measured, ours
    # Quartiles of the per-step ratios ours_i / peer_i (step i of both ran in the same round): how
    # far the ratio moves from step to step, i.e. how much of it is noise.
    paired_q1: float | None = None
    paired_q3: float | None = None

    @property
    def target(self) -> float | None:
        return RATIO_TARGET if self.stage in (0, 3) and self.peer in _REFERENCE_PEERS else None


_REFERENCE_PEERS = {peers[0] for _, peers in COMPARISONS.values()}


def display_label(c: "ContenderResult", bucket: bool = True) -> str:
    """A contender's label in the tables: the shard-group size of a hybrid one and, with
    ``bucket``, the bucket size where it is not the bench's ``bucket_mb`` (the auto row's choice,
    our stage 2's, :func:`contender_buckets`)."""
    label = c.label
    if "shard_size" in c.options:
        label = label.replace("hybrid", f"hybrid g={c.options['shard_size']}")
    if not bucket:
        return label
    if c.name == "ours0_auto":
        return label + f" ({c.options['bucket_mb']:.3g} MB)"
    if c.role == "ours" and c.stage == 2 and "bucket_mb" in c.options:
        return label + f" ({c.options['bucket_mb']:.3g} MiB buckets)"
    return label


@dataclass
class BenchResult:
    spec: BenchSpec
    machine: dict
    regimes: list[RegimeResult]
    auto_bucket_mb: dict[str, float] = field(default_factory=dict)
    params: int = 0

    def rows(self) -> list[Row]:
        return summary_rows(self)

    def to_dict(self) -> dict:
        return {
            "spec": asdict(self.spec),
            "machine": self.machine,
            "params": self.params,
            "auto_bucket_mb": self.auto_bucket_mb,
            "regimes": [{"regime": asdict(r.regime), "tokens_per_rank": r.regime.tokens, "wall_s": r.wall_s,
                         "contenders": {k: asdict(c) for k, c in r.contenders.items()}} for r in self.regimes],
            "rows": [asdict(row) | {"target": row.target} for row in self.rows()],
            "compressed_rows": [asdict(row) for row in compressed_rows(self)],
            "compiled_rows": [asdict(row) for row in compiled_rows(self)],
            "muon_rows": [asdict(row) for row in muon_rows(self)],
        }


def result_from_dict(d: dict) -> BenchResult:
    """A :class:`BenchResult` back from its JSON (``bench.json``): re-render without re-measuring."""
    spec_d = dict(d["spec"])
    spec_d["regimes"] = tuple(Regime(**r) for r in spec_d["regimes"])
    spec_d["stages"] = tuple(spec_d["stages"])
    spec_d["compress"] = tuple(spec_d["compress"])
    spec = BenchSpec(**spec_d)
    regimes = [RegimeResult(Regime(**r["regime"]), {k: ContenderResult(**c) for k, c in r["contenders"].items()},
                            r["wall_s"]) for r in d["regimes"]]
    return BenchResult(spec, d["machine"], regimes, d["auto_bucket_mb"], d["params"])



def summary_rows(result: BenchResult) -> list[Row]:
    """ours vs each peer, per regime and stage, ratios from the medians; plus auto vs 25 MB."""
    rows = []
    for rr in result.regimes:
        cs = rr.contenders
        floor = cs.get("floor")
        floor_ms = floor.median_s * 1e3 if floor else None
        comps = result.spec.comparisons
        pairs = [(s, comps[s][0], p) for s in result.spec.stages for p in comps[s][1]]
        if "ours0_auto" in cs:
            pairs.append((0, "ours0_auto", "ours0"))
        for stage, ours, peer in pairs:
            o, p = cs[ours], cs[peer]
            pred = o.predicted_s * 1e3 if o.predicted_s is not None else None
            q1, q3 = paired_quartiles(o.times_s, p.times_s)
            rows.append(Row(
                rr.regime.name, rr.regime.tokens, stage, ours, peer, o.median_s * 1e3, p.median_s * 1e3,
                o.median_s / p.median_s, floor_ms,
                o.median_s / floor.median_s if floor else None, p.median_s / floor.median_s if floor else None,
                pred, (pred - o.median_s * 1e3) / (o.median_s * 1e3) if pred is not None else None, q1, q3))
    return rows


def paired_quartiles(ours: list[float], peer: list[float]) -> tuple[float | None, float | None]:
    """First and third quartiles of ours_i / peer_i over the timed steps (None under 2 steps)."""
    ratios = [a / b for a, b in zip(ours, peer) if b > 0]
    if len(ratios) < 2:
        return None, None
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[2]



@dataclass
class CompressedRow:
    """One compressed or hybrid contender of ours against ``ours{stage}`` of the same run (guide
    §14-§15): times, ×floor, bytes per rank per step by leg from the trace and the planner's."""

    regime: str
    tokens_per_rank: int
    stage: int
    name: str
    label: str
    ms: float
    over_floor: float | None
    vs_plain: float  # median / ours{stage}'s median
    peak_rss_bytes: int | None
    wire_intra: float | None
    wire_inter: float | None
    bytes_vs_plain: float | None  # traced bytes / ours{stage}'s traced bytes
    planner_bytes: float | None  # the planner's bytes per rank per step, both legs
    planner_vs_plain: float | None  # the planner's ratio to its own uncompressed flat figure
    predicted_ms: float | None
    predicted_error: float | None


def compressed_rows(result: BenchResult) -> list[CompressedRow]:
    """Every :data:`~zerodp.bench.contenders.VARIANTS` contender measured, with ours of its stage."""
    rows = []
    for rr in result.regimes:
        cs = rr.contenders
        floor = cs.get("floor")
        for c in cs.values():
            if c.name not in VARIANTS or is_compiled(c.name):
                continue
            plain = cs.get(f"ours{c.stage}")
            ms = c.median_s * 1e3
            w = c.wire_bytes or {}
            pw, pp = c.predicted_wire_bytes, plain.predicted_wire_bytes if plain else None
            pred = c.predicted_s * 1e3 if c.predicted_s is not None else None
            rows.append(CompressedRow(
                rr.regime.name, rr.regime.tokens, c.stage, c.name, display_label(c, bucket=False), ms,
                c.median_s / floor.median_s if floor else None,
                c.median_s / plain.median_s if plain else float("nan"), c.peak_rss_bytes[0],
                w.get("intra") if c.wire_bytes else None, w.get("inter") if c.wire_bytes else None,
                c.wire_total / plain.wire_total if plain and plain.wire_total and c.wire_total is not None else None,
                sum(pw.values()) if pw else None,
                sum(pw.values()) / sum(pp.values()) if pw and pp and sum(pp.values()) else None,
                pred, (pred - ms) / ms if pred is not None else None))
    return rows


@dataclass
class CompiledRow:
    """One contender of a stage in ``zerodp bench --compile``'s table: its median and quartiles of
    the timed steps, peak memory, the untimed first step, and the two ratios a reader asks for."""

    regime: str
    tokens_per_rank: int
    stage: int
    name: str
    label: str
    role: str  # "ours" or "peer"
    compiled: bool
    ms: float
    q1_ms: float | None  # quartiles of the timed steps (None under 2 steps)
    q3_ms: float | None
    peak_rss_bytes: int | None  # rank 0
    first_step_s: float | None  # the untimed build step: compilation for a compiled row
    timed_compiles: int | None  # graphs compiled during the timed steps (0: none fell in a timed step)
    vs_eager: float | None  # compiled rows: median / the same contender's eager median
    ours_vs_peer: float | None  # ours rows: median / the peer's of the same form (eager or compiled)


def compiled_rows(result: BenchResult) -> list[CompiledRow]:
    """Per regime and stage of a ``--compile`` bench: ours, ours compiled, the reference peer, the
    peer compiled (:func:`~zerodp.bench.contenders.compiled_peer`); empty without compiled rows."""
    rows = []
    for rr in result.regimes:
        cs = rr.contenders
        for stage in result.spec.stages:
            ours, peers = COMPARISONS[stage]
            peer = peers[0]
            four = [(ours, peer), (f"{ours}_compiled", compiled_peer(stage)),
                    (peer, None), (compiled_peer(stage), None)]
            if not all(n in cs for n in (ours, peer, f"{ours}_compiled", compiled_peer(stage))):
                continue
            eager = {f"{ours}_compiled": ours, compiled_peer(stage): peer}
            for name, against in four:
                c = cs[name]
                q = (statistics.quantiles(c.times_s, n=4, method="inclusive") if len(c.times_s) >= 2
                     else [None, None, None])
                rows.append(CompiledRow(
                    rr.regime.name, rr.regime.tokens, stage, name, c.label, c.role, name in eager,
                    c.median_s * 1e3, None if q[0] is None else q[0] * 1e3, None if q[2] is None else q[2] * 1e3,
                    c.peak_rss_bytes[0], c.first_step_s, c.timed_compiles,
                    c.median_s / cs[eager[name]].median_s if name in eager else None,
                    c.median_s / cs[against].median_s if against else None))
    return rows



@dataclass
class MuonRow:
    """``zerodp bench --optimizer muon``: one contender (the floor, ours at a stage, DDP + Muon) in
    one regime, with its step time's median and quartiles, peak memory, optimizer state and bytes
    sent per rank (rank 0), and the two ratios to DDP + Muon the issue asks about."""

    regime: str
    tokens_per_rank: int
    stage: int | None
    name: str
    label: str
    role: str
    ms: float
    q1_ms: float | None  # quartiles of the timed steps (None under 2 steps)
    q3_ms: float | None
    peak_rss_bytes: int | None
    optimizer_state_bytes: int | None
    sent_bytes: float | None  # per step, wchar growth
    state_less: float | None  # DDP + Muon's optimizer state / this one's (ours only)
    sent_vs_peer: float | None  # this one's bytes sent / DDP + Muon's (ours only)
    last_loss: float


def muon_rows(result: BenchResult) -> list[MuonRow]:
    """Per regime: the floor, ours at each stage, then DDP + Muon (empty unless ``--optimizer muon``)."""
    if result.spec.optimizer is not Optimizer.MUON:
        return []
    rows = []
    for rr in result.regimes:
        cs = rr.contenders
        peer = cs.get(MUON_PEER)
        p_state = peer.optimizer_state_bytes[0] if peer and peer.optimizer_state_bytes else None
        p_sent = peer.sent_bytes_per_step[0] if peer else None
        names = ["floor", *(result.spec.comparisons[s][0] for s in result.spec.stages), MUON_PEER]
        for name in (n for n in names if n in cs):
            c = cs[name]
            q = (statistics.quantiles(c.times_s, n=4, method="inclusive") if len(c.times_s) >= 2
                 else [None, None, None])
            state = c.optimizer_state_bytes[0] if c.optimizer_state_bytes else None
            sent = c.sent_bytes_per_step[0]
            ours = c.role == "ours"
            rows.append(MuonRow(
                rr.regime.name, rr.regime.tokens, c.stage, name, c.label, c.role, c.median_s * 1e3,
                None if q[0] is None else q[0] * 1e3, None if q[2] is None else q[2] * 1e3, c.peak_rss_bytes[0],
                state, sent, p_state / state if ours and p_state and state else None,
                sent / p_sent if ours and sent is not None and p_sent else None, c.last_loss))
    return rows


def muon_verdicts(result: BenchResult) -> list[str]:
    """One sentence per regime on issue 36's target for our stage 2 under ``--optimizer muon``:
    optimizer state per rank ≈ N× less than DDP + Muon's (at least :data:`MUON_STATE_SHARE` · N)
    and bytes sent ≤ :data:`MUON_SENT_TARGET` × its; "met" or "MISSED", from the measured figures."""
    n = result.spec.world_size
    out = []
    for r in muon_rows(result):
        if r.stage != 2 or r.role != "ours":
            continue
        state_ok = r.state_less is not None and r.state_less >= MUON_STATE_SHARE * n
        sent_ok = r.sent_vs_peer is not None and r.sent_vs_peer <= MUON_SENT_TARGET
        less = "n/a" if r.state_less is None else f"{r.state_less:.2f}×"
        sent = "n/a" if r.sent_vs_peer is None else f"{r.sent_vs_peer:.3f}×"
        out.append(f"{r.regime}: stage 2 holds {less} less optimizer state per rank than DDP + Muon "
                   f"(target ≈ {n}×: {'met' if state_ok else 'MISSED'}) and sends {sent} its bytes per step "
                   f"(target ≤ {MUON_SENT_TARGET}×: {'met' if sent_ok else 'MISSED'})")
    return out
