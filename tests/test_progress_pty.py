"""`zerodp train --config examples/nano.toml` under a pseudo-terminal: progress lines appear (a
pty with no window size is no terminal a bar can redraw), and the run is bitwise the run of the
same settings given as flags (here through a pipe, which prints the same lines). The flags' run
is also the end-to-end check of a run through the elastic launcher: metrics, report, loss curve,
trace, checkpoints that resume and a sample from them."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from zerodp.train import checkpoint as ckpt
from zerodp.train.progress import read_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nano.toml"
LINE = re.compile(r"^step (\d+)/6 \(\d+%\) \| loss \d+\.\d{3} \|( val \d+\.\d{3}( @step \d+)? \|)?"
                  r" [\d,]+ tok/s \| \d+ ms/step"
                  r" \| elapsed \d+:\d\d:\d\d \| ETA (\d+:\d\d:\d\d|\?)$")


# The example's settings written out as flags, by hand (an old name, --preset, among them).
FLAGS = ["--preset", "nano", "--seq-len", "32", "--global-batch-tokens", "512", "--micro-batch", "4",
         "--nproc", "2", "--stage", "2", "--bucket-mb", "0.5", "--steps", "6", "--warmup-steps", "2", "--lr", "3e-3",
         "--seed", "1234", "--eval-every", "3", "--ckpt-every", "3", "--progress-every", "2"]


def _under_pty(argv: list[str], timeout: float = 300) -> tuple[int, str]:
    """Run ``argv`` with stdin, stdout and stderr on a fresh pseudo-terminal (no window size, as
    one that relays another program's output); return its exit status and everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace").replace("\r\n", "\n")


def _params(run: Path) -> dict[str, torch.Tensor]:
    ck = ckpt.Checkpoint.open(ckpt.find(run))
    assert ck.step == 6
    return {n: ck.full(n, "param") for n in ck.names() if "param" in ck.kinds(n)}


def _progress(text: str) -> list[int]:
    steps = []
    for line in text.splitlines():
        if line.startswith("step "):
            m = LINE.match(line.strip())
            assert m, line
            steps.append(int(m.group(1)))
    return steps


@pytest.mark.dist
def test_config_file_run_under_a_pty_shows_progress_and_equals_the_flags_run(tmp_path, capsys):
    table = tomllib.loads(EXAMPLE.read_text())
    a, b = tmp_path / "from-file", tmp_path / "from-flags"
    # --trace on the command line joins the file's settings
    rc, text = _under_pty([sys.executable, "-m", "zerodp.cli", "train", "--config", str(EXAMPLE), "--trace",
                           "--out", str(a)])
    assert rc == 0, text[-3000:]
    # progress_every = 2 in the file: after the first step, every second step, and the last
    assert _progress(text) == [1, 2, 4, 6], text[-3000:]
    assert "\r" not in text and "|█" not in text  # lines, not a bar's redraws

    r = subprocess.run([sys.executable, "-m", "zerodp.cli", "train", *FLAGS, "--trace", "--out", str(b)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _progress(r.stderr) == [1, 2, 4, 6], r.stderr[-3000:]
    assert f"run directory: {b}" in r.stderr

    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys() and len(pa) > 4
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    losses = [[m["loss"] for m in read_metrics(run / "metrics.jsonl") if m["event"] == "step"] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == 6 and losses[0][0] != losses[0][-1]

    # each run directory keeps its resolved config, which resolves to the same settings again
    for run in (a, b):
        kept = tomllib.loads((run / "config.toml").read_text())
        assert {k: kept[k] for k in table} == table and kept["out"] == str(run) and kept["trace"] is True
    from zerodp.cli import main

    assert main(["train", "--config", str(a / "config.toml"), "--print-config"]) == 0
    assert capsys.readouterr().out == (a / "config.toml").read_text()

    # the rest of a run through the elastic launcher
    for name in ("metrics.jsonl", "loss.png", "report.md", "report.json", "trace.json"):
        assert (b / name).stat().st_size > 0, name
    report = (b / "report.md").read_text()
    for needle in ("memory per rank, measured", "reduce_scatter", "all_gather", "exposed communication",
                   "FLOP/s", "tokens/s"):
        assert needle in report, needle
    records = [json.loads(l) for l in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 3, 6]
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, 7))
    trace = json.loads((b / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert any(e.get("args", {}).get("kind") == "reduce_scatter" for e in trace["traceEvents"])
    data = json.loads((b / "report.json").read_text())
    assert len(data["stats"]) == 2 and data["stats"][0]["memory"]["optimizer_states"] > 0
    ck = ckpt.Checkpoint.open(ckpt.find(b))
    assert ck.step == 6 and ck.world_size == 2 and ck.manifest["stage"] == 2
    assert [p.name for p in ckpt.complete_checkpoints(b / "checkpoints")] == ["step_00000003", "step_00000006"]
    assert main(["sample", str(b), "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.startswith("The ")
