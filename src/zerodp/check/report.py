"""The table of ``zerodp check``: per row, the differences against their tolerances, PASS/FAIL,
and the engine's measured memory and bytes against the planner's (guide §8, §9, §13).

Torch-free: it reads the rows the ranks returned (plain dicts) and asks :mod:`zerodp.plan.memory`
what the guide's ledger says.

- **Model states** (guide §9): the engine's measured bytes of parameters, gradients, fp32 master
  and optimizer states on its most loaded rank (``engine.stats().memory``) against
  :func:`zerodp.plan.memory.model_states` for the row's stage, world size and dtypes, with k = 4
  (the fp32 master, under bf16 only: an fp32 engine steps its parameters in place) + the
  optimizer's state bytes per parameter priced per tensor by
  :func:`zerodp.plan.ownership.state_numel`. The band: the planner counts Ψ/N per rank; the
  engine pads each flat buffer to a multiple of N and, on the ownership path, a rank may own
  more than Ψ/N (both reported by ``engine.stats().layout``), so the row agrees when the
  difference is within that padding and imbalance plus 1 %.
- **Peak**: the most each rank held at once — ``torch.cuda.max_memory_allocated`` on CUDA; on
  CPU the process's peak resident set, which also counts PyTorch itself and, on rank 0, the
  reference: no planner figure covers it, and the row says so.
- **Bytes sent per step** (guide §9: 2Ψ elements for stages 0-2, 3Ψ for stage 3, each rank
  sending (N−1)/N of them over a ring): the engine's trace (``sent_bytes`` of the step's
  collectives, rank 0) against the planner's, counting the collectives the row's usage runs —
  a micro-batch under ``no_sync`` reduces nothing at stages 0-1, still reduce-scatters its
  gradients at stage 2 (``reduce_every_microbatch``) and gathers the parameters again (forward
  and backward) at stage 3; plus the check's own fp32 AllGathers at stages 1-3, which a training
  step does not make: the averaged gradients (``engine.full_grad_dict()``) and, after the step
  before, the parameters (``engine.full_state_dict()``); plus, at stage 3 under a per-tensor
  optimizer, the owner exchange's even share, 3Ψ_m/N fp32 elements for the Ψ_m elements it
  steps whole (guide §12.3).
  The band: padding, plus the clip norm's and the buffers' small collectives, plus how far this
  rank's exchange is from the even share (``engine.stats().layout``), plus 5 %. The model-state
  band also takes the exchange's whole-tensor state above the mean (the owners').
"""

from __future__ import annotations

import json

#: bytes of one element of the compute dtype
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
MEMORY_BAND = 0.01
SENT_BAND = 0.05


def planned_states(row: dict) -> float | None:
    """The planner's model-state bytes per rank for ``row`` (None: an optimizer it does not price)."""
    from zerodp.plan.memory import model_states

    state_numel = row.get("planned_state_numel")
    first = row["ranks"][0] if row.get("ranks") else None
    if state_numel is None or first is None:
        return None
    psi = first["num_params"]
    elem = DTYPE_BYTES[row["precision"]]
    # an fp32 engine steps its parameters (or, at stage 3, their shards) in place: no master copy
    k = (4.0 if row["precision"] == "bf16" else 0.0) + 4.0 * state_numel / psi
    m = model_states(psi, row["world"], row["stage"], k=k, param_bytes=elem, grad_bytes=elem)
    return m.model_state_bytes


def planned_sent(row: dict) -> float | None:
    """The planner's bytes sent per rank in one step of ``row`` (module docstring)."""
    from zerodp.plan.memory import model_states

    first = row["ranks"][0] if row.get("ranks") else None
    if first is None:
        return None
    n, stage, psi = row["world"], row["stage"], first["num_params"]
    if n == 1:
        return 0.0
    elem = DTYPE_BYTES[row["precision"]]
    per_step = model_states(psi, n, stage).comm_elements_per_step  # one micro-batch
    extra_micro = row["micro_batches"] - 1
    if stage == 2:
        per_step += extra_micro * psi  # each micro-batch's ReduceScatter
    elif stage == 3:
        per_step += extra_micro * 3 * psi  # gathers in forward and backward, and a ReduceScatter
    own = row.get("own_gathers", 0) * 4 * psi if stage >= 1 else 0  # the check's own fp32 gathers
    own += 3 * 4 * row.get("planned_exchange_numel", 0) / n  # stage 3's owner exchange, fp32, an even share
    return (per_step * elem + own) * (n - 1) / n


