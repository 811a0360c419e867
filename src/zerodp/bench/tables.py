"""``zerodp bench``'s output: the tables it prints (every contender; ours against each peer; the
compressed and hybrid rows; the compiled rows), ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import json

from zerodp.bench.contenders import CONTENDERS, VARIANTS, Optimizer, compiled_peer, short_label
from zerodp.bench.probe import Malloc
from zerodp.bench.results import BenchResult, compiled_rows, compressed_rows, display_label, muon_rows, muon_verdicts
from zerodp.bench.spec import Device
from zerodp.plan._common import MIB


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / MIB:.1f}"


def _cell(v, fmt: str, width: int) -> str:
    """``v`` right-aligned in ``width`` columns as ``fmt`` says, or blanks where there is none."""
    return f"{'':>{width}}" if v is None else f"{v:>{width}{fmt}}"


def _mib_cell(v, width: int, fmt: str = ".2f") -> str:
    """Bytes as MiB (to two places unless ``fmt`` says otherwise) in ``width`` columns, or blanks."""
    return _cell(None if v is None else v / MIB, fmt, width)


def _peak(spec) -> str:
    """The peak-memory column: the GPU's under CUDA, else the process's resident set."""
    return "peak GPU MiB" if spec.device is Device.CUDA else "peak RSS MiB"


def _head(width: int) -> str:
    """The first columns of the per-row tables' header (muon, compressed, compiled)."""
    return f"{'regime':<8}{'tok/rank':>9}{'stage':>6}  {'contender':<{width}}{'median ms':>10}"


def _start(r, width: int) -> str:
    """The first columns of one of their rows: regime, tokens per rank, stage, label, median ms."""
    stage = "-" if r.stage is None else str(r.stage)
    return f"{r.regime:<8}{r.tokens_per_rank:>9}{stage:>6}  {r.label:<{width}}{r.ms:>10.1f}"


def _timed(rows, least_width: int, peak: str, head: str, cells) -> list[str]:
    """The header and rows of a table whose median is followed by its quartiles and the peak memory
    (muon, compiled): ``head`` the further columns' header, ``cells(r)`` a row's further cells."""
    width = max(least_width, *(len(r.label) + 1 for r in rows))
    return [f"{_head(width)}{'IQR ms':>16}{peak:>13}{head}"] + [
        f"{_start(r, width)}{'' if r.q1_ms is None else f'{r.q1_ms:.1f}-{r.q3_ms:.1f}':>16}"
        f"{_mib(r.peak_rss_bytes):>13}{cells(r)}" for r in rows]


def _memory_words(spec) -> str:
    """How the peak memory was read (``--memory``)."""
    return (f"built and stepped {spec.memory_steps} times alone in a fresh group" if spec.memory.value == "fresh"
            else "over the build and first step, in the timing group")


def contenders_table(result: BenchResult) -> str:
    """Every contender of every regime: median, overhead, memory, bytes, prediction."""
    spec = result.spec
    ranks = "NCCL ranks (one GPU each)" if spec.device is Device.CUDA else "gloo ranks × 1 thread"
    lines = [f"model {spec.model} ({result.params / 1e6:.2f}M params, fp32, {optimizer_words(spec.optimizer)}), "
             f"{spec.world_size} {ranks}, "
             f"{spec.warmup} warm-up steps, then turns of {spec.turn} steps alternated, the first untimed; "
             "times: median of the per-step max over ranks; memory, states, sent: rank 0"
             + ("; peak RSS with glibc's mmap threshold fixed at 128 KiB (--malloc mmap)"
                if spec.malloc is Malloc.MMAP else "")]
    peak = _peak(spec)
    width = max([38] + [len(display_label(c)) + 1 for rr in result.regimes for c in rr.contenders.values()])
    head = (f"{'stage':>5}  {'contender':<{width}}{'median ms':>10}{'/floor':>8}{peak:>13}"
            f"{'states MiB':>11}{'sent MiB/step':>14}{'trace MiB/step':>15}")
    if spec.profile:
        head += f"{'predicted ms':>13}{'error':>8}"
    for rr in result.regimes:
        r = rr.regime
        lines += ["", f"[{r.name}] {r.tokens} tokens per rank ({r.micro_batch} × {r.seq_len}), "
                      f"{spec.steps_for(r)} timed steps, {rr.wall_s:.0f} s", head]
        floor = rr.contenders.get("floor")
        for c in rr.contenders.values():
            stage = "-" if c.stage is None else str(c.stage)
            label = display_label(c)
            over = f"{c.median_s / floor.median_s:.2f}" if floor else "n/a"
            trace = "" if c.wire_bytes is None else _mib(c.wire_total)
            line = (f"{stage:>5}  {label:<{width}}{c.median_s * 1e3:>10.1f}{over:>8}{_mib(c.peak_rss_bytes[0]):>13}"
                    f"{_mib(c.model_state_bytes[0]):>11}{_mib(c.sent_bytes_per_step[0]):>14}{trace:>15}")
            if spec.profile:
                if c.predicted_s is None:
                    line += f"{'':>13}{'':>8}"
                else:
                    err = (c.predicted_s - c.median_s) / c.median_s
                    line += f"{c.predicted_s * 1e3:>13.1f}{err * 100:>+7.0f}%"
            lines.append(line)
    return "\n".join(lines)



