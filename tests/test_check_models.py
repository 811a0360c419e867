"""The acceptance models of ``zerodp check`` (docs/check.md), none of which another test uses: a
conv net with BatchNorm (SGD), a Llama with tied embeddings from a config (AdamW), a GPT with Muon +
AdamW (examples/check_*.py). Each passes at stages 0-3 on 2 ranks within 2 minutes, and fails with
the engine's learning rate off by 0.1%. make fuzz (ZERODP_ALL_WORLDS=1); make test runs the small
model of tests/test_check.py instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _engine_common import ALL_WORLDS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

pytestmark = [pytest.mark.fuzz, pytest.mark.dist,
              pytest.mark.skipif(not ALL_WORLDS, reason="make fuzz (ZERODP_ALL_WORLDS=1) runs the acceptance models")]


def _configs():
    import check_convnet
    import check_muon_gpt

    return {
        "convnet+sgd": dict(model=check_convnet.build, optimizer="sgd",
                            optimizer_args={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
                            input_shape=(3, 32, 32)),
        "llama+adamw": dict(config=str(ROOT / "examples" / "configs" / "check-llama"), optimizer="adamw",
                            optimizer_args={"lr": 1e-2, "weight_decay": 0.1}),
        "gpt+muon": dict(model=check_muon_gpt.build, optimizer_factory=check_muon_gpt.optimizers,
                         batch=check_muon_gpt.batch),
    }


@pytest.mark.parametrize("name", ["convnet+sgd", "llama+adamw", "gpt+muon"])
def test_an_acceptance_model_passes_in_two_minutes_and_fails_perturbed(name):
    import zerodp

    options = _configs()[name]
    if "config" in options:
        pytest.importorskip("transformers")
    result = zerodp.check(**options, device="cpu")
    assert result.ok, result.table()
    assert [r["stage"] for r in result.rows] == [0, 1, 2, 3]
    assert result.seconds < 120, result.seconds
    off = zerodp.check(**options, device="cpu", perturb_lr=1e-3)
    assert not any(r["ok"] for r in off.rows), off.table()
