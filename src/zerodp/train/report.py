"""The end-of-run report: what the guide teaches, measured on this run.

- the loss curve (``loss.png``): training loss per step, validation loss at each evaluation;
- memory per rank by kind — parameters, gradients, optimizer states — as the engine measured it
  (guide §8–§9: which of them ZeRO shards at this stage);
- bytes per collective and how many per step (guide §2.4, §9: AllReduce for DP, ReduceScatter +
  AllGather for ZeRO);
- exposed communication as a fraction of step time — the part overlap did not hide (guide §3–§4);
- achieved FLOP/s, from 6 FLOPs per weight per token plus attention (guide §7.4's ``4·tokens·Ψ``
  counts the forward and backward matmuls the same way, 2 + 4 with the weight gradients).

Everything also goes to ``report.json`` (machine-readable) and ``report.md`` (the printed text).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, is_dataclass
from pathlib import Path

from zerodp.plan._common import MIB, fmt_mib
from zerodp.train.progress import METRICS_FILE, read_metrics



def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table; numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if j and _numeric(rows[j - 1][i]) else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fmt(x) -> str:
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 1:
            return f"{x:.2f}"
        return f"{x:.3g}"
    return str(x)


def si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def plot_loss(records: list[dict], path: Path) -> Path | None:
    """Loss against step (left) and step time against step (right), into one PNG.

    A ``step`` record N holds the loss of the batch the N-th update was computed from, i.e. of
    the parameters after N-1 updates; it is drawn at N-1, where the validation loss of the same
    parameters is drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("event") == "step" and isinstance(r.get("loss"), (int, float))]
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("event") == "eval"
             and isinstance(r.get("val_loss"), (int, float))]
    if not steps and not evals:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    if steps:
        ax.plot([r["step"] - 1 for r in steps], [r["loss"] for r in steps], lw=1.2,
                label="training loss (global batch)")
    if evals:
        ax.plot(*zip(*evals), "o-", lw=1.5, ms=4, label="validation loss")
    ax.set_xlabel("optimizer updates done")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if steps:
        ax2.plot([r["step"] for r in steps], [r["step_s"] * 1e3 for r in steps], lw=1.0, color="tab:green")
        ax2.set_xlabel("step")
        ax2.set_ylabel("step time (ms)")
        ax2.set_title("step time (without eval and checkpoints)", fontsize=10)
        ax2.set_ylim(bottom=0)
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plain(x):
    if is_dataclass(x):
        return asdict(x)
    return x


