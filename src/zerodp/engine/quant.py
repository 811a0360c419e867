"""Compressed collectives: blockwise int8 quantization and the two ZeRO++ collectives built on it
(guide §15).

- :func:`quantize_int8` / :func:`dequantize_int8`: symmetric int8 per block of ``block`` elements,
  one fp32 scale per block.
- :func:`all_gather_int8` (qwZ): the parameter AllGather of stages 1-3 with int8 on the wire.
- :func:`reduce_scatter_int8` (qgZ): the gradient ReduceScatter as one all-to-all of int8 chunks,
  each rank dequantizing and averaging its own chunk in fp32.
- :func:`int8_wire_bytes` / :func:`int8_sent_bytes`: the bytes those put on the wire, for the trace.

**Error bounds** (guide §15), per element, with ``m`` the largest magnitude in the element's block
of the *input* (the data, before quantization) and ``u·|x̂|`` the rounding of the cast to the
output dtype (u = 2^-8 bf16, 2^-11 fp16; 0 for fp32 and wider, whose rounding the fp32 slack
below covers; below a narrow dtype's normal range it is half its subnormal step instead):

- quantize → dequantize: ``|x − x̂| ≤ m/254·(1 + 2^-15) + 2^-148 + u·|x̂|``. In exact arithmetic
  the bound is half a quantization step, ``s/2 = m/254``; the factor ``1 + 2^-15`` is the fp32
  arithmetic of the scale, the division and the product, and ``2^-148`` matters only for blocks
  whose scale falls below fp32's normal range (``m < 127·2^-126``).
- :func:`all_gather_int8`: the same, element by element, against the exact gathered shards.
- :func:`reduce_scatter_int8` on ``N`` ranks: ``|y − (1/N)·Σ_r x_r| ≤ (1/N)·Σ_r m_r/254·(1 + 2^-15)
  + 2^-23·Σ_r m_r + 2^-147 + u·|y|``, ``m_r`` the block maximum of rank ``r``'s contribution. Each
  contribution is quantized exactly once; the sum is taken in fp32 (the ``2^-23`` term).
- the int8 AllReduce (guide §14.4; the DiLoCo outer loop's, :mod:`zerodp.engine.outer`):
  :func:`reduce_scatter_int8` then :func:`all_gather_int8` of the reduced chunks, fp32 out, the
  blocks of both aligned: ``|y − (1/N)·Σ_r x_r| ≤ M/127·(1 + 2^-7) + 2^-22·N·M + 2^-146`` with
  ``M = (1/N)·Σ_r m_r`` — the all-to-all's bound, plus half a step of the mean's own block
  maximum, which is at most ``M`` plus that bound.

Non-finite input is not hidden: a block holding inf or NaN gets an inf or NaN scale, so every
element of it dequantizes to inf or NaN and a non-finite check after the collective still fires.
A block of zeros gets scale 0 and comes back as exact zeros.

Asynchronous shape: both collectives launch at once and return a :class:`QuantizedWork`; its
``wait()`` waits for the transfer and then dequantizes into the output (once, idempotent). It
carries ``nbytes`` (V on the wire) and ``sent_bytes`` (what this rank sends), so a caller that
records collectives can use it as the ``work`` of a pending collective.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

INT8_MAX = 127
# the two flat-tensor collectives under their torch 2.13 names, or the older ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_FP32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------

def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of a 2-D (rows, n) tensor on its own: int8 (rows, n), fp32 scales
    (rows, ceil(n/block)). A row whose length is not a multiple of ``block`` ends in a short
    block (zero-padded internally; zeros change no block maximum)."""
    rows, n = x.shape
    nb = _blocks(n, block)
    xf = x.to(torch.float32)
    if nb * block != n:
        xf = torch.nn.functional.pad(xf, (0, nb * block - n))
    xf = xf.reshape(rows, nb, block)
    # max|x| as max(max x, −min x): two reductions over x, no |x| copy (several times faster on CPU);
    # NaN if the block holds a NaN (both propagate it), inf if it holds an inf.
    amax = torch.maximum(xf.amax(dim=2), xf.amin(dim=2).neg_())
    scale = amax / INT8_MAX
    # Make s an fp32 value with 127·s ≥ m (no clamping, which matters where s is subnormal and the
    # division lost most of its digits) and 127·s ≤ fp32 max (no overflow on the way back).
    s64, m64 = scale.double(), amax.double()
    scale = torch.where(s64 * INT8_MAX < m64, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    over = (scale.double() * INT8_MAX > _FP32_MAX) & torch.isfinite(scale)  # an inf/NaN scale stays so
    scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero block divides by 1
    t = xf / divisor.unsqueeze(2)
    t.round_()  # |x|/s ≤ 127 where s is finite: 127·s ≥ m above, and the division rounds monotonically
    if x.device.type != "cpu" or not bool(torch.isfinite(scale).all()):  # (no host sync on a GPU)
        t.clamp_(-INT8_MAX, INT8_MAX).nan_to_num_(0.0)  # NaN only in non-finite blocks
    q = t.to(torch.int8).view(rows, nb * block)
    if nb * block != n:
        q = q[:, :n].contiguous()
    return q, scale


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 (rows, n) from int8 (rows, n) and scales (rows, ceil(n/block))."""
    rows, n = q.shape
    nb = scales.shape[1]
    qf = q.to(torch.float32)
    if nb * block != n:
        qf = torch.nn.functional.pad(qf, (0, nb * block - n))
    out = qf.view(rows, nb, block).mul_(scales.unsqueeze(2)).view(rows, nb * block)
    return out[:, :n] if nb * block != n else out


def quantize_int8(x: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric int8 quantization of a 1-D float tensor (guide §15).

    Per block of ``block`` consecutive elements, ``s = max|x|/127`` (fp32) and
    ``q = round(x/s)`` in [−127, 127]. Any length works: the last block may be shorter (it is
    zero-padded internally; ``q`` has ``x.numel()`` elements, ``scales`` ``ceil(numel/block)``).
    A zero block gets ``s = 0``; a block holding inf/NaN gets an inf/NaN scale. ``s`` is rounded
    so that ``127·s ≥ max|x|`` and ``127·s`` stays finite. Returns ``(q int8, scales fp32)``.

    Error of :func:`dequantize_int8` of the result: ``|x − x̂| ≤ m/254·(1 + 2^-15) + 2^-148``
    per element (``m`` = its block's max magnitude; = ``s/2`` in exact arithmetic), plus the
    rounding of the output dtype."""
    _check_block(block)
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"quantize_int8 takes a 1-D float tensor, got {x.dim()}-D {x.dtype}")
    q, scales = _quantize_rows(x.view(1, -1), block)
    return q.view(-1), scales.view(-1)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int = 256,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_int8`: ``x̂ = q·s`` computed in fp32, then cast to
    ``out_dtype`` (that cast adds its rounding, ``u·|x̂|`` with u its unit roundoff; guide §15)."""
    _check_block(block)
    if q.dim() != 1 or q.dtype != torch.int8:
        raise ValueError(f"dequantize_int8 takes a 1-D int8 tensor, got {q.dim()}-D {q.dtype}")
    if scales.numel() != _blocks(q.numel(), block):
        raise ValueError(f"{q.numel()} elements in blocks of {block} need {_blocks(q.numel(), block)} scales, "
                         f"got {scales.numel()}")
    out = _dequantize_rows(q.view(1, -1), scales.to(torch.float32).view(1, -1), block).view(-1)
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# wire format and byte accounting
# ---------------------------------------------------------------------------------------------

def int8_wire_bytes(numel: int, block: int = 256) -> int:
    """Bytes one rank's piece of ``numel`` elements takes on the wire: ``4·ceil(numel/block)``
    bytes of fp32 scales, then ``numel`` int8 values, padded to a multiple of 4 bytes (so the next
    piece's scales stay aligned). About ``1 + 4/block`` bytes per element (guide §15)."""
    _check_block(block)
    raw = 4 * _blocks(numel, block) + numel
    return raw + (-raw) % 4


def int8_collective_bytes(full_numel: int, world_size: int, block: int = 256) -> int:
    """V on the wire for :func:`all_gather_int8` / :func:`reduce_scatter_int8` over a full buffer
    of ``full_numel`` elements: ``N`` pieces of ``full_numel/N`` elements each."""
    if world_size < 1 or full_numel % world_size:
        raise ValueError(f"a buffer of {full_numel} elements does not split into {world_size} equal pieces")
    return world_size * int8_wire_bytes(full_numel // world_size, block)


def int8_sent_bytes(full_numel: int, world_size: int, block: int = 256) -> float:
    """Bytes one rank sends, ring-equivalent: ``(N−1)/N·V`` with V from :func:`int8_collective_bytes`,
    i.e. ``(N−1)/N·(numel + 4·numel/block)`` up to padding. The AllGather's ring passes N−1 pieces
    on; the all-to-all sends its N−1 foreign pieces directly — the same count (guide §15)."""
    v = int8_collective_bytes(full_numel, world_size, block)
    return (world_size - 1) / world_size * v


def _pack(q: torch.Tensor, scales: torch.Tensor, piece_bytes: int) -> torch.Tensor:
    """(rows, piece_bytes) uint8: each row's scales (fp32 bytes) then its int8 values."""
    rows, n = q.shape
    nb = scales.shape[1]
    buf = torch.zeros(rows, piece_bytes, dtype=torch.uint8, device=q.device)
    buf[:, :4 * nb].view(torch.float32).copy_(scales)
    buf[:, 4 * nb:4 * nb + n].view(torch.int8).copy_(q)
    return buf


def _unpack(buf: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = _blocks(n, block)
    return buf[:, 4 * nb:4 * nb + n].view(torch.int8), buf[:, :4 * nb].view(torch.float32)


# ---------------------------------------------------------------------------------------------
# the collectives
# ---------------------------------------------------------------------------------------------

class QuantizedWork:
    """A launched compressed collective (guide §15). ``wait()`` blocks until the transfer is done,
    then dequantizes into the output tensor; calling it again does nothing. ``nbytes`` is V on the
    wire, ``sent_bytes`` what this rank sends (ring-equivalent)."""

    def __init__(self, work: object | None, finish: Callable[[], None], nbytes: int, sent_bytes: float,
                 keep: tuple = ()):
        self.work = work
        self._finish: Callable[[], None] | None = finish
        self._keep = keep  # the send buffer, alive until the transfer completed
        self.nbytes = nbytes
        self.sent_bytes = sent_bytes

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:
            if self.work is not None:
                self.work.wait() if timeout is None else self.work.wait(timeout)
            finish, self._finish = self._finish, None
            finish()
            self._keep = ()
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` ran (the output holds the result)."""
        return self._finish is None


def _check_split(full: torch.Tensor, piece: torch.Tensor, world: int, what: str) -> None:
    if full.dim() != 1 or piece.dim() != 1 or not full.is_contiguous() or not piece.is_contiguous():
        raise ValueError(f"{what} takes contiguous 1-D tensors")
    if not full.is_floating_point() or not piece.is_floating_point():
        raise ValueError(f"{what} takes float tensors, got {full.dtype} and {piece.dtype}")
    if full.numel() != world * piece.numel():
        raise ValueError(f"{what}: full has {full.numel()} elements, not {world} × {piece.numel()}")


def all_gather_int8(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None,
                    block: int = 256, async_op: bool = True) -> QuantizedWork:
    """qwZ (guide §15): ``full`` ← every rank's ``shard``, quantized to int8 per block, gathered in
    rank order and dequantized into ``full``'s dtype.

    Each rank quantizes its shard (the compute-dtype parameters, never the fp32 master), packs
    scales and values into one byte buffer (:func:`int8_wire_bytes`) and joins one AllGather of
    those buffers. Every rank dequantizes every piece, its own included, so all ranks hold the same
    ``full``. Returns a :class:`QuantizedWork`: ``full`` holds the result once its ``wait()``
    returned (at once with ``async_op=False``). With one rank nothing is sent or quantized:
    ``full`` is a copy of ``shard``.

    Error per element: ``|x − x̂| ≤ m/254·(1 + 2^-15) + 2^-148 + u·|x̂|`` (module docstring)."""
    _check_block(block)
    world = dist.get_world_size(group)
    _check_split(full, shard, world, "all_gather_int8")
    n = shard.numel()
    nbytes = int8_collective_bytes(full.numel(), world, block)
    if world == 1:
        full.copy_(shard)
        return QuantizedWork(None, lambda: None, nbytes, 0.0)
    piece = int8_wire_bytes(n, block)
    q, scales = _quantize_rows(shard.view(1, n), block)
    send = _pack(q, scales, piece).view(-1)
    recv = torch.empty(world * piece, dtype=torch.uint8, device=shard.device)
    work = _all_gather_flat(recv, send, group=group, async_op=True)

    def finish() -> None:
        rq, rs = _unpack(recv.view(world, piece), n, block)
        full.view(world, n).copy_(_dequantize_rows(rq, rs, block))

    handle = QuantizedWork(work, finish, nbytes, int8_sent_bytes(full.numel(), world, block),
                           keep=(send,))
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter_int8(shard_out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
                        block: int = 256, async_op: bool = True, accumulate: bool = False) -> QuantizedWork:
    """qgZ (guide §15): ``shard_out`` ← (its value +, with ``accumulate``) the mean over ranks of
    this rank's 1/N chunk of ``full``, with int8 on the wire.

    ``full`` (N·S elements) is cut into N chunks of S; each chunk is quantized on its own and the
    packed chunks go through one ``all_to_all_single``, chunk ``j`` to rank ``j``. Rank ``j``
    dequantizes the N chunks it received to fp32, sums them in fp32, divides by N and writes the
    result in ``shard_out``'s dtype. Every contribution is quantized exactly once, so the error
    does not grow with the ring's N−1 hops (it would if partial sums were re-quantized). Returns a
    :class:`QuantizedWork`: ``shard_out`` holds the result once its ``wait()`` returned (at once
    with ``async_op=False``). With one rank nothing is sent or quantized.

    Error per element: ``|y − mean| ≤ (1/N)·Σ_r m_r/254·(1 + 2^-15) + 2^-23·Σ_r m_r + 2^-147
    + u·|y|`` (module docstring). Transient memory: an fp32 copy of ``full`` while quantizing, and
    N fp32 chunks (one ``full``'s worth) while summing."""
    _check_block(block)
    world = dist.get_world_size(group)
    _check_split(full, shard_out, world, "reduce_scatter_int8")
    n = shard_out.numel()
    nbytes = int8_collective_bytes(full.numel(), world, block)

    def write(mean: torch.Tensor) -> None:
        shard_out.add_(mean) if accumulate else shard_out.copy_(mean)

    if world == 1:
        write(full)
        return QuantizedWork(None, lambda: None, nbytes, 0.0)
    piece = int8_wire_bytes(n, block)
    q, scales = _quantize_rows(full.view(world, n), block)
    send = _pack(q, scales, piece).view(-1)
    del q, scales
    recv = torch.empty(world * piece, dtype=torch.uint8, device=full.device)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def finish() -> None:
        rq, rs = _unpack(recv.view(world, piece), n, block)
        total = _dequantize_rows(rq, rs, block).sum(dim=0, dtype=torch.float32)
        write(total.div_(world))

    handle = QuantizedWork(work, finish, nbytes, int8_sent_bytes(full.numel(), world, block),
                           keep=(send,))
    if not async_op:
        handle.wait()
    return handle
