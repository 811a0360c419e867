"""Compressed collectives (guide §15): int8 blockwise quantization and the qwZ AllGather / qgZ
all-to-all ReduceScatter stay within their documented error bounds, element by element.

Every bound is computed here from the data (the largest magnitude of each block of the input,
in float64) with the formulas of guide §15, independently of the module's own arithmetic:

- round trip and AllGather: ``|x − x̂| ≤ m/254·(1 + 2^-15) + 2^-148 + u·|x̂|``
- ReduceScatter (mean over N): ``(1/N)·Σ_r m_r/254·(1 + 2^-15) + 2^-23·Σ_r m_r + 2^-147 + u·|y|``

with ``u`` the unit roundoff of the output dtype (0 for fp32; plus half the output dtype's
subnormal step, for outputs below its normal range). ``make test`` runs the seeded "ci"
hypothesis profile; ``make fuzz`` many more examples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _engine_common import spawn_once
from zerodp.engine.comm import reduce_scatter_flat, ring_sent_bytes
from zerodp.engine.quant import (dequantize_int8, int8_collective_bytes, int8_sent_bytes, int8_wire_bytes,
                                 quantize_int8)

BLOCKS = (1, 2, 3, 7, 64, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- the documented bounds, from the data ------------------------------------------------------

def _unit_roundoff(dtype: torch.dtype) -> float:
    """u of the output cast: half the machine epsilon, 0 where fp32's slack already covers it."""
    eps = torch.finfo(dtype).eps
    return 0.0 if eps <= torch.finfo(torch.float32).eps else eps / 2


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the largest magnitude in its block of ``x`` (float64; the last block may be short)."""
    x = x.reshape(-1).double().abs()
    n = x.numel()
    nb = -(-n // block)
    m = torch.nn.functional.pad(x, (0, nb * block - n)).view(nb, block).amax(dim=1)
    return m.repeat_interleave(block)[:n]


def _cast_slack(out: torch.Tensor) -> torch.Tensor:
    """Rounding of the cast to the output dtype: ``|out − x̂| ≤ u·|x̂| ≤ u/(1−u)·|out|`` in its
    normal range, at most half its subnormal step below it."""
    u = _unit_roundoff(out.dtype)
    half_step = torch.finfo(out.dtype).smallest_normal * torch.finfo(out.dtype).eps / 2 if u else 0.0
    return u / (1 - u) * out.double().abs() + half_step


def roundtrip_bound(x: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    return _block_max(x, block) / 254 * (1 + 2**-15) + 2**-148 + _cast_slack(out)


def mean_bound(contribs: list[torch.Tensor], block: int, out: torch.Tensor) -> torch.Tensor:
    """Bound for the mean of N same-length contributions, each quantized once in blocks of ``block``."""
    ms = torch.stack([_block_max(c, block) for c in contribs])
    n = len(contribs)
    return ms.sum(0) / n / 254 * (1 + 2**-15) + 2**-23 * ms.sum(0) + 2**-147 + _cast_slack(out)


def _check(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> float:
    """Assert the bound element by element, naming the worst element; return max error/bound."""
    err = (got.double() - exact.double()).abs()
    bad = ~(err <= bound)  # NaN counts as a failure
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: element {i} of {err.numel()}: got {got[i].item()!r}, exact "
                             f"{exact[i].item()!r}, error {err[i].item():.3e} > bound {bound[i].item():.3e} "
                             f"({int(bad.sum())} elements out of bound)")
    return float((err / bound).max()) if err.numel() else 0.0


def _representable(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    """The values in ``dtype``, clipped to its finite range first (so that the cast cannot overflow)."""
    big = torch.finfo(dtype).max
    return torch.tensor(values, dtype=torch.float64).clamp(-big, big).to(dtype)


# --- properties of quantize / dequantize --------------------------------------------------------

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@pytest.mark.fuzz
@given(values=st.lists(finite32, min_size=1, max_size=400), block=st.sampled_from(BLOCKS),
       dtype=st.sampled_from(DTYPES))
def test_roundtrip_error_within_bound_for_any_finite_values(values, block, dtype):
    """Hypothesis' floats reach zeros, −0.0, subnormals, fp32's largest values and mixtures of them."""
    x = _representable(values, dtype)
    q, scales = quantize_int8(x, block)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.dtype == torch.float32
    assert scales.numel() == -(-x.numel() // block) and bool(torch.isfinite(scales).all())
    y = dequantize_int8(q, scales, block, dtype)
    assert y.dtype == dtype and bool(torch.isfinite(y).all())
    _check(y, x, roundtrip_bound(x, block, y), f"{dtype} block {block}")


PATTERNS = ("normal", "outlier", "zero_blocks", "subnormal", "huge", "mixed_scales")


def _pattern(kind: str, n: int, block: int, exponent: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    nb = -(-n // block)
    if kind == "outlier":  # one element per block 10^4 larger than the rest
        idx = torch.arange(nb) * block + torch.randint(0, block, (nb,), generator=g)
        idx = idx[idx < n]
        x[idx] *= 1e4
    elif kind == "zero_blocks":
        x *= (torch.rand(nb, generator=g) < 0.5).double().repeat_interleave(block)[:n]
    elif kind == "subnormal":  # fp32 subnormals: scales below the normal range
        x = torch.randint(-2000, 2000, (n,), generator=g).double() * 2.0**-149
    elif kind == "huge":
        x = x / x.abs().max().clamp_min(1e-300) * torch.finfo(dtype).max
    elif kind == "mixed_scales":  # every block at its own magnitude, 2^-60 .. 2^60
        x *= (2.0 ** torch.randint(-60, 61, (nb,), generator=g).double()).repeat_interleave(block)[:n]
    if kind not in ("subnormal", "huge"):
        x *= 2.0**exponent
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


@pytest.mark.fuzz
@given(kind=st.sampled_from(PATTERNS), n=st.integers(1, 5000), block=st.sampled_from(BLOCKS + (128, 1000)),
       exponent=st.integers(-120, 100), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES))
def test_roundtrip_error_within_bound_for_large_patterned_tensors(kind, n, block, exponent, seed, dtype):
    if dtype == torch.float16:
        exponent = max(-20, min(exponent, 10))  # inside fp16's range
    x = _pattern(kind, n, block, exponent, seed, dtype)
    assert bool(torch.isfinite(x).all())
    q, scales = quantize_int8(x, block)
    y = dequantize_int8(q, scales, block, dtype)
    _check(y, x, roundtrip_bound(x, block, y), f"{kind} n={n} block={block} 2^{exponent} seed={seed} {dtype}")


@pytest.mark.fuzz
@given(values=st.lists(finite32, min_size=2, max_size=200), block=st.sampled_from((2, 3, 16)),
       where=st.integers(0, 10**6), bad=st.sampled_from((float("inf"), float("-inf"), float("nan"))))
def test_a_non_finite_value_makes_its_whole_block_non_finite_and_no_other(values, block, where, bad):
    x = torch.tensor(values, dtype=torch.float32)
    i = where % x.numel()
    x[i] = bad
    q, scales = quantize_int8(x, block)
    y = dequantize_int8(q, scales, block)
    b = i // block
    in_block = torch.zeros(x.numel(), dtype=torch.bool)
    in_block[b * block:(b + 1) * block] = True
    assert not bool(torch.isfinite(y[in_block]).any()), y[in_block]
    assert bool(torch.isfinite(y[~in_block]).all())
    _check(y[~in_block], x[~in_block], roundtrip_bound(x, block, y)[~in_block], "the finite blocks")


def test_zero_blocks_and_integer_grids_come_back_exactly():
    x = torch.cat([torch.zeros(256), torch.arange(-127, 129, dtype=torch.float32).clamp(-127, 127),
                   -torch.zeros(5)])
    q, scales = quantize_int8(x, 256)
    assert scales.tolist() == [0.0, 1.0, 0.0]
    assert torch.equal(dequantize_int8(q, scales, 256), x)
    assert torch.equal(q[256:512].to(torch.float32), x[256:512])


def test_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError):
        quantize_int8(torch.zeros(4, 4))
    with pytest.raises(ValueError):
        quantize_int8(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError):
        quantize_int8(torch.zeros(4), block=0)
    q, s = quantize_int8(torch.ones(10), 4)
    with pytest.raises(ValueError):
        dequantize_int8(q, s[:2], 4)


def test_wire_bytes():
    # 1 byte per element plus a 4-byte scale per block, padded to 4 bytes
    assert int8_wire_bytes(1024, 256) == 1024 + 16
    assert int8_wire_bytes(1000, 256) == 1000 + 16
    assert int8_wire_bytes(5, 2) == 5 + 12 + 3
    for n, numel, block in ((2, 4096, 256), (4, 1 << 20, 256), (3, 3 * 512, 128)):
        v = int8_collective_bytes(numel, n, block)
        assert v == numel + 4 * numel // block  # shards that are whole blocks of whole words
        sent = int8_sent_bytes(numel, n, block)
        assert sent == pytest.approx((n - 1) / n * (numel + numel / block * 4))
        assert sent == pytest.approx(ring_sent_bytes("all_gather", v, n))
        assert sent < (n - 1) / n * numel * 2 / 1.9  # about half of bf16's, a quarter of fp32's
    with pytest.raises(ValueError):
        int8_collective_bytes(10, 3)


# --- the collectives on gloo ---------------------------------------------------------------------

# (shard elements S, block): whole blocks, a short last block, blocks larger than the shard
SHAPES = ((512, 256), (301, 64), (37, 7), (5, 256))
INPUTS = (torch.float32, torch.bfloat16)


def _contribution(rank: int, world: int, s: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s N·S-element buffer (its gradient, or its shard when S = N·S/N): per-block
    magnitudes from 2^-20 to 2^20, one outlier per block, a zero block. Any rank can rebuild any other's."""
    x = _pattern("mixed_scales", world * s, block, 0, 1000 * rank + 10 * world + s, torch.float64)
    x = x.clamp(-2.0**40, 2.0**40)
    x[::block] *= 50.0  # an outlier at the start of every block
    x[: min(block, x.numel())] = 0.0  # a zero block
    return x.to(dtype)