def write_report(summary: dict) -> Path:
    """Write loss.png, report.md and report.json into the run directory; print the report."""

    out = Path(summary["out"])
    records = read_metrics(out / METRICS_FILE)
    png = plot_loss(records, out / "loss.png")
    evals = [r["val_loss"] for r in records if r.get("event") == "eval"]
    times = summary["step_times"]
    warm = times[1:] if len(times) > 1 else times
    step_s = statistics.median(warm) if warm else float("nan")
    tokens_per_s = summary["step_tokens"] / step_s if warm else float("nan")
    flops = summary["flops_per_token"] * tokens_per_s
    world = summary["world"]

    parts = [f"# zerodp training report: {out}", ""]
    parts.append(table(["", "value"], [
        ["model parameters", f"{summary['params'] / 1e6:.2f} M"],
        ["ranks x stage", f"{world} x stage {summary['stage']}"
         + (f" ({summary['mixed_precision']})" if summary.get("mixed_precision") else " (fp32)")],
        ["global batch", f"{summary['global_batch']} seq = {summary['step_tokens']:,} tokens "
                         f"(grad_acc {summary['grad_acc']})"],
        ["steps this run", f"{summary['start']} -> {summary['steps']}"],
        ["median step time", f"{step_s * 1e3:.1f} ms"],
        ["throughput", f"{tokens_per_s:,.0f} tokens/s ({tokens_per_s / world:,.0f} per rank)"],
        ["achieved compute", f"{si(flops, 'FLOP/s')} ({si(flops / world, 'FLOP/s')} per rank)"],
        ["wall time of the loop", f"{summary['wall_s']:.1f} s"],
        ["steps skipped (inf/NaN gradients)", f"{summary.get('skipped_steps', 0)}"],
    ]))
    if evals:
        drop = 1 - evals[-1] / evals[0]
        parts += ["", f"validation loss: {evals[0]:.3f} -> {evals[-1]:.3f} nats/token "
                      f"({drop:+.0%} change)" if drop < 0 else
                  f"validation loss: {evals[0]:.3f} -> {evals[-1]:.3f} nats/token ({drop:.0%} lower)"]
    stats = [_plain(s) for s in summary.get("stats") or []]
    frac = None
    if stats and stats[0] is not None:
        parts += ["", "## memory per rank, measured (MiB)", "", memory_rows(stats)]
        parts += ["", "## communication per step (rank 0)", "", comm_rows(stats)]
        last = times[-1] if times else step_s
        frac = exposed_fraction(stats, last)
        if frac is not None:
            parts += ["", f"exposed communication: {frac:.1%} of the last step's {last * 1e3:.0f} ms "
                          "(the host waited for collectives that overlap did not hide; guide §3-4)"]
    files = [("metrics", out / METRICS_FILE), ("loss curve", png), ("report", out / "report.md")]
    if summary.get("checkpoint"):
        files.append(("checkpoint", summary["checkpoint"]))
    if summary.get("trace"):
        files.append(("trace (open in ui.perfetto.dev)", summary["trace"]))
    parts += ["", "## outputs", ""] + [f"- {k}: {v}" for k, v in files if v]
    text = "\n".join(parts) + "\n"
    (out / "report.md").write_text(text)
    data = dict(summary, stats=stats, median_step_s=step_s, tokens_per_s=tokens_per_s,
                flops_per_s=flops, val_losses=evals, exposed_fraction=frac)
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    print("\n" + text, flush=True)
    return out / "report.md"


# ---- tables from the engine's measurements (engine.stats() of every rank) --------------------
KINDS = ("params", "grads", "master", "optimizer_states", "gathered", "comm_buffers")


def _formula(stats: dict) -> dict | None:
    """The planner's model-state bytes per kind (bf16 + Adam only, the guide's setting)."""
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
    """Measured MiB per rank by kind (+ bytes per parameter on rank 0, + the guide's formula)."""
    kinds = [k for k in KINDS if any(s["memory"].get(k, 0) for s in stats)] or list(KINDS[:4])
    n = stats[0]["num_params"]
    formula = _formula(stats[0])
    headers = ["kind"] + [f"rank {s['rank']}" for s in stats] + ["B/param (rank 0)"]
    if formula:
        headers.append("guide §9 formula")
    rows = []
    for k in kinds + ["total"]:
        vals = [sum(s["memory"].values()) if k == "total" else s["memory"].get(k, 0) for s in stats]
        row = [k] + [v / MIB for v in vals] + [vals[0] / n]
        if formula:
            f = formula.get(k)
            row.append("" if f is None else f / MIB)
        rows.append(row)
    return table(headers, rows)


def comm_rows(stats: list[dict]) -> str:
    """Rank 0's collectives in the last step: count, bytes V, bytes sent, time, host wait."""
    s = stats[0]
    colls = s.get("collectives") or {}
    if not colls:
        return "(no collectives recorded in the last step)"
    rows = []
    for c in colls.values():
        rows.append([c["kind"], c["count"], fmt_mib(c["bytes"]), fmt_mib(c["sent_bytes"]),
                     c["seconds"] * 1e3, c["wait_s"] * 1e3])
    return table(["collective", "count", "buffers V (sum)", "sent per rank (ring)",
                   "issue-to-end (ms)", "exposed wait (ms)"], rows)




def exposed_fraction(stats: list[dict], step_s: float) -> float | None:
    """Rank 0's exposed communication in the last step, over that step's time."""
    exposed = stats[0].get("exposed_comm_s")
    if exposed is None or not step_s or step_s != step_s:
        return None
    return exposed / step_s