def verdicts(row: dict) -> dict:
    """The row's memory and bytes figures, planned vs measured, and whether each agrees."""
    ranks = row.get("ranks") or []
    out: dict = {"states_measured": max((r["model_state_bytes"] for r in ranks), default=None),
                 "states_planned": planned_states(row),
                 "sent_measured": ranks[0]["sent_bytes"] if ranks else None,
                 "sent_planned": planned_sent(row),
                 "peak": [r["peak_bytes"] for r in ranks],
                 "peak_kind": ranks[0]["peak_kind"] if ranks else None, "notes": []}
    notes = out["notes"]
    if out["states_planned"] is None:
        notes.append("memory: the planner prices sgd, adam(w), muon, adafactor only")
        out["states_ok"] = None
    else:
        elem = DTYPE_BYTES[row["precision"]]
        pad = max((r.get("padding", 0) for r in ranks), default=0)
        slack = pad * (2 * elem + 4 + 8) + max((r.get("imbalance_bytes", 0) for r in ranks), default=0) * 3 \
            + max((r.get("state_imbalance_bytes", 0) for r in ranks), default=0)
        gap = abs(out["states_measured"] - out["states_planned"])
        out["states_ok"] = gap <= slack + MEMORY_BAND * out["states_planned"]
        if not out["states_ok"] and row.get("stateless_numel"):
            notes.append(f"memory: {row['stateless_numel']:,} parameters no rank used have no optimizer state, "
                         "which the planner counts")
        elif not out["states_ok"]:
            notes.append(f"memory: measured {fmt_mib(out['states_measured'])} vs planned "
                         f"{fmt_mib(out['states_planned'])} MiB, outside padding + imbalance + 1 %")
    if out["sent_planned"] is None or out["sent_measured"] is None:
        out["sent_ok"] = None
    else:
        elem = DTYPE_BYTES[row["precision"]]
        pad = max((r.get("padding", 0) for r in ranks), default=0) * elem * 4 * row["micro_batches"]
        gap = abs(out["sent_measured"] - out["sent_planned"])
        pad += ranks[0].get("exchange_imbalance_bytes", 0)
        out["sent_ok"] = gap <= pad + 4096 + SENT_BAND * out["sent_planned"]
        if not out["sent_ok"] and row["stage"] == 3 and out["sent_measured"] < out["sent_planned"]:
            notes.append("bytes: fewer than 3Ψ per micro-batch: what no unit holds is the root unit, gathered once "
                         "for forward and backward (guide §10.3)")
        elif not out["sent_ok"]:
            notes.append(f"bytes: measured {fmt_mib(out['sent_measured'])} vs planned "
                         f"{fmt_mib(out['sent_planned'])} MiB per step")
    if out["peak_kind"] == "rss":
        notes.append("peak: process RSS (torch itself; rank 0 also holds the reference)")
    return out


def fmt_mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.2f}"


def _ratio(d: dict) -> str:
    return f"{d['diff']:.1e}/{d['allowed']:.1e}"


def table(rows: list[dict]) -> str:
    """The human table (module docstring)."""
    head = ["stage", "world", "reshard", "grad Δ/tol", "param Δ/tol", "optim Δ/tol", "result",
            "states MiB meas/plan", "peak MiB/rank", "sent MiB/step meas/plan", "notes"]
    body = []
    for row in rows:
        v = verdicts(row)
        rs = row.get("reshard")
        mem = f"{fmt_mib(v['states_measured'])}/{fmt_mib(v['states_planned'])}"
        mem += "" if v["states_ok"] in (None, True) else " !"
        sent = f"{fmt_mib(v['sent_measured'])}/{fmt_mib(v['sent_planned'])}"
        sent += "" if v["sent_ok"] in (None, True) else " !"
        body.append([str(row["stage"]), str(row["world"]), f"->{rs[0]}@{rs[1]}" if rs else "-",
                     _ratio(row["grad"]), _ratio(row["param"]), _ratio(row["optimizer_state"]),
                     "PASS" if row["ok"] else "FAIL", mem, ",".join(f"{p / 2**20:.0f}" for p in v["peak"]),
                     sent, "; ".join(v["notes"])])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths[:-1]) + "  -----"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        worst = max(("grad", "param", "optimizer_state"), key=lambda k: r[k]["ratio"])
        lines.append(f"FAIL stage {r['stage']} world {r['world']}: {worst} {r[worst]['where']} off by "
                     f"{r[worst]['diff']:.3e} > allowed {r[worst]['allowed']:.3e}")
    return "\n".join(lines)


def to_json(rows: list[dict], header: dict) -> str:
    return json.dumps({**header, "ok": all(r["ok"] for r in rows),
                       "rows": [{**r, **verdicts(r)} for r in rows]}, indent=2, default=str)
