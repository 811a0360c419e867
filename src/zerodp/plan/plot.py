"""Timeline lanes (compute / communication) and the bucket-size sweep curve (guide §4).

matplotlib is imported inside the function, with the Agg backend, so ``zerodp.plan`` stays fast
and display-free.
"""

from __future__ import annotations

import os

from zerodp.plan.timeline import BackwardTimeline, BucketSweep, FsdpTimeline

_COMPUTE = ("#4C72B0", "#8FAADC")  # backward compute, alternate layers (units) in two blues
_COMM = ("#DD8452", "#F2B98F")  # bucket collectives, alternate buckets in two oranges
_KIND_COLORS = {"all_gather": "#8172B3", "reduce_scatter": "#C44E52"}
_MS = 1e3


def plot_timeline(timeline: BackwardTimeline | FsdpTimeline, path: str,
                  sweep: BucketSweep | None = None, title: str = "") -> str:
    """Draw ``timeline`` (and ``sweep`` below it, if given) into ``path`` (PNG); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path!r}: directory {directory!r} does not exist")
    rows = 2 if sweep is not None else 1
    fig, axes = plt.subplots(rows, 1, figsize=(11, 3.2 * rows), squeeze=False)
    ax = axes[0][0]
    for i, span in enumerate(timeline.compute):
        color = "#55A868" if span.phase == "forward" else _COMPUTE[i % 2]
        ax.broken_barh([(span.start_s * _MS, (span.end_s - span.start_s) * _MS)], (10, 8),
                       facecolors=color, edgecolors="none")
    if isinstance(timeline, BackwardTimeline):
        bars = [(r.start_s, r.end_s, _COMM[i % 2]) for i, r in enumerate(timeline.runs)]
        end = timeline.backward_s
        label = (f"{timeline.num_buckets:,} buckets of {timeline.bucket_bytes / 1e6:g} MB, "
                 f"exposed {timeline.exposed_comm_s * _MS:.1f} ms")
    else:
        bars = [(op.start_s, op.end_s, _KIND_COLORS[op.kind]) for op in timeline.comm]
        end = timeline.compute[-1].end_s
        label = (f"FSDP: {timeline.num_allgathers} AllGathers, {timeline.num_reduce_scatters} "
                 f"ReduceScatters, exposed {timeline.exposed_comm_s * _MS:.1f} ms")
    for s, e, color in bars:
        ax.broken_barh([(s * _MS, (e - s) * _MS)], (0, 8), facecolors=color, edgecolors="none")
    from matplotlib.patches import Patch

    if isinstance(timeline, FsdpTimeline):
        handles = ([Patch(color=c, label=k) for k, c in _KIND_COLORS.items()]
                   + [Patch(color="#55A868", label="forward compute"),
                      Patch(color=_COMPUTE[0], label="backward compute (units alternate dark/light)")])
    else:
        handles = [Patch(color=_COMPUTE[0], label="backward compute (layers alternate dark/light)"),
                   Patch(color=_COMM[0], label="bucket's collective (buckets alternate dark/light)")]
    handles.append(plt.Line2D([], [], color="k", linestyle="--", linewidth=1,
                              label="end of compute"))
    ax.legend(handles=handles, fontsize=8, ncol=len(handles), loc="upper center",
              bbox_to_anchor=(0.5, -0.28))
    ax.axvline(end * _MS, color="k", linestyle="--", linewidth=1)
    ax.set_yticks([4, 14], ["communication", "compute"])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or label, fontsize=10)
    if sweep is not None:
        ax2 = axes[1][0]
        x = [p.bucket_bytes for p in sweep.points]
        ax2.plot(x, [p.exposed_comm_s * _MS for p in sweep.points], marker="o", label="exposed comm")
        ax2.plot(x, [p.step_s * _MS for p in sweep.points], marker=".", label="step")
        ax2.axhline(sweep.backward_s * _MS, color="gray", linestyle=":", label="backward compute")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.set_xlabel("bucket size (bytes)")
        ax2.set_ylabel("ms")
        ax2.legend(fontsize=8)
        ax2.set_title(f"bucket-size sweep: least exposed at {sweep.best_bucket_bytes / 1e6:.3g} MB",
                      fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
