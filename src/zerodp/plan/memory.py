"""The memory ledger: model states per GPU for stages 0–3 and activations (seed §1, §8, §9).

Model states, bf16 mixed precision (seed §1): 2 bytes bf16 parameter, 2 bytes bf16 gradient and
k bytes of optimizer state per parameter (Adam: fp32 master 4 + m 4 + v 4, k = 12); 4 more
bytes for an fp32 gradient-accumulation buffer. Per GPU without activations (seed §9), with Ψ
parameters on N data-parallel ranks:

=========  ======================  ==========================
stage      bytes per GPU           + fp32 grad accumulation
=========  ======================  ==========================
0 (DP)     (2 + 2 + k)·Ψ           + 4Ψ
1 ZeRO-1   (2 + 2)·Ψ + k·Ψ/N       + 4Ψ
2 ZeRO-2   2Ψ + (2 + k)·Ψ/N        + 4Ψ/N
3 ZeRO-3   (2 + 2 + k)·Ψ/N         + 4Ψ/N
=========  ======================  ==========================

ZeRO-3 also holds two gathered units in bf16, the one in use and the one being prefetched
(seed §9.3); give their size with ``unit_params``.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), §4 with no tensor/sequence parallelism (t = 1), 16-bit
activations, s = sequence, b = micro-batch, h = hidden, a = heads, per layer:

* attention block 11·sbh + 5·a·s²·b, MLP block 19·sbh (for ffn = 4h; here 3·sbh + 4·sb·ffn),
  two LayerNorms 4·sbh: **none**: sbh·(34 + 5as/h);
* **selective** recomputation (recompute the attention core, the 5as²b part): 34·sbh;
* **full** recomputation (store only each layer's input): 2·sbh.

Plus, once per model, the paper's input/output terms: embedding dropout mask sbh, final LayerNorm
2sbh, output-layer input 2sbh and fp32 logits for the cross entropy 4·sb·vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.plan._common import ToDict, check_count, check_positive

BF16 = 2
FP32 = 4
#: seed §1: Adam's fp32 master weights, first and second moments: 4 + 4 + 4 bytes per parameter
ADAM_K = 12
#: ZeRO-3 keeps the unit in use plus the prefetched one (seed §9.3)
GATHERED_UNITS = 2
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelStates(ToDict):
    """Bytes per GPU of one stage. ``to_dict()`` keys: ``stage``, ``stage_name``, ``params``,
    ``n``, ``k``, ``fp32_grad_acc``, ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``,
    ``grad_acc_bytes``, ``gathered_unit_bytes``, ``model_state_bytes`` (the seed §9 column:
    parameters + gradients + optimizer + fp32 accumulation), ``total_bytes`` (+ gathered units),
    ``bytes_per_param`` (model_state_bytes / params), ``comm_elements_per_step`` (seed §9: 2Ψ for
    stages 0–2, 3Ψ for stage 3) and ``allgathers_per_step`` (stage 3: 2L−1, else 0 or null).
    """

    stage: int
    stage_name: str
    params: float
    n: int
    k: float
    fp32_grad_acc: bool
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    grad_acc_bytes: float
    gathered_unit_bytes: float
    model_state_bytes: float
    total_bytes: float
    bytes_per_param: float
    comm_elements_per_step: float
    allgathers_per_step: int | None


def model_states(params: float, n: int, stage: int, k: float = ADAM_K, fp32_grad_acc: bool = False,
                 unit_params: float = 0.0, layers: int | None = None) -> ModelStates:
    """Model-state bytes per GPU for ``stage`` (seed §9; table in the module docstring).

    ``unit_params``: parameters of one ZeRO-3 unit (two gathered units are added for stage 3);
    ``layers``: number of units L, for the 2L−1 AllGathers of stage 3.
    """
    check_positive("params", params)
    n = check_count("n (data-parallel GPUs)", n)
    check_positive("k (optimizer bytes per parameter)", k, allow_zero=True)
    check_positive("unit_params", unit_params, allow_zero=True)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0 (DP), 1, 2, 3 (ZeRO-1/2/3); got {stage!r}")
    if layers is not None:
        layers = check_count("layers", layers)
    shard = 1.0 / n
    p = BF16 * params * (shard if stage == 3 else 1.0)
    g = BF16 * params * (shard if stage >= 2 else 1.0)
    o = k * params * (shard if stage >= 1 else 1.0)
    acc = (FP32 * params * (shard if stage >= 2 else 1.0)) if fp32_grad_acc else 0.0
    gathered = GATHERED_UNITS * BF16 * unit_params if stage == 3 else 0.0
    states = p + g + o + acc
    return ModelStates(
        stage=stage, stage_name=STAGE_NAMES[stage], params=params, n=n, k=k,
        fp32_grad_acc=fp32_grad_acc, param_bytes=p, grad_bytes=g, optimizer_bytes=o,
        grad_acc_bytes=acc, gathered_unit_bytes=gathered, model_state_bytes=states,
        total_bytes=states + gathered, bytes_per_param=states / params,
        comm_elements_per_step=(3 if stage == 3 else 2) * params,
        allgathers_per_step=(2 * layers - 1 if layers else None) if stage == 3 else 0)


def all_stages(params: float, n: int, k: float = ADAM_K, fp32_grad_acc: bool = False,
               unit_params: float = 0.0, layers: int | None = None) -> list[ModelStates]:
    """:func:`model_states` for stages 0, 1, 2, 3."""
    return [model_states(params, n, s, k, fp32_grad_acc, unit_params, layers) for s in STAGES]


@dataclass(frozen=True)
class MaxParams(ToDict):
    """Largest model whose states fit: ``hbm_bytes``, ``bytes_per_param``, ``max_params``."""

    hbm_bytes: float
    bytes_per_param: float
    max_params: float


def max_params(hbm_bytes: float, bytes_per_param: float) -> MaxParams:
    """HBM / bytes-per-parameter: the absolute upper bound, no activations (seed §8).

    E.g. bf16 parameters + fp32 Adam moments = 10 bytes: a 96 GB TPU v5p holds ≈ 9.6B parameters.
    """
    check_positive("hbm_bytes", hbm_bytes)
    check_positive("bytes_per_param", bytes_per_param)
    return MaxParams(hbm_bytes, bytes_per_param, hbm_bytes / bytes_per_param)


@dataclass(frozen=True)
class Activations(ToDict):
    """Activation bytes per GPU for one micro-batch (Korthikanti et al. 2022, module docstring).

    ``to_dict()`` keys: the inputs (``layers``, ``hidden``, ``heads``, ``ffn``, ``vocab``, ``seq``,
    ``micro_batch``, ``recompute``), ``per_layer_bytes``, ``layers_bytes`` (per_layer × layers),
    ``head_bytes`` (embedding dropout, final LayerNorm, output layer, fp32 logits),
    ``total_bytes``.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    micro_batch: int
    recompute: str
    per_layer_bytes: float
    layers_bytes: float
    head_bytes: float
    total_bytes: float