def optimizer_words(optimizer: Optimizer) -> str:
    return "AdamW" if optimizer is Optimizer.ADAMW else "Muon on the blocks' matrices + AdamW on the rest"


def muon_table(result: BenchResult) -> str:
    """``zerodp bench --optimizer muon``: per regime the floor, ours at each stage and DDP + Muon:
    median and IQR of the step, peak memory, optimizer state and bytes sent per rank, the ratios to
    DDP + Muon, the last step's loss; then issue 36's stage-2 targets, met or missed ("" otherwise)."""
    rows = muon_rows(result)
    if not rows:
        return ""
    spec = result.spec
    peak = _peak(spec)
    lines = _timed(rows, 38, peak, f"{'opt-state MiB':>14}{'DDP/ours':>9}{'sent MiB/step':>14}{'ours/DDP':>9}"
                                   f"{'last loss':>11}",
                   lambda r: (f"{_mib_cell(r.optimizer_state_bytes, 14, '.3f')}{_cell(r.state_less, '.2f', 9)}"
                              f"{_mib_cell(r.sent_bytes, 14)}{_cell(r.sent_vs_peer, '.3f', 9)}{r.last_loss:>11.6f}"))
    memory = _memory_words(spec)
    lines.append(f"Muon (lr 0.02) on the transformer blocks' 2-D weights, AdamW (lr 3e-4) on the rest, every row; "
                 f"median and IQR (quartiles) of the timed steps, each the max over ranks; {peak} on rank 0, {memory}; "
                 "opt-state: rank 0's optimizer state (every tensor in it, step counters included), counted after "
                 "the second step's backward; DDP/ours: DDP + Muon's opt-state / this row's; sent: rank 0's wchar "
                 "growth per step (median); ours/DDP: this row's sent / DDP + Muon's; last loss: rank 0's loss of the "
                 "last step each ran, the same batches after the same number of updates")
    lines += muon_verdicts(result)
    return "\n".join(lines)


def compressed_table(result: BenchResult) -> str:
    """The compressed and hybrid rows: ms, ×floor, ×ours, MiB per leg, ×fp32 bytes, predicted."""
    rows = compressed_rows(result)
    if not rows:
        return ""
    lines = [f"{_head(40)}{'×floor':>8}"
             f"{'×ours':>7}{'peak RSS MiB':>13}{'intra MiB':>10}{'inter MiB':>10}{'×fp32 bytes':>12}"
             f"{'planner ×':>10}{'predicted ms':>13}{'error':>7}"]
    for r in rows:
        lines.append(f"{_start(r, 40)}{_cell(r.over_floor, '.2f', 8)}{r.vs_plain:>7.2f}"
                     f"{_mib(r.peak_rss_bytes):>13}{_mib_cell(r.wire_intra, 10)}{_mib_cell(r.wire_inter, 10)}"
                     f"{_cell(r.bytes_vs_plain, '.3f', 12)}{_cell(r.planner_vs_plain, '.3f', 10)}"
                     f"{_cell(r.predicted_ms, '.1f', 13)}"
                     f"{'' if r.predicted_error is None else f'{r.predicted_error * 100:+.0f}%':>7}")
    lines.append("×ours: median / zerodp's uncompressed flat row of the same stage; ×fp32 bytes: traced bytes "
                 "sent per rank per step / that row's; planner ×: the same ratio from zerodp.plan.hybrid")
    return "\n".join(lines)