def _checks_on(group) -> dict:
    """Every check on one process group; each rank asserts its own elements and returns the
    largest error/bound ratio per check and the bytes its handles reported."""
    import torch.distributed as dist

    from zerodp.engine.quant import all_gather_int8, reduce_scatter_int8

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: dict = {}
    for dtype in INPUTS:
        for s, block in SHAPES:
            key = f"{dtype}/S={s}/B={block}"
            shards = [_contribution(r, world, s, block, dtype)[:s] for r in range(world)]
            grads = [_contribution(r, world, s, block, dtype) for r in range(world)]
            full = torch.empty(world * s, dtype=dtype)
            outs = {o: torch.full((s,), 7.0, dtype=o) for o in (dtype, torch.float32)}
            # launch everything, then wait: the handles finish in any order
            h_ag = all_gather_int8(full, shards[rank], group, block=block)
            h_rs = {o: reduce_scatter_int8(y, grads[rank], group, block=block) for o, y in outs.items()}
            acc = torch.full((s,), 3.0)
            h_acc = reduce_scatter_int8(acc, grads[rank], group, block=block, accumulate=True)
            for h in (h_acc, *h_rs.values(), h_ag):
                assert h.wait() and h.is_completed()
            h_ag.wait()  # idempotent

            exact_full = torch.cat(shards)
            bound = torch.cat([roundtrip_bound(x, block, y) for x, y in zip(shards, full.split(s))])  # blocks per shard
            out[f"{key}/ag"] = _check(full, exact_full, bound, f"{key} AllGather")
            out[f"{key}/ag_bytes"] = (h_ag.nbytes, h_ag.sent_bytes)

            chunks = [g[rank * s:(rank + 1) * s] for g in grads]
            exact_mean = torch.stack([c.double() for c in chunks]).mean(0)
            # the exact fp32 collective: SUM then ÷N, as the engine's ReduceScatter does
            ref = torch.empty(s)
            reduce_scatter_flat(ref, grads[rank].float(), op=dist.ReduceOp.SUM, group=group)
            ref /= world
            ref_slack = 2**-23 * torch.stack([c.double().abs() for c in chunks]).sum(0)
            out[f"{key}/fp32_collective"] = _check(ref, exact_mean, ref_slack + 2**-149, f"{key} fp32 ReduceScatter")
            for o, y in outs.items():
                bound = mean_bound(chunks, block, y)
                out[f"{key}/rs->{o}"] = _check(y, exact_mean, bound, f"{key} ReduceScatter into {o}")
                _check(y, ref, bound + ref_slack + 2**-149, f"{key} ReduceScatter into {o} vs the fp32 collective")
            out[f"{key}/rs_acc"] = _check(acc, exact_mean + 3.0, mean_bound(chunks, block, acc) + 2**-24 * acc.abs(),
                                          f"{key} accumulating ReduceScatter")
            out[f"{key}/rs_bytes"] = (h_rs[dtype].nbytes, h_rs[dtype].sent_bytes)
    return out


