"""Tables for the report from the engine's measurements (``engine.stats()`` of every rank).

The engine measures the bytes each rank holds by kind and the collectives of the last completed
step; this module only arranges them (per rank, per collective kind) and, for bf16 runs, sets
the seed's ledger beside them (seed §9: DP (4+k)Ψ, ZeRO-1 4Ψ + kΨ/N, ZeRO-2 2Ψ + (2+k)Ψ/N).
"""

from __future__ import annotations

MiB = 1024 * 1024
KINDS = ("params", "grads", "master", "optimizer_states", "gathered", "comm_buffers")


def _table(headers, rows):
    from zerodp.train.report import table

    return table(headers, rows)


def _formula(stats: dict) -> dict | None:
    """The planner's model-state bytes per kind (bf16 + Adam only, the seed's setting)."""
    if stats.get("param_dtype") != "bfloat16":
        return None
    try:
        from zerodp.engine.stats import formula_by_kind
    except ImportError:
        return None
    if stats["stage"] not in (0, 1, 2, 3):
        return None
    return formula_by_kind(stats["stage"], stats["num_params"], stats["world_size"], False)


def memory_rows(stats: list[dict]) -> str:
    """Measured MiB per rank by kind (+ bytes per parameter on rank 0, + the seed's formula)."""
    kinds = [k for k in KINDS if any(s["memory"].get(k, 0) for s in stats)] or list(KINDS[:4])
    n = stats[0]["num_params"]
    formula = _formula(stats[0])
    headers = ["kind"] + [f"rank {s['rank']}" for s in stats] + ["B/param (rank 0)"]
    if formula:
        headers.append("seed §9 formula")
    rows = []
    for k in kinds + ["total"]:
        vals = [sum(s["memory"].values()) if k == "total" else s["memory"].get(k, 0) for s in stats]
        row = [k] + [v / MiB for v in vals] + [vals[0] / n]
        if formula:
            f = formula.get(k)
            row.append("" if f is None else f / MiB)
        rows.append(row)
    return _table(headers, rows)


def comm_rows(stats: list[dict]) -> str:
    """Rank 0's collectives in the last step: count, bytes V, bytes sent, time, host wait."""
    s = stats[0]
    colls = s.get("collectives") or {}
    if not colls:
        return "(no collectives recorded in the last step)"
    rows = []
    for c in colls.values():
        rows.append([c["kind"], c["count"], human_bytes(c["bytes"]), human_bytes(c["sent_bytes"]),
                     c["seconds"] * 1e3, c["wait_s"] * 1e3])
    return _table(["collective", "count", "buffers V (sum)", "sent per rank (ring)",
                   "issue-to-end (ms)", "exposed wait (ms)"], rows)


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def exposed_fraction(stats: list[dict], step_s: float) -> float | None:
    """Rank 0's exposed communication in the last step, over that step's time."""
    exposed = stats[0].get("exposed_comm_s")
    if exposed is None or not step_s or step_s != step_s:
        return None
    return exposed / step_s
