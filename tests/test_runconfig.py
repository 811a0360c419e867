"""Run configs as TOML files (zerodp.runconfig): every option has a key, the file's values go
through the options' own checks, the command line overrides the file, --print-config round-trips;
and the one vocabulary: old names as hidden aliases, --version, zerodp env, a description for
every subcommand; and progress lines where no bar can be drawn."""

from __future__ import annotations

import argparse
import io
import os
import pty
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from zerodp import runconfig
from zerodp.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _sub(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _printed(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_every_train_setting_has_a_key_and_every_key_a_setting():
    from zerodp.train.config import TrainConfig

    keys = runconfig.settings(_sub("train"))
    # --compress (zerodp plan's names) is the one key for TrainConfig's reduce_dtype and quantize
    assert {a.dest for a in keys.values()} == ({f.name for f in fields(TrainConfig)}
                                               - {"reduce_dtype", "quantize"} | {"compress"})
    assert "model" in keys and "progress" in keys and "preset" not in keys and "no_progress" not in keys


@pytest.mark.parametrize("command,argv", [
    ("train", ["--model", "nano", "--stage", "3", "--mixed-precision", "bf16", "--bucket-mb", "auto", "--profile",
               "p.json", "--no-progress", "--lr", "1e-4", "--timeout-s", "inf", "--resume", "--out", "runs/a b\"c",
               "--data", "données.txt", "--trace"]),
    ("train", []),
    ("bench", ["--quick", "--stages", "0,3", "--compress", "none,int8", "--bucket-mb", "12.5", "--markdown", "x.md"]),
])
def test_print_config_round_trips(capsys, tmp_path, command, argv):
    first = _printed(capsys, [command, *argv, "--print-config"])
    path = tmp_path / "run.toml"
    path.write_text(first)
    assert _printed(capsys, [command, "--config", str(path), "--print-config"]) == first
    # and it is TOML whose values are the parsed options' values
    table = tomllib.loads(first)
    parsed = build_parser().parse_args([command, *argv])
    for key, action in runconfig.settings(_sub(command)).items():
        assert table.get(key) == getattr(parsed, action.dest), key


def test_the_command_line_overrides_the_file(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "nano"\nstage = 1\nsteps = 7\ntrace = true\nprogress = false\n')
    table = tomllib.loads(_printed(capsys, ["train", "--config", str(path), "--stage", "3", "--print-config"]))
    got = (table["model"], table["stage"], table["steps"], table["trace"], table["progress"])
    assert got == ("nano", 3, 7, True, False)
    # a list is the comma-separated value of the option
    path.write_text("stages = [0, 2]\n")
    assert tomllib.loads(_printed(capsys, ["bench", "--config", str(path), "--print-config"]))["stages"] == "0,2"


@pytest.mark.parametrize("text,needle", [
    ("micro_bach = 4", "unknown key 'micro_bach': zerodp train has no such setting (did you mean micro_batch?)"),
    ("[model]\nname = 'x'", "model = {'name': 'x'}: expected a value --model takes (--model {nano,"),
    ("micro_batch = 'four'", 'micro_batch = "four": expected a whole number'),
    ("trace = 1", "trace = 1: expected true or false"),
    ("backend = 'mpi'", 'backend = "mpi": expected one of auto, gloo, nccl'),
    ("model = 'mixtral-8x7b'", "mixtral-8x7b is a planner-only model"),
    ("stage = ", "is not valid TOML"),
    ("stage = 4", "unknown --stage 4"),  # what TrainConfig refuses, --print-config refuses too
])
def test_bad_files_get_one_line_naming_the_key(capsys, tmp_path, text, needle):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    line = _one_line_error(capsys, ["train", "--config", str(path), "--print-config"])
    assert needle in line and line.startswith("zerodp train: error: "), line
    assert f"--config {path}" in line or "--stage" in needle


def test_a_missing_file_is_named(capsys, tmp_path):
    line = _one_line_error(capsys, ["bench", "--config", str(tmp_path / "none.toml")])
    assert "none.toml: no such file" in line


def test_the_shipped_example_resolves(capsys):
    table = tomllib.loads(_printed(capsys, ["train", "--config", str(ROOT / "examples" / "nano.toml"),
                                            "--print-config"]))
    assert table["model"] == "nano" and table["steps"] == 6 and table["nproc"] == 2


def test_old_names_are_hidden_aliases(capsys):
    for command, old, new, value in (("train", "--preset", "--model", "nano"), ("sample", "--tokens",
                                     "--max-new-tokens", "5"), ("calibrate", "--tokens", "--tokens-per-rank", "32")):
        argv = [command] + (["CKPT"] if command == "sample" else [])
        parsed = [{k: v for k, v in vars(build_parser().parse_args(argv + [flag, value])).items() if k[0] != "_"}
                  for flag in (old, new)]
        assert parsed[0] == parsed[1] and str(parsed[0]["preset" if command == "train" else "tokens"]) == value
        with pytest.raises(SystemExit):
            main([command, "-h"])
        help_text = capsys.readouterr().out
        assert new in help_text and f"{old} " not in help_text.replace(new, ""), (command, old)


def test_mixed_precision_offers_what_the_engine_accepts():
    from zerodp.train.cli import config_from_args

    for name, field in (("fp32", None), ("float32", None), ("bf16", "bf16"), ("bfloat16", "bf16")):
        args = build_parser().parse_args(["train", "--mixed-precision", name])
        assert config_from_args(args).mixed_precision == field
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--mixed-precision", "fp16"])


def test_version_and_env(capsys):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"zerodp {version}"
    import platform

    import torch

    out = _printed(capsys, ["env"])
    rows = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith(("backends", "zerodp ")))
    assert rows["torch"].strip() == torch.__version__ and rows["python"].strip() == platform.python_version()
    assert rows["backend"].strip() in ("gloo", "nccl") and "profile" in rows and "devices" in rows
    assert f"zerodp              {version}" in out or out.startswith("zerodp")


def test_env_describes_a_profile(capsys, tmp_path):
    import json

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"hardware": {"name": "calibrated-box"},
                                "calibration": {"world_size": 2, "backend": "gloo", "fits": [], "compute": {}}}))
    assert json.loads(_printed(capsys, ["env", "--profile", str(path), "--json"]))["profile"].endswith(
        "p.json: 2 ranks, backend gloo, calibrated-box")


