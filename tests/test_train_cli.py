"""`zerodp train / sample / export` from the command line: bad input ends with one clear line,
and the same command runs under torchrun. (The run through the elastic launcher, its metrics,
report, loss curve, trace and checkpoints, is tests/test_progress_pty.py: there it is also the
run that a config file reproduces.)"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerodp.cli import main
from zerodp.train import checkpoint as ckpt
from zerodp.train.model import GPT, PRESETS

TINY_RUN = ["--preset", "nano", "--seq-len", "32", "--global-batch-tokens", "512", "--micro-batch", "4"]


def _err(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"zerodp {argv[0]}: error: "), err  # one line, no traceback
    return lines[0]


def _plain_checkpoint(root: Path, preset="nano", step=5) -> tuple[GPT, Path]:
    """A world-1 checkpoint holding a freshly initialised GPT's parameters (no optimizer state)."""
    torch.manual_seed(3)
    model = GPT(PRESETS[preset])
    pieces = [type("P", (), dict(name=n, kind="param", start=0, stop=p.numel(), shape=tuple(p.shape),
                                 tensor=p.detach().reshape(-1)))
              for n, p in model.named_parameters()]
    path = ckpt.save(pieces, root / "checkpoints", step,
                     {"model": model.cfg.to_dict(), "stage": 0, "scalars": {"kinds": [], "groups": [{}]},
                      "data": {"kind": "bytes"}})
    return model, path


def test_missing_data_file(capsys, tmp_path):
    line = _err(capsys, ["train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "r")])
    assert "missing.txt does not exist" in line


def test_sequence_longer_than_the_data(capsys, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("a tiny corpus " * 20)
    line = _err(capsys, ["train", "--data", str(f), "--seq-len", "512", "--global-batch-tokens", "4096",
                         "--micro-batch", "4", "--out", str(tmp_path / "r")])
    assert "fewer than seq_len + 1 = 513" in line and "--seq-len" in line


def test_global_batch_not_divisible(capsys, tmp_path):
    line = _err(capsys, ["train", "--global-batch-tokens", "8192", "--micro-batch", "24", "--out", str(tmp_path / "r")])
    assert "not divisible by --micro-batch 24 × 2 ranks = 48" in line


def test_unknown_stage(capsys, tmp_path):
    line = _err(capsys, ["train", "--stage", "4", "--out", str(tmp_path / "r")])
    assert "unknown --stage 4" in line


def test_checkpoint_of_another_model(capsys, tmp_path):
    _plain_checkpoint(tmp_path / "old", preset="nano")
    line = _err(capsys, ["train", "--preset", "tiny", "--resume", str(tmp_path / "old"), "--out", str(tmp_path / "r")])
    assert "checkpoint of another model" in line and "d_model: checkpoint 32, this run 128" in line
    assert "manifest.json" in line


def test_resume_needs_a_place_and_runs_never_overwrite(capsys, tmp_path):
    assert "--resume without a checkpoint needs --out" in _err(capsys, ["train", "--resume"])
    _plain_checkpoint(tmp_path / "run")
    line = _err(capsys, ["train", "--preset", "nano", "--out", str(tmp_path / "run")])
    assert "already holds checkpoints" in line and "--resume" in line


def test_export_and_sample_errors(capsys, tmp_path):
    assert "does not exist" in _err(capsys, ["export", str(tmp_path / "none"), str(tmp_path / "o.safetensors")])
    _plain_checkpoint(tmp_path / "run")
    assert "ending in .safetensors" in _err(capsys, ["export", str(tmp_path / "run"), str(tmp_path / "o.pt")])
    assert "--max-new-tokens must be >= 1" in _err(capsys, ["sample", str(tmp_path / "run"), "--tokens", "0"])


def test_export_gives_the_same_logits_and_sample_prints_text(capsys, tmp_path):
    model, path = _plain_checkpoint(tmp_path / "run")
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    from safetensors.torch import load_file

    plain = GPT(model.cfg)
    plain.load_state_dict(load_file(str(out)))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(x), model(x))
    capsys.readouterr()
    assert main(["sample", str(path), "--prompt", "The ", "--tokens", "20", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text.encode()) >= 20


def test_parsing_train_arguments_does_not_import_torch():
    code = ("import sys, zerodp.cli as c; c.build_parser().parse_args(['train', '--stage', '3']); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


@pytest.mark.parametrize("command", [["export", "MISSING", "out.safetensors"], ["sample", "MISSING"]])
def test_a_missing_checkpoint_is_named_before_torch_loads(tmp_path, command):
    missing = str(tmp_path / "none")
    argv = [missing if w == "MISSING" else str(tmp_path / w) if w.endswith(".safetensors") else w
            for w in command]
    code = (f"import sys, zerodp.cli as c; rc = c.main({argv!r}); "
            "print('torch' in sys.modules, rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "2"], r.stdout + r.stderr
    assert r.stderr == f"zerodp {command[0]}: error: checkpoint {missing} does not exist\n"


def test_preset_names_match_the_model():
    from zerodp.train.config import PRESET_NAMES

    assert tuple(PRESETS) == PRESET_NAMES


def test_word_settings_are_parsed_once_and_keep_their_spelling():
    import json
    import pickle
    from dataclasses import asdict

    from zerodp.train.config import Backend, OnSaveError, Precision, Quantize, TrainConfig

    cfg = TrainConfig(mixed_precision="bfloat16", reduce_dtype="bf16", quantize="grads",
                      on_save_error="continue", backend="gloo")
    assert (cfg.mixed_precision, cfg.reduce_dtype, cfg.quantize, cfg.on_save_error, cfg.backend) == (
        Precision.BF16, Precision.BF16, Quantize.GRADS, OnSaveError.CONTINUE, Backend.GLOO)
    assert cfg.quantize.grads and not cfg.quantize.params
    assert TrainConfig(mixed_precision="fp32").mixed_precision is None
    saved = json.loads(json.dumps(asdict(cfg)))  # what metrics.jsonl and the manifest keep
    assert (saved["mixed_precision"], saved["quantize"], saved["backend"]) == ("bf16", "grads", "gloo")
    assert TrainConfig.from_dict(saved) == cfg == pickle.loads(pickle.dumps(cfg))
    assert f"{cfg.mixed_precision} {cfg.on_save_error!r}" == "bf16 'continue'"
    for bad, flag in ((dict(quantize="all"), "--quantize"), (dict(backend="mpi"), "--backend"),
                      (dict(mixed_precision="fp16"), "--mixed-precision"),
                      (dict(on_save_error=None), "--on-save-error")):
        with pytest.raises(ValueError, match=f"^{flag} must be one of"):
            TrainConfig(**bad)


@pytest.mark.dist
def test_the_same_command_runs_under_torchrun(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "zerodp.cli", "train", *TINY_RUN, "--steps", "3", "--stage", "1", "--no-progress",
           "--out", str(run)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ck = ckpt.Checkpoint.open(ckpt.find(run))
    assert ck.step == 3 and ck.world_size == 2 and ck.manifest["stage"] == 1
    assert "memory per rank, measured" in (run / "report.md").read_text()
    assert r.stdout.count("# zerodp training report") == 1  # rank 0 reports, once
