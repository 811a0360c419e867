"""A rank-0-only save after the last step (DDP's habit) at stages 1 and 3, as torchrun runs it.

``tests/_script_end.py`` trains 3 steps on 2 ranks and then, on rank 0 alone, saves
``model.state_dict()`` and ``optimizer.state_dict()``; rank 1 goes straight to its end (with and
without ``dist.destroy_process_group()``). At stages 1-3 those dicts need rank 1's shards, and rank 1
has no next step to serve them from: it serves them at its interpreter's exit
(``Control.serve_until_all_exit``, guide §12.9). Checked: both processes exit 0 within a limit, and
the file holds the single-process result — the same model trained with ``torch.optim.SGD`` on the
whole batch — within ``trajectory_tolerance`` (fp32, 8 rows per step, 3 steps) relative to the
tensors' magnitudes. And the other way to end: rank 0 takes a step more than rank 1 (uneven
batches), whose end leaves it waiting in that step's first collective — it ends in one line naming
both, soon after rank 1's end (not at rank 1's exit, with a bare backend error, nor after
``timeout_s``).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _script_end as script
from _engine_common import trajectory_tolerance
from zerodp.engine.control import EXIT_WAIT_S
from zerodp.spawn import free_port

pytestmark = pytest.mark.dist
LIMIT_S = 120.0
HERE = Path(__file__).resolve().parent


def _reference() -> tuple[dict, dict]:
    m = script.model()
    opt = torch.optim.SGD(m.parameters(), lr=script.LR, momentum=script.MOMENTUM)
    for step in range(script.STEPS):
        x, y = script.batch(step, 2)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict(), opt.state_dict()


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = trajectory_tolerance(2 * script.ROWS, script.STEPS)
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _run(stage: int, path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(HERE / "_script_end.py"), str(stage), str(path), *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_with_a_step_more_ends_in_one_line_when_the_other_ends(tmp_path, stage):
    began = time.monotonic()
    done = _run(stage, tmp_path / "unused.pt", "uneven")
    took = time.monotonic() - began
    assert done.returncode != 0, done.stdout[-2000:]
    said = [line for line in done.stderr.splitlines() if "CollectiveTimeout:" in line]
    assert said and "rank 1 reached the end of its script after 3 steps while rank 0 waits in" in said[0], \
        done.stderr[-3000:]
    assert "in step 4" in said[0] and "drop_last=True" in said[0], said[0]
    assert took < EXIT_WAIT_S, f"{took:.0f} s: not before rank 1's process went"


@pytest.mark.parametrize("stage, destroy", [(1, True), (3, False)])
def test_a_rank0_save_after_the_last_step_is_served_at_the_end(tmp_path, stage, destroy):
    path = tmp_path / "final.pt"
    done = _run(stage, path, *(["destroy"] if destroy else []))
    case = f"stage {stage}, destroy_process_group {destroy}"
    assert done.returncode == 0, f"{case}: exit {done.returncode}\n{done.stderr[-3000:]}"
    saved = torch.load(path, weights_only=True)
    model, optimizer = _reference()
    assert saved["model"].keys() == model.keys(), case
    for name, value in model.items():
        _close(saved["model"][name], value, f"{case}, {name}")
    for index, state in optimizer["state"].items():
        _close(saved["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"],
               f"{case}, momentum of parameter {index}")
