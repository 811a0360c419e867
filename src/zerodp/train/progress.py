"""What rank 0 shows and records while training: progress, a JSONL metrics log, TensorBoard events.

Progress is a tqdm bar on a terminal. Anywhere else — a pipe, a CI log, a SLURM output file, a
pseudo-terminal that relays the ranks' output without a window size — a bar's carriage returns
are lost or pile up, so rank 0 prints one line instead after every step that is a multiple of
``every_steps``, after ``every_s`` seconds without one, and after the first and the last step::

    step 12/60 (20%) | loss 4.321 | val 4.102 @step 10 | 18,249 tok/s | 449 ms/step | elapsed 0:00:05 | ETA 0:00:21

The validation loss is the latest one; when it was measured at an earlier step than the one shown,
that step follows it (``@step 10``), so an old figure does not read as the current one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Append-only JSON lines, one record per event (``{"event": "step"|"eval"|…, …}``).

    Every line is flushed as written, so a crash loses at most the line being written; a resumed
    run appends after a ``resume`` record, and readers keep the last record of each step. When the
    run's config (in its ``start``/``resume`` record) asks for ``tensorboard``, the step and eval
    records also go to TensorBoard events in ``TENSORBOARD_DIR`` next to the log.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")
        self._tb = None

    def write(self, event: str, **fields) -> None:
        rec = {"event": event, "time": round(time.time(), 3), **fields}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()
        if event in ("start", "resume") and self._tb is None and (fields.get("config") or {}).get("tensorboard"):
            self._tb = open_tensorboard(self.path.parent / TENSORBOARD_DIR)
        if self._tb is not None:
            self._tb.write(event, fields)

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


#: TensorBoard tag -> the field of a step record it plots
TB_SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
              "perf/tokens_per_s": "tokens_per_s", "perf/step_s": "step_s", "perf/flops_per_s": "flops_per_s"}


class TensorBoardLog:
    """The metrics log's step and eval records as TensorBoard scalars (torch's SummaryWriter)."""

    def __init__(self, writer):
        self.writer = writer

    def write(self, event: str, fields: dict) -> None:
        step = fields.get("step")
        if event == "step":
            for tag, key in TB_SCALARS.items():
                if isinstance(fields.get(key), (int, float)):
                    self.writer.add_scalar(tag, fields[key], step)
        elif event == "eval" and fields.get("val_loss") is not None:
            self.writer.add_scalar("val/loss", fields["val_loss"], step)
        elif event in ("end", "stop"):
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(directory: Path) -> TensorBoardLog | None:
    """A TensorBoard log in ``directory``; None, after one line on stderr, when the package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("zerodp: --tensorboard: the tensorboard package is not installed (pip install "
              "'zerodp[tensorboard]'); the metrics go to metrics.jsonl only", file=sys.stderr, flush=True)
        return None
    return TensorBoardLog(SummaryWriter(log_dir=str(directory)))


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics log; for repeated steps (after a resume) the last one wins."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    last: dict[tuple, dict] = {}
    for r in records:
        last[(r.get("event"), r.get("step"))] = r
    return sorted(last.values(), key=lambda r: (r.get("step", -1), r.get("event", "")))


def is_terminal(stream) -> bool:
    """True when ``stream`` is a terminal a bar can redraw: a tty with a window at least 40 columns
    wide, and TERM is not ``dumb``. A pseudo-terminal that relays output often has no window size
    (0 columns), which tqdm draws as nothing at all."""
    try:
        if not stream.isatty():
            return False
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return False
    return columns >= 40 and os.environ.get("TERM", "") != "dumb"


def clock(seconds: float) -> str:
    """``H:MM:SS`` (``?`` for an unknown time)."""
    if not 0 <= seconds < float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressBar:
    """Rank 0's progress: step, loss, tokens/s, step time and ETA — a tqdm bar on a terminal, one
    line per ``every_steps`` steps or ``every_s`` seconds elsewhere. ``mode``: auto (by the
    stream), bar or lines; silent unless ``enabled``."""

    def __init__(self, total: int, initial: int, enabled: bool, every_steps: int = 0,
                 every_s: float = 30.0, mode: str = "auto", file=None, clock_fn=time.monotonic):
        self.total, self.done, self.first = total, initial, initial
        self.enabled = bool(enabled)
        self.file = file if file is not None else sys.stderr
        self.mode = ("bar" if is_terminal(self.file) else "lines") if mode == "auto" else mode
        # every_steps 0: a twentieth of the run (--progress-every, --progress-every-s)
        self.every_steps = int(every_steps) if every_steps > 0 else max(1, (total - initial) // 20)
        self.every_s = float(every_s)
        self._clock = clock_fn
        self._t0 = self._last_t = clock_fn()
        self._val = None  # the latest validation loss and its step, shown until the next one
        self._val_step = 0
        self._bar = None
        if self.enabled and self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=self.file, desc="train",
                             bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")

    def update(self, loss: float, tokens_per_s: float, step_s: float, val_loss: float | None,
               skipped: int = 0) -> None:
        if not self.enabled:
            return
        self.done += 1
        if val_loss is not None:
            self._val, self._val_step = val_loss, self.done
        if self._bar is not None:
            post = f" loss {loss:.3f}"
            if self._val is not None:
                post += f" {self.val_text()}"
            post += f" | {tokens_per_s:,.0f} tok/s | {step_s * 1e3:.0f} ms/step"
            if skipped:
                post += f" | {skipped} skipped (inf/NaN)"
            self._bar.set_postfix_str(post, refresh=False)
            self._bar.update(1)
            return
        now = self._clock()
        if (self.done % self.every_steps == 0 or now - self._last_t >= self.every_s
                or self.done == self.total or self.done == self.first + 1):
            self._last_t = now
            self.write(self.line(loss, tokens_per_s, step_s, skipped, now - self._t0))

    def line(self, loss: float, tokens_per_s: float, step_s: float, skipped: int, elapsed: float) -> str:
        """One progress line; the ETA is this invocation's mean time per step times the steps left."""
        ran = self.done - self.first
        eta = elapsed / ran * (self.total - self.done) if ran else float("nan")
        pct = 100 * self.done / self.total if self.total else 100.0
        parts = [f"step {self.done}/{self.total} ({pct:.0f}%)", f"loss {loss:.3f}"]
        if self._val is not None:
            parts.append(self.val_text())
        parts += [f"{tokens_per_s:,.0f} tok/s", f"{step_s * 1e3:.0f} ms/step"]
        if skipped:
            parts.append(f"{skipped} skipped (inf/NaN)")
        parts += [f"elapsed {clock(elapsed)}", f"ETA {clock(eta)}"]
        return " | ".join(parts)

    def val_text(self) -> str:
        """``val 4.102`` on the step it was measured, ``val 4.102 @step 10`` after it."""
        age = "" if self._val_step == self.done else f" @step {self._val_step}"
        return f"val {self._val:.3f}{age}"

    def write(self, text: str) -> None:
        """A message between progress updates (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.file)
        else:
            print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
