"""The torch range (docs/engine.md, "Supported torch versions"): zerodp.compat on the torch at hand,
and the regressions each older version exposed, reproduced on the pinned torch where they can be.

``make compat TORCH=X`` runs this file, the matrix's pairwise table and its bf16 and per-tensor
optimizer cases, and the quick tier of the engine suites on torch X in a venv of its own."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import _matrix
from zerodp import compat
from zerodp.engine.nest import cast_floats


class _LossDtypes(TorchFunctionMode):
    """Records the operand dtypes of every mse_loss call."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.mse_loss:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_matrix_model_gives_its_loss_one_dtype_under_bf16_inputs():
    """torch 2.11 failed every bf16 matrix case in ``loss.backward()`` ("Found dtype BFloat16 but
    expected Float"): ``mixed_precision="bf16"`` casts the target y with the input (as FSDP2's
    cast_forward_inputs does), and mse_loss's backward before 2.12 rejects a target of another dtype
    than the output. Reproduced here on any torch by the dtypes the loss receives: the model as the
    engine runs it (bf16 parameters, floating inputs cast to bf16)."""
    torch.manual_seed(0)
    model = _matrix.MatrixModel(frozenset()).to(torch.bfloat16)
    x, y = _matrix.batch(0, 0)
    x, y = cast_floats((x, y), torch.bfloat16)
    assert y.dtype == torch.bfloat16  # the engine's cast, as the case runs it
    with _LossDtypes() as mode:
        model(x, y).backward()
    assert mode.seen and all(a == b for a, b in mode.seen), mode.seen


def test_launch_config_keeps_what_this_torch_takes():
    from torch.distributed.launcher.api import LaunchConfig

    cfg = compat.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="x",
                               signals_to_handle="SIGHUP,SIGQUIT", shutdown_timeout=7, no_such_option=1)
    assert isinstance(cfg, LaunchConfig) and cfg.nproc_per_node == 2
    takes = inspect.signature(LaunchConfig).parameters
    if "shutdown_timeout" in takes:
        assert cfg.shutdown_timeout == 7
    assert not hasattr(cfg, "no_such_option")
    limits = compat.launch_limits()
    assert ("shutdown_timeout" in takes) == (not any("2.12" in line for line in limits))


def test_dynamo_disable_runs_the_function_eagerly():
    calls = []

    def fn(a):
        calls.append(torch.compiler.is_compiling())
        return a + 1

    wrapped = compat.dynamo_disable(fn, "host bookkeeping")
    compiled = torch.compile(lambda a: wrapped(a) * 2, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 4.0))
    assert calls == [False]


@pytest.mark.parametrize("name", ["Muon", "Adafactor"])
def test_the_per_tensor_optimizers_the_matrix_uses_exist(name):
    """The floor of the range (2.9) is the first torch with ``torch.optim.Muon``."""
    assert hasattr(torch.optim, name)