def _collective_checks(rank: int, world: int) -> dict:
    """One spawned job of 3 ranks checks world sizes 3 (all ranks), 2 (ranks 0 and 1) and 1."""
    import torch.distributed as dist

    from zerodp.engine.quant import all_gather_int8, reduce_scatter_int8

    pair = dist.new_group([0, 1])  # every rank takes part in creating every group
    alone = [dist.new_group([r]) for r in range(world)][rank]
    out = {world: _checks_on(None)}
    if rank < 2:
        out[2] = _checks_on(pair)
    # a group of one rank sends nothing and quantizes nothing: the results are exact
    x = _contribution(rank, world, 300, 64, torch.float32)[:300]
    full, y = torch.empty(300), torch.empty(300)
    h1, h2 = all_gather_int8(full, x, alone, block=64), reduce_scatter_int8(y, x, alone, block=64)
    assert h1.wait() and h2.wait() and h1.sent_bytes == h2.sent_bytes == 0.0
    assert torch.equal(full, x) and torch.equal(y, x)
    return out


def _results() -> list[dict]:
    return spawn_once(_collective_checks, 3, timeout=120)


@pytest.mark.dist
@pytest.mark.parametrize("world", (2, 3))
def test_collectives_agree_with_the_exact_ones_within_the_bound(world):
    results = [r[world] for r in _results() if world in r]  # each rank asserted its elements
    assert len(results) == world
    for dtype in INPUTS:
        for s, block in SHAPES:
            key = f"{dtype}/S={s}/B={block}"
            want = (int8_collective_bytes(world * s, world, block), int8_sent_bytes(world * s, world, block))
            for r in results:
                assert r[f"{key}/ag_bytes"] == want and r[f"{key}/rs_bytes"] == want
                assert want[1] == pytest.approx((world - 1) * int8_wire_bytes(s, block))
    worst: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            if not k.endswith("bytes"):
                kind = k.rsplit("/", 1)[1]
                worst[kind] = max(worst.get(kind, 0.0), v)
    print(f"world {world}: largest error / bound by check:", {k: round(v, 6) for k, v in sorted(worst.items())})
    assert all(0.0 <= v <= 1.0 for v in worst.values())
