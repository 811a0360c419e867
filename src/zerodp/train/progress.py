"""What rank 0 shows and records while training: a progress bar and a JSONL metrics log."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Append-only JSON lines, one record per event (``{"event": "step"|"eval"|…, …}``).

    Every line is flushed as written, so a crash loses at most the line being written; a resumed
    run appends after a ``resume`` record, and readers keep the last record of each step.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def write(self, event: str, **fields) -> None:
        rec = {"event": event, "time": round(time.time(), 3), **fields}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


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


class ProgressBar:
    """tqdm bar with step, loss, tokens/s, step time and ETA (rank 0 only; silent elsewhere)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stderr, desc="train",
                             bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")

    def update(self, loss: float, tokens_per_s: float, step_s: float, val_loss: float | None,
               skipped: int = 0) -> None:
        if self._bar is None:
            return
        post = f" loss {loss:.3f}"
        if val_loss is not None:
            post += f" val {val_loss:.3f}"
        post += f" | {tokens_per_s:,.0f} tok/s | {step_s * 1e3:.0f} ms/step"
        if skipped:
            post += f" | {skipped} skipped (inf/NaN)"
        self._bar.set_postfix_str(post, refresh=False)
        self._bar.update(1)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