def test_every_subcommand_has_a_description():
    def walk(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    if name == "zerodp" and sub_name in ("plan", "ui"):
                        continue  # the planner's and the page's commands are checked with their own CLI
                    assert sub.description, f"{name} {sub_name} has no description"
                    walk(sub, f"{name} {sub_name}")

    walk(build_parser(), "zerodp")


# ------------------------------------------------------------------------------------ progress
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_lines_every_n_steps_or_seconds():
    from zerodp.train.progress import ProgressBar

    out, clock = io.StringIO(), _Clock()
    bar = ProgressBar(20, 0, True, every_steps=5, every_s=60, file=out, clock_fn=clock)
    assert bar.mode == "lines"  # a StringIO is no terminal
    for step in range(1, 21):
        clock.t = step * 2.0 + (100 if step >= 12 else 0)  # step 12 is slow: a line, though no multiple of 5
        bar.update(5.0 - step / 10, 1234.5, 0.25, 4.5 if step == 10 else None)
    lines = out.getvalue().splitlines()
    assert [int(l.split()[1].split("/")[0]) for l in lines] == [1, 5, 10, 12, 15, 20]
    assert lines[0] == ("step 1/20 (5%) | loss 4.900 | 1,234 tok/s | 250 ms/step | elapsed 0:00:02 | "
                        "ETA 0:00:38")
    assert lines[-1].endswith("elapsed 0:02:20 | ETA 0:00:00") and "| val 4.500 @step 10 |" in lines[-1]
    assert "| val 4.500 |" in lines[2] and "val" not in lines[1]  # on the step it was measured: no age
    resumed = ProgressBar(20, 10, True, every_steps=0, file=io.StringIO(), clock_fn=clock)
    assert resumed.every_steps == 1  # a twentieth of the 10 steps left, at least 1
    silent = io.StringIO()
    ProgressBar(20, 0, False, file=silent).update(1.0, 1.0, 1.0, None)
    assert silent.getvalue() == ""


def test_a_terminal_gets_a_bar_and_a_pty_without_a_window_does_not():
    import fcntl
    import struct
    import termios

    from zerodp.train.progress import is_terminal

    master, slave = pty.openpty()
    try:
        with os.fdopen(os.dup(slave), "w") as stream:
            assert not is_terminal(stream)  # 0 columns: what a relaying pty often has
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            assert is_terminal(stream)
    finally:
        os.close(master)
        os.close(slave)
    assert not is_terminal(io.StringIO())


def test_tensorboard_events_next_to_the_metrics_or_one_line_without_the_package(tmp_path, capsys):
    import importlib.util
    import json

    from zerodp.train.progress import METRICS_FILE, MetricsLog, read_metrics

    log = MetricsLog(tmp_path / METRICS_FILE)
    log.write("start", step=0, config={"tensorboard": True})
    for step in (1, 2):
        log.write("step", step=step, loss=3.0 / step, lr=1e-3, tokens_per_s=100.0, step_s=0.1)
    log.write("eval", step=2, val_loss=1.25)
    log.write("end", step=2)
    log.close()
    assert sorted(r["event"] for r in read_metrics(tmp_path / METRICS_FILE)) == ["end", "eval", "start", "step", "step"]
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    if importlib.util.find_spec("tensorboard") is None:
        assert len(err) == 1 and "pip install 'zerodp[tensorboard]'" in err[0]
        assert not (tmp_path / "tensorboard").exists()
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 1.25)]
    assert json.loads(json.dumps(err)) == []


def test_help_and_config_resolution_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, contextlib, io, zerodp.cli as c\n"
            "for argv in (['--help'], ['train', '--help'], ['train', '--config', 'examples/nano.toml', "
            "'--print-config'], ['bench', '--quick', '--print-config']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            c.main(argv)\n"
            "        except SystemExit:\n"
            "            pass\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout.strip() == "False", r.stderr


def test_bench_keeps_its_resolved_config_in_its_output_folder(capsys, tmp_path):
    path = tmp_path / "bench.toml"
    path.write_text('stages = [0, 1]\nregimes = "nothing"\n')
    out = tmp_path / "b"
    # a regime the bench refuses: it stops at once, after the folder got the resolved settings
    line = _one_line_error(capsys, ["bench", "--config", str(path), "--out", str(out)])
    assert "--regimes: 'nothing'" in line
    kept = tomllib.loads((out / "config.toml").read_text())
    assert kept["stages"] == "0,1" and kept["out"] == str(out) and kept["regimes"] == "nothing"