def activations(layers: int, hidden: int, heads: int, seq: int, micro_batch: int = 1,
                ffn: int | None = None, vocab: int = 0, recompute: str = "none") -> Activations:
    """Activation memory of one micro-batch, 16-bit, no tensor parallelism (Korthikanti et al. 2022)."""
    layers, hidden, heads = (check_count(n, v) for n, v in
                             (("layers", layers), ("hidden", hidden), ("heads", heads)))
    seq, micro_batch = check_count("seq", seq), check_count("micro_batch", micro_batch)
    ffn = 4 * hidden if ffn is None else check_count("ffn", ffn)
    vocab = check_count("vocab", vocab, minimum=0)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {recompute!r}")
    s, b, h, a = seq, micro_batch, hidden, heads
    sbh = s * b * h
    attention = 11 * sbh + 5 * a * s * s * b
    mlp = 3 * sbh + 4 * s * b * ffn  # 19·sbh when ffn = 4h
    norms = 4 * sbh
    if recompute == "none":
        per_layer = attention + mlp + norms
    elif recompute == "selective":
        per_layer = attention - 5 * a * s * s * b + mlp + norms
    else:
        per_layer = 2 * sbh
    head = 5 * sbh + FP32 * s * b * vocab
    return Activations(layers, h, a, ffn, vocab, s, b, recompute, float(per_layer),
                       float(per_layer * layers), float(head), float(per_layer * layers + head))
