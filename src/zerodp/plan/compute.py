"""The step's compute on one device (guide §7, docs/planner.md "The compute model"): one
micro-batch's forward, backward and recomputation, and the optimizer step, priced from a
:class:`~zerodp.plan.hardware.Hardware` and the shape constants :data:`~zerodp.plan.hardware.COMPUTE`."""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.plan._common import ToDict
from zerodp.plan.hardware import COMPUTE, ComputeConstants, get_hardware, sustained
from zerodp.plan.memory import activations


@dataclass(frozen=True)
class ComputeTime(ToDict):
    """One micro-batch's compute on one device, and the optimizer step (:func:`step_compute`).
    ``to_dict()`` keys: ``forward_s``, ``backward_s`` (recomputation included), ``recompute_s``
    (the part of backward_s that is recomputation), ``optimizer_s``, ``matmul_s``,
    ``attention_s``, ``elementwise_s``, ``overhead_s`` (fwd + bwd + recompute of each),
    ``model_flops`` (forward + backward, no recomputation), ``efficiency`` (model FLOPs over
    peak × (forward + backward): the compute's MFU) and ``matmul_efficiency`` (the GEMM shape's
    sustained fraction of peak)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    optimizer_s: float
    matmul_s: float
    attention_s: float
    elementwise_s: float
    overhead_s: float
    model_flops: float
    efficiency: float
    matmul_efficiency: float


def _block_matmuls(m) -> list[float]:
    """Weights of one block's matrix multiplications in the order a forward runs them: a
    SwiGLU block's q, k, v, output, gate, up, down; otherwise a fused qkv, output, up, down."""
    h, q, kv, f = m.hidden, m.q_dim or m.hidden, m.kv_dim or m.hidden, m.ffn or 4 * m.hidden
    if m.gated_mlp:
        return [h * q, h * kv, h * kv, q * h, h * f, h * f, f * h]
    return [h * (q + 2 * kv), q * h, h * f, f * h]


def step_compute(model, hardware, seq: int, micro_batch: int = 1, recompute: str = "none",
                 params_stepped: float = 0.0, constants: ComputeConstants | None = None,
                 attention: str = "flash") -> ComputeTime:
    """One micro-batch of ``micro_batch`` × ``seq`` tokens through ``model`` (a Model with a
    shape) on ``hardware``, and AdamW over ``params_stepped`` parameters (module docstring).

    Forward: matmuls 2·t·A (A the active parameters that multiply, the input embedding's lookup
    excluded) at the GEMM's sustained rate; causal attention 2·L·s·q·t at FlashAttention's rate;
    elementwise traffic at HBM bandwidth; a per-layer overhead. Backward: twice the matmuls and
    overheads, ``attention_backward`` × the attention, twice the elementwise traffic. Recomputation
    adds what the mode runs again: ``selective`` the attention core's forward; ``op`` every second
    matmul of each block and its elementwise forward (saves the others' outputs and attention's);
    ``layer`` a whole block forward on every second block; ``full`` every block's forward."""
    c = COMPUTE if constants is None else constants
    hw = get_hardware(hardware)
    m = model
    m.require_shape("layers", "hidden", "heads")
    t = seq * micro_batch
    rate = sustained(hw)
    h = m.hidden
    mm_eff = h / (h + c.hidden_knee) * t / (t + c.token_knee) if t else 0.0
    mm_rate = rate["matmul_flops"] * mm_eff
    emb = float(m.vocab * m.hidden) if m.vocab else 0.0
    block_mm = (m.active_block_params or 0.0) * m.layers
    head_mm = emb if m.vocab else 0.0  # the output projection (tied or not) multiplies
    mm_fwd = 2.0 * t * block_mm / mm_rate
    head_fwd = 2.0 * t * head_mm / mm_rate
    attn_flops = 2.0 * m.layers * seq * (m.q_dim or h) * t
    attn_fwd = attn_flops / (rate["attention_flops"] * c.attention_scale)
    act = activations(m.layers, h, m.heads, seq, micro_batch, m.ffn or 4 * h, m.vocab or 0,
                      "none", q_dim=m.q_dim, kv_dim=m.kv_dim, gated_mlp=m.gated_mlp,
                      attention=attention)
    el_fwd = c.elementwise_passes * act.layers_bytes / rate["hbm_bw"]
    ov_fwd = c.layer_overhead_s * m.layers
    block_fwd = mm_fwd + attn_fwd + el_fwd + ov_fwd
    if recompute == "none":
        extra = 0.0
    elif recompute == "selective":
        extra = attn_fwd
    elif recompute == "op":
        mats = _block_matmuls(m)
        extra = mm_fwd * sum(mats[1::2]) / sum(mats) + el_fwd + ov_fwd
    elif recompute == "layer":
        extra = block_fwd / 2
    elif recompute == "full":
        extra = block_fwd
    else:
        raise ValueError(f"recompute must be one of none, selective, op, layer, full; got {recompute!r}")
    forward = block_fwd + head_fwd
    backward = 2 * (mm_fwd + head_fwd + el_fwd + ov_fwd) + c.attention_backward * attn_fwd + extra
    model_flops = 3 * (2.0 * t * (block_mm + head_mm) + attn_flops)
    opt = c.optimizer_bytes * params_stepped / rate["hbm_bw"]
    mfu = model_flops / (hw.flops * (forward + backward))
    return ComputeTime(forward, backward, extra, opt, 3 * (mm_fwd + head_fwd),
                       (1 + c.attention_backward) * attn_fwd, 3 * el_fwd, 3 * ov_fwd, model_flops,
                       mfu, rate["matmul_flops"] * mm_eff / hw.flops)
