"""``zerodp check`` (docs/check.md): the check passes an exact engine and fails one whose learning
rate is off by 0.1% (a test-only seam, ``CheckConfig.perturb_lr``) for SGD, AdamW and Muon + AdamW;
bad input is one line and exit status 2; ``import zerodp`` stays torch-free.

The three acceptance models (a conv net with BatchNorm, a tied-embedding Llama from a config, a
GPT with Muon + AdamW) run at stages 0-3 in tests/test_check_models.py (make fuzz).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn as nn
import torch.nn.functional as F

from zerodp.cli import main

ROOT = Path(__file__).resolve().parents[1]


class Tiny(nn.Module):
    """Odd sizes (padding in every flat buffer at 2 ranks), a LayerNorm, two blocks (stage 3 units)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 9)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(9), nn.Linear(9, 9)) for _ in range(2)])
        self.out = nn.Linear(9, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + F.gelu(b(h))
        return self.out(h)


def tiny_build() -> nn.Module:
    return Tiny()


def _many(rank: int, world: int, cfgs):
    from zerodp.check.runner import rank_main

    return [rank_main(rank, world, cfg) for cfg in cfgs]


@pytest.mark.dist
def test_the_check_passes_the_engine_and_fails_it_with_the_learning_rate_off_by_a_thousandth():
    from zerodp.check import CheckConfig
    from zerodp.check.report import to_json, verdicts
    from _engine_common import spawn_once

    optimizers = [("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
                  ("adamw", {"lr": 1e-2, "weight_decay": 0.1}),
                  ("muon+adamw", {"lr": 2e-2, "weight_decay": 0.01})]
    cfgs = []
    for name, args in optimizers:
        for perturb in (0.0, 1e-3):
            cfgs.append(CheckConfig(model=tiny_build, optimizer=name, optimizer_args=args, input_shape=(6,),
                                    steps=2, device="cpu", perturb_lr=perturb).validate())
    cfgs.append(CheckConfig(model=tiny_build, optimizer="adamw", input_shape=(6,), steps=2, stages=(1, 3),
                            precision="bf16", device="cpu").validate())
    results = spawn_once(_many, 2, cfgs, timeout=300)[0]
    data = json.loads(to_json(results[0], {}))  # what --json prints
    assert data["ok"] and [r["stage"] for r in data["rows"]] == [0, 1, 2, 3] and "states_planned" in data["rows"][0]
    for cfg, rows in zip(cfgs, results):
        assert [r["stage"] for r in rows] == list(cfg.stages)
        label = f"{cfg.optimizer} {cfg.precision} perturb_lr={cfg.perturb_lr}"
        if cfg.perturb_lr:
            assert not any(r["ok"] for r in rows), (label, [(r["stage"], r["param"]) for r in rows])
            for r in rows:  # the step is what is off: the parameters after it
                assert r["param"]["ratio"] > 1.0, (label, r["stage"], r["param"])
        else:
            assert all(r["ok"] for r in rows), (label, [(r["stage"], r["grad"], r["param"], r["optimizer_state"])
                                                        for r in rows if not r["ok"]])
            for r in rows:  # the planner's model states and bytes agree with the engine's measured ones
                v = verdicts(r)
                assert v["states_ok"] is not False and v["sent_ok"] is not False, (label, r["stage"], v)


def _cli(*argv: str, cwd: Path = ROOT / "tests") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerodp.cli", "check", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.dist
def test_the_command_shows_progress_prints_the_table_and_exits_1_on_a_fail():
    out = _cli("--model", "test_check:tiny_build", "--input-shape", "6", "--stages", "0,3", "--optimizer", "sgd",
               "--optimizer-args", "lr=0.1", "--perturb-lr", "1e-3")
    assert out.returncode == 1, out.stderr
    assert "stage 3, world 2: step 3/3 (resharded to stage 0, world 1)" in out.stderr  # the progress lines
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["stage", "world", "reshard"]
    assert "FAIL stage 3 world 2: param" in out.stdout and lines[-1].startswith("FAIL: 2 rows in")


@pytest.mark.parametrize("argv, says", [
    ([], "give the model"),
    (["--model", "test_check:tiny_build"], "give the batches"),
    (["--model", "nosuchmodule:build", "--input-shape", "6"], "cannot import nosuchmodule"),
    (["--model", "test_check:nothing", "--input-shape", "6"], "has no nothing"),
    (["--model", "test_check:tiny_build", "--input-shape", "6", "--optimizer", "lbfgs"], "--optimizer 'lbfgs'"),
    (["--model", "test_check:tiny_build", "--input-shape", "6", "--stages", "4"], "stages are 0"),
    (["--model", "test_check:tiny_build", "--input-shape", "6", "--optimizer-args", "lr"], "is not name=value"),
    (["--config", "no/such/config.json"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_status_2(argv, says, capsys, monkeypatch):
    monkeypatch.chdir(ROOT / "tests")
    try:
        rc = main(["check", *argv])
    except SystemExit as e:  # argparse's own errors (one line too, see zerodp.cli.Parser)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_importing_zerodp_stays_light_and_zerodp_check_is_callable():
    code = ("import sys, zerodp; c = zerodp.check; assert callable(c) and c.CheckConfig; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