def compiled_table(result: BenchResult) -> str:
    """``zerodp bench --compile``: per regime and stage, ours and its reference peer, eager and
    compiled: median ms and quartiles, peak memory, the untimed first step, compiled/eager, ours/peer."""
    rows = compiled_rows(result)
    if not rows:
        return ""
    spec = result.spec
    peak = _peak(spec)
    lines = _timed(rows, 40, peak, f"{'first step s':>13}{'timed compiles':>15}{'compiled/eager':>15}{'ours/peer':>10}",
                   lambda r: (f"{_cell(r.first_step_s, '.1f', 13)}"
                              f"{_cell(r.timed_compiles if r.compiled else None, 'd', 15)}"
                              f"{_cell(r.vs_eager, '.3f', 15)}{_cell(r.ours_vs_peer, '.3f', 10)}"))
    memory = _memory_words(spec)
    lines.append(f"median and IQR (quartiles) of the timed steps, each the max over ranks; warm-up excluded: the "
                 f"first step (where a compiled model compiles; 'first step s', max over ranks), {spec.warmup - 1} "
                 f"more warm-up round(s) and the first step of every turn of {spec.turn} are not timed; timed "
                 "compiles: graphs dynamo compiled during timed steps (0: no compilation was timed); dynamo's "
                 "cache is per process, so a compiled contender built after another with the same graphs (the "
                 "peer after ours at stage 0) reuses them and its first step is short; "
                 f"{peak} on rank 0, {memory}; compiled/eager: median / the same contender's eager median; "
                 "ours/peer: zerodp's median / the peer's of the same form (eager vs eager, compiled vs compiled)")
    return "\n".join(lines)


def summary_table(result: BenchResult) -> str:
    """ours/peer per stage and regime, with the issue's targets where they apply."""
    lines = [f"{'regime':<8}{'tok/rank':>9}{'stage':>6}  {'ours vs peer':<60}{'ours ms':>9}{'peer ms':>9}"
             f"{'ours/peer':>10}{'per-step IQR':>14}{'target':>8}"]
    for row in result.rows():
        o, p = CONTENDERS[row.ours][2], CONTENDERS[row.peer][2]
        target = row.target
        verdict = "" if target is None else ("ok" if row.ratio <= target else "MISSED")
        iqr = "" if row.paired_q1 is None else f"{row.paired_q1:.2f}-{row.paired_q3:.2f}"
        lines.append(f"{row.regime:<8}{row.tokens_per_rank:>9}{row.stage:>6}  {o + ' vs ' + p:<60}"
                     f"{row.ours_ms:>9.1f}{row.peer_ms:>9.1f}{row.ratio:>10.3f}{iqr:>14}"
                     f"{'' if target is None else f'≤{target:.2f}':>8} {verdict}")
    lines.append("per-step IQR: quartiles of ours/peer taken step by step (both ran in the same round): "
                 "the spread of the ratio")
    return "\n".join(lines)


def write_json(result: BenchResult, path: str) -> str:
    with open(path, "w") as f:
        json.dump(result.to_dict(), f, indent=2)
    return path


def plot(result: BenchResult, path: str) -> str:
    """Bars of step time / floor per stage, ours next to its peers, one panel per regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(result.regimes)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.8), squeeze=False)
    colors = {"ours": "#1f77b4", "peer": "#ff7f0e"}
    for ax, rr in zip(axes[0], result.regimes):
        floor = rr.contenders["floor"].median_s
        x = 0.0
        ticks, tick_labels = [], []
        for stage in result.spec.stages:
            ours, peers = result.spec.comparisons[stage]
            group = [ours, *peers] + (["ours0_auto"] if stage == 0 and "ours0_auto" in rr.contenders else [])
            group += [n for n in result.spec.variants(stage) if n in rr.contenders]
            group += [n for n in (compiled_peer(stage),) if n in rr.contenders]
            for name in group:
                c = rr.contenders[name]
                h = c.median_s / floor
                ax.bar(x, h, width=0.8, color=colors[c.role], alpha=0.55 if name == "ours0_auto" else 1.0,
                       edgecolor="black", linewidth=0.4, hatch="//" if name in VARIANTS else None)
                ax.text(x, h, f"{c.median_s * 1e3:.0f}", ha="center", va="bottom", fontsize=7)
                ticks.append(x)
                tick_labels.append(f"{stage}: {short_label(name)}")
                x += 1
            x += 0.6
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(ticks, tick_labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("median step time / no-communication floor")
        ax.set_title(f"{rr.regime.name}-bound: {rr.regime.tokens} tokens/rank, floor {floor * 1e3:.0f} ms "
                     "(bar labels: ms)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in ("ours", "peer")]
    fig.legend(handles, ["zerodp", "PyTorch"], loc="upper right")
    fig.suptitle(f"zerodp vs PyTorch, model {result.spec.model}, {result.spec.world_size} ranks "
                 f"({result.machine.get('cores')} cores, torch {result.machine.get('torch')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


