"""Compressed collectives in the engine (guide §15), each within its documented error bound.

One step of a small GPT on 2 ranks. The reference is independent of the engine: every rank runs a
plain single-process copy of the model on its own micro-batch, and the ranks' local gradients are
gathered, so the exact mean (in float64) and the bound of each option are computed from the data:

- ``quantize_grads`` (qgZ, stages 1-3): |g − mean| ≤ (1/N)·Σ_r m_r/254·(1 + 2^-15) + 2^-23·Σ_r m_r
  + 2^-147 per element, m_r the largest |local gradient| of rank r in the element's block of 256
  inside its ReduceScatter chunk (the flat layout of ``engine.layout()``);
- ``reduce_dtype="bf16"`` (stages 0-3): each local gradient rounded to bf16, summed in bf16 over N
  ranks, divided by N: |g − mean| ≤ (N + 1)·u·(1/N)·Σ_r |g_r| + u·|g|, u = 2^-8;
- ``quantize_params`` (qwZ, stages 1-2): the parameters forward computes with against the fp32
  master, |θ − θ̂| ≤ m/254·(1 + 2^-15) + 2^-148, m the largest |θ| in the block of rank r's shard;
  the master itself is never quantized (it equals the plain model's update without qwZ).

Each check also asserts that the option did something (the error is not zero), so a silently
ignored option fails too.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from _engine_common import make_gpt, spawn_once, token_batch
from zerodp.train.model import GPT, PRESETS

pytestmark = pytest.mark.dist
NANO = dataclasses.replace(PRESETS["nano"], bias=False)
BLOCK = 256
U_BF16 = 2.0 ** -8


def _model() -> GPT:
    return make_gpt(0)


def _batch(rank: int):
    return token_batch(100 + rank, 2)


def _loss(model, rank):
    x, y = _batch(rank)
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _local_grads(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's local gradient of the plain model, gathered (the independent reference)."""
    plain = _model()
    _loss(plain, rank).backward()
    mine = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return every


def _flat(layout: dict, values: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(layout["padded_numel"], dtype=torch.float64)
    for slot in layout["slots"]:
        v = values[slot["name"]].double().reshape(-1)
        out[slot["offset"]:slot["offset"] + v.numel()] = v
    return out


def _block_max(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per element: the largest |value| of its block of BLOCK inside its chunk of ``chunk``."""
    out = torch.empty_like(flat)
    for c0 in range(0, flat.numel(), chunk):
        for b0 in range(c0, c0 + chunk, BLOCK):
            b1 = min(b0 + BLOCK, c0 + chunk)
            out[b0:b1] = flat[b0:b1].abs().max()
    return out


def _check_grads(engine, local, world, bound_of) -> tuple[float, float]:
    """Worst error / bound ratio over every element, and the worst error."""
    got = engine.full_grad_dict()
    worst_ratio, worst_err = 0.0, 0.0
    for layout in engine.layout():
        exact = sum(_flat(layout, g) for g in local) / world
        flat_got = _flat(layout, got)
        bound = bound_of(layout, [_flat(layout, g) for g in local], flat_got)
        err = (flat_got - exact).abs()
        assert bool((err <= bound).all()), (
            f"{layout['label']}: element {int((err - bound).argmax())} off by {float(err.max()):.3e}, "
            f"bound {float(bound[(err - bound).argmax()]):.3e}")
        worst_ratio = max(worst_ratio, float((err / bound.clamp_min(1e-300)).max()))
        worst_err = max(worst_err, float(err.max()))
    return worst_ratio, worst_err


def _qgz_bound(layout, flats, got):
    chunk = layout["shard_numel"]
    ms = [_block_max(f, chunk) for f in flats]
    n = len(flats)
    return sum(m / 254 for m in ms) / n * (1 + 2 ** -15) + 2 ** -23 * sum(ms) + 2 ** -147


def _bf16_bound(layout, flats, got):
    n = len(flats)
    return (n + 1) * U_BF16 * sum(f.abs() for f in flats) / n + U_BF16 * got.abs()


def _ranks(rank, world):
    out = {}
    local = _local_grads(rank, world)
    cases = [(f"qgz{s}", dict(stage=s, quantize_grads=True), _qgz_bound) for s in (1, 2, 3)]
    cases += [(f"bf16_{s}", dict(stage=s, reduce_dtype="bf16"), _bf16_bound) for s in (0, 2, 3)]
    for key, opts, bound_of in cases:
        engine = zerodp.parallelize(_model(), lambda g: torch.optim.SGD(g, lr=0.1), bucket_mb=0.05, **opts)
        _loss(engine, rank).backward()
        out[key] = _check_grads(engine, local, world, bound_of)
    for stage in (1, 2):
        engine = zerodp.parallelize(_model(), lambda g: torch.optim.SGD(g, lr=0.1), bucket_mb=0.05, stage=stage,
                                    quantize_params=True)
        plain = _model()
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        _loss(engine, rank).backward()
        engine.step()
        # the plain model's step on the exact mean gradient: the master must match it (no qwZ in it)
        for (n, p), g in zip(plain.named_parameters(), [sum(loc[n] for loc in local) / world
                                                       for n, _ in plain.named_parameters()]):
            p.grad = g
        opt.step()
        master = engine.full_state_dict()
        worst = 0.0
        for layout in engine.layout():
            m_flat = _flat(layout, master)
            used = _flat(layout, {n: p.detach() for n, p in engine.module.named_parameters()})
            bound = _block_max(m_flat, layout["shard_numel"]) / 254 * (1 + 2 ** -15) + 2 ** -148
            err = (used - m_flat).abs()
            assert bool((err <= bound).all()), f"qwZ stage {stage} {layout['label']}: {float(err.max()):.3e}"
            worst = max(worst, float(err.max()))
        plain_state = dict(plain.named_parameters())
        master_err = max(float((master[n] - plain_state[n]).abs().max()) for n in plain_state)
        # the exact mean of N = 2 gradients in another order (2·2·ε relative), times lr, plus one
        # rounding of the parameter: what fp32 allows between two correct implementations
        eps = torch.finfo(torch.float32).eps
        g_max = max(float(p.grad.abs().max()) for p in plain.parameters())
        p_max = max(float(p.abs().max()) for p in plain.parameters())
        out[f"qwz{stage}"] = (worst, master_err, 0.1 * 4 * eps * g_max + eps * p_max)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn_once(_ranks, 2, timeout=240)


@pytest.mark.parametrize("key", ["qgz1", "qgz2", "qgz3", "bf16_0", "bf16_2", "bf16_3"])
def test_compressed_gradients_stay_within_their_bound(results, key):
    for r in results:
        ratio, err = r[key]
        assert ratio <= 1.0
        assert err > 0.0, f"{key}: bitwise equal to the exact mean — the option changed nothing"


@pytest.mark.parametrize("stage", [1, 2])
def test_quantized_parameter_gather_stays_within_its_bound_and_the_master_is_exact(results, stage):
    for r in results:
        used_err, master_err, master_tol = r[f"qwz{stage}"]
        assert used_err > 0.0, "the parameters forward uses were not quantized"
        assert master_err <= master_tol, f"the fp32 master moved off the exact update: {master_err:.2e}"
        assert master_err < used_err / 100  # far below the quantization error: never quantized
