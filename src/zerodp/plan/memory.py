"""The memory ledger: model states per GPU for stages 0–3 and activations (guide §1, §8, §9).

Model states, bf16 mixed precision (guide §1): 2 bytes bf16 parameter, 2 bytes bf16 gradient and
k bytes of optimizer state per parameter (Adam: fp32 master 4 + m 4 + v 4, k = 12); 4 more
bytes for an fp32 gradient-accumulation buffer. Per GPU without activations (guide §9), with Ψ
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
(guide §9.3); give their size with ``unit_params``.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), §4 with no tensor/sequence parallelism (t = 1), 16-bit
activations, s = sequence, b = micro-batch, h = hidden, a = heads, per layer:

* attention block 11·sbh + 5·a·s²·b, MLP block 19·sbh (for ffn = 4h; here 3·sbh + 4·sb·ffn),
  two LayerNorms 4·sbh: **none** with **eager** attention: sbh·(34 + 5as/h);
* **selective** recomputation (recompute the attention core, the 5as²b part): 34·sbh;
* **full** recomputation (store only each layer's input): 2·sbh;
* **op** (selective by operator, as torchtitan's "selective op" checkpointing): each block keeps
  its input, the outputs of every second matrix multiplication (the 1st, 3rd, ...: q, v, gate and
  down of a SwiGLU block; the fused qkv and up of a GELU one) and attention's output with its
  fp32 log-sum-exp, and recomputes the rest;
* **layer** (every second block fully recomputed, torchtitan's "selective layer" with 2): the mean
  of none and full.

``op`` and ``layer`` are priced for published runs and on request; recommend searches
:data:`RECOMPUTE` (none, selective, full).

The attention implementation is a separate input (guide §8): **flash** (FlashAttention / SDPA, the
default, what practitioners run) never stores the a·s²·b scores, softmax or its dropout mask (it
recomputes them inside its backward), so "none" with flash stores 34·sbh like selective;
**eager** attention stores them. Recomputation (none / selective / full) is what the training
loop recomputes on top.

Plus, once per model, the paper's input/output terms: embedding dropout mask sbh, final LayerNorm
2sbh, output-layer input 2sbh, and the loss's peak where the paper counts fp32 logits alone
(4·sb·vocab): the logits upcast to fp32, the log-softmax the cross entropy saves for backward
and its gradient, all fp32 and alive together when backward starts (:data:`LOSS_PEAK_BYTES`
= 12 bytes per logit; docs/planner.md, "Memory against published runs").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from zerodp.plan._common import BF16, InputError, ToDict, check_count, check_positive, fmt_bytes
from zerodp.plan.defaults import ATTENTION, DEFAULTS
from zerodp.plan.units import STAGE_NAMES, STAGES  # noqa: F401 - re-exported

FP32 = 4
#: guide §1: Adam's fp32 master weights, first and second moments: 4 + 4 + 4 bytes per parameter
ADAM_K = 12
#: ZeRO-3 keeps the unit in use plus the prefetched one (guide §9.3)
GATHERED_UNITS = 2
RECOMPUTE = ("none", "selective", "full")
#: every recomputation the activation and compute models price (``op``, ``layer``: module docstring)
RECOMPUTE_MODES = RECOMPUTE + ("op", "layer")
#: bytes per logit at the loss's peak: fp32 logits, their log-softmax and its gradient (module
#: docstring)
LOSS_PEAK_BYTES = 3 * FP32
#: the default recomputation (zerodp.plan.defaults): none; with the default flash attention it
#: stores no a·s² scores
DEFAULT_RECOMPUTE = DEFAULTS["memory"]["recompute"]
DEFAULT_ATTENTION = DEFAULTS["memory"]["attention"]
#: fraction of HBM a plan leaves free (docs/planner.md, "fits and tight"): the CUDA context
#: (~0.5 GB), NCCL's buffers (~1 GB on 8 GPUs), the caching allocator's fragmentation and
#: temporaries (the cross entropy, optimizer steps); a total above HBM × (1 − HEADROOM) is "tight"
HEADROOM = 0.10


def verdict(total_bytes: float, hbm_bytes: float, headroom: float = HEADROOM) -> str:
    """"fits" (≤ HBM × (1 − headroom)), "tight" (above that, ≤ HBM) or "no" (above HBM); bytes
    are bytes, GB in tables is 1e9 of them (guide §8)."""
    if total_bytes <= hbm_bytes * (1 - headroom):
        return "fits"
    return "tight" if total_bytes <= hbm_bytes else "no"


@dataclass(frozen=True)
class ModelStates(ToDict):
    """Bytes per GPU of one stage. ``to_dict()`` keys: ``stage``, ``stage_name``, ``params``,
    ``n``, ``k``, ``fp32_grad_acc``, ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``,
    ``grad_acc_bytes``, ``gathered_unit_bytes``, ``model_state_bytes`` (the guide §9 column:
    parameters + gradients + optimizer + fp32 accumulation), ``total_bytes`` (+ gathered units),
    ``bytes_per_param`` (model_state_bytes / params), ``comm_elements_per_step`` (guide §9: 2Ψ for
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
                 unit_params: float = 0.0, layers: int | None = None, param_bytes: float = BF16,
                 grad_bytes: float = BF16, root_params: float = 0.0) -> ModelStates:
    """Model-state bytes per GPU for ``stage`` (guide §9; table in the module docstring).

    ``unit_params``: parameters of one ZeRO-3 unit (two gathered units are added for stage 3);
    ``layers``: number of units L, for the 2L−1 AllGathers of stage 3; ``param_bytes`` and
    ``grad_bytes``: bytes of one working parameter and one gradient (bf16: 2, see
    :data:`PRECISIONS`); ``root_params``: the engine's root unit (embedding, head, final norm:
    what is not in a block), gathered for the whole forward and backward (guide §10.3), so
    stage 3 holds 2·unit + root parameters gathered.
    """
    check_positive("params", params)
    n = check_count("n (data-parallel GPUs)", n)
    check_positive("k (optimizer bytes per parameter)", k, allow_zero=True)
    check_positive("unit_params", unit_params, allow_zero=True)
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0 (DP), 1, 2, 3 (ZeRO-1/2/3); got {stage!r}")
    if layers is not None:
        layers = check_count("layers", layers)
    check_positive("param_bytes", param_bytes)
    check_positive("grad_bytes", grad_bytes)
    shard = 1.0 / n
    p = param_bytes * params * (shard if stage == 3 else 1.0)
    g = grad_bytes * params * (shard if stage >= 2 else 1.0)
    o = k * params * (shard if stage >= 1 else 1.0)
    acc = (FP32 * params * (shard if stage >= 2 else 1.0)) if fp32_grad_acc else 0.0
    check_positive("root_params", root_params, allow_zero=True)
    gathered = (param_bytes * (GATHERED_UNITS * unit_params + root_params)) if stage == 3 else 0.0
    states = p + g + o + acc
    return ModelStates(
        stage=stage, stage_name=STAGE_NAMES[stage], params=params, n=n, k=k,
        fp32_grad_acc=fp32_grad_acc, param_bytes=p, grad_bytes=g, optimizer_bytes=o,
        grad_acc_bytes=acc, gathered_unit_bytes=gathered, model_state_bytes=states,
        total_bytes=states + gathered, bytes_per_param=states / params,
        comm_elements_per_step=(3 if stage == 3 else 2) * params,
        allgathers_per_step=(2 * layers - 1 if layers else None) if stage == 3 else 0)


def all_stages(params: float, n: int, k: float = ADAM_K, fp32_grad_acc: bool = False,
               unit_params: float = 0.0, layers: int | None = None, param_bytes: float = BF16,
               grad_bytes: float = BF16, root_params: float = 0.0) -> list[ModelStates]:
    """:func:`model_states` for stages 0, 1, 2, 3."""
    return [model_states(params, n, s, k, fp32_grad_acc, unit_params, layers, param_bytes,
                         grad_bytes, root_params) for s in STAGES]


@dataclass(frozen=True)
class MaxParams(ToDict):
    """Largest model whose states fit: ``hbm_bytes``, ``bytes_per_param``, ``max_params``."""

    hbm_bytes: float
    bytes_per_param: float
    max_params: float


def max_params(hbm_bytes: float, bytes_per_param: float) -> MaxParams:
    """HBM / bytes-per-parameter: the absolute upper bound, no activations (guide §8).

    E.g. bf16 parameters + fp32 Adam moments = 10 bytes: a 96 GB TPU v5p holds ≈ 9.6B parameters.
    """
    check_positive("hbm_bytes", hbm_bytes)
    check_positive("bytes_per_param", bytes_per_param)
    return MaxParams(hbm_bytes, bytes_per_param, hbm_bytes / bytes_per_param)


@dataclass(frozen=True)
class Activations(ToDict):
    """Activation bytes per GPU for one micro-batch (Korthikanti et al. 2022, module docstring).

    ``to_dict()`` keys: the inputs (``layers``, ``hidden``, ``heads``, ``ffn``, ``vocab``, ``seq``,
    ``micro_batch``, ``recompute``, ``attention``), ``per_layer_bytes``, ``layers_bytes`` (per_layer × layers),
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
    attention: str = DEFAULT_ATTENTION


def check_attention(attention: str) -> str:
    """``attention`` if it is one of :data:`~zerodp.plan.defaults.ATTENTION`, else InputError."""
    if attention not in ATTENTION:
        raise InputError(f"attention must be one of {', '.join(ATTENTION)} (flash: FlashAttention/"
                         f"SDPA, no s x s scores stored; eager: stores them); got {attention!r}",
                         "attention", f"attention 必须是 {'、'.join(ATTENTION)} 之一，收到的是 {attention!r}")
    return attention


def activations(layers: int, hidden: int, heads: int, seq: int, micro_batch: int = 1,
                ffn: int | None = None, vocab: int = 0, recompute: str = "none",
                q_dim: int | None = None, kv_dim: int | None = None,
                gated_mlp: bool = False, attention: str = DEFAULT_ATTENTION) -> Activations:
    """Activation memory of one micro-batch, 16-bit, no tensor parallelism (Korthikanti et al. 2022).

    ``attention``: "flash" (default) stores no a·s²·b scores whatever ``recompute`` is; "eager"
    stores them unless ``recompute`` is selective or full (module docstring, guide §8).

    ``q_dim``/``kv_dim``: widths of the queries and of the keys (= values) when they differ from
    ``hidden`` (grouped-query attention stores smaller K and V); ``gated_mlp``: a SwiGLU MLP
    stores its gate, up, activated gate and product (8·sb·ffn) where a GELU MLP stores 4·sb·ffn.
    """
    layers, hidden, heads = (check_count(n, v) for n, v in
                             (("layers", layers), ("hidden", hidden), ("heads", heads)))
    seq, micro_batch = check_count("seq", seq), check_count("micro_batch", micro_batch)
    ffn = 4 * hidden if ffn is None else check_count("ffn", ffn)
    vocab = check_count("vocab", vocab, minimum=0)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {recompute!r}")
    attn_impl = check_attention(attention)
    s, b, h, a = seq, micro_batch, hidden, heads
    qd = h if q_dim is None else check_count("q_dim", q_dim)
    kvd = h if kv_dim is None else check_count("kv_dim", kv_dim)
    sbh = s * b * h
    # input 2sbh, Q 2·sb·q, K and V 2·sb·kv each, attention output 2·sb·q, dropout mask sbh: 11sbh
    # for plain multi-head attention; the a·s²·b scores, softmax and its dropout: 5as²b
    attention = 3 * sbh + 4 * s * b * qd + 4 * s * b * kvd + 5 * a * s * s * b
    mlp = 3 * sbh + (8 if gated_mlp else 4) * s * b * ffn  # 19·sbh when ffn = 4h, not gated
    norms = 4 * sbh
    if recompute == "none" and attn_impl == "eager":
        per_layer = attention + mlp + norms
    elif recompute in ("none", "selective"):
        per_layer = attention - 5 * a * s * s * b + mlp + norms
    elif recompute == "op":  # input, every second matmul's output, attention's output and lse
        kept = [qd, ffn, h] if gated_mlp else [qd + 2 * kvd, ffn]
        per_layer = 2 * sbh + 2 * s * b * (sum(kept) + (kvd if gated_mlp else 0) + qd) \
            + FP32 * a * s * b
    elif recompute == "layer":
        per_layer = (attention - 5 * a * s * s * b + mlp + norms + 2 * sbh) / 2
    else:
        per_layer = 2 * sbh
    head = 5 * sbh + LOSS_PEAK_BYTES * s * b * vocab
    return Activations(layers, h, a, ffn, vocab, s, b, recompute, float(per_layer),
                       float(per_layer * layers), float(head), float(per_layer * layers + head),
                       attn_impl)


#: working-parameter bytes, gradient bytes and default optimizer bytes k per precision (guide §1):
#: bf16 mixed precision keeps an fp32 master copy and fp32 Adam moments (4 + 4 + 4); fp32 training
#: needs no master copy (k = 8); fp8 parameters keep a bf16 master copy (2) and fp32 moments (8)
PRECISIONS = {
    "bf16": {"param_bytes": 2, "grad_bytes": 2, "k": 12, "master_bytes": 4,
             "about": "bf16 parameters and gradients, fp32 master weights and Adam moments"},
    "fp32": {"param_bytes": 4, "grad_bytes": 4, "k": 8, "master_bytes": 0,
             "about": "fp32 parameters and gradients, fp32 Adam moments"},
    "fp8": {"param_bytes": 1, "grad_bytes": 2, "k": 10, "master_bytes": 2,
            "about": "fp8 parameters, bf16 gradients and master weights, fp32 Adam moments"},
}
#: bounds that keep every answer meaningful and quick; each says why in :func:`check_bounds`
MAX_GPUS = 1_000_000        # more accelerators than any cluster holds
MAX_PARAMS = 1e15           # a thousand trillion parameters
MAX_SEQ = 10_000_000        # ten million tokens per sequence
MAX_MICRO_BATCH = 1_000_000
MAX_K = 64                  # optimizer bytes per parameter: Adam with fp64 states is 24


def check_range(name: str, value: float, low: float, high: float, why: str = "",
                integer: bool = False, field: str | None = None) -> float:
    """``value`` if ``low <= value <= high`` (and whole when ``integer``), else ValueError with
    one sentence that names ``name``, the range and why."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")):
        raise InputError(f"{name} must be a number, got {value!r}", field,
                         f"{name} 必须是数，收到的是 {value!r}")
    if integer and not float(value).is_integer():
        raise InputError(f"{name} must be a whole number, got {value:g}", field,
                         f"{name} 必须是整数，收到的是 {value:g}")
    if not low <= value <= high:
        from zerodp.plan._common import fmt_count
        reason = f" ({why})" if why else ""
        raise InputError(f"{name} must be between {fmt_count(low)} and {fmt_count(high)}{reason}, "
                         f"got {fmt_count(value)}", field,
                         f"{name} 必须在 {fmt_count(low)} 到 {fmt_count(high)} 之间，收到的是 "
                         f"{fmt_count(value)}")
    return int(value) if integer else value


def check_shard_size(n: int, shard_size: int | None) -> int:
    """The shard-group size g of hybrid sharding (guide §14) for ``n`` ranks: ``None`` → n
    (flat); otherwise a divisor of n, else one sentence."""
    n = check_count("n (data-parallel GPUs)", n)
    if shard_size is None:
        return n
    if isinstance(shard_size, bool) or not float(shard_size).is_integer() or shard_size < 1:
        raise InputError(f"shard size must be a whole number >= 1, got {shard_size!r}", "shard_size",
                         f"分片组大小必须是不小于 1 的整数，收到的是 {shard_size!r}")
    g = int(shard_size)
    if g > n or n % g:
        raise InputError(f"shard size {g} does not divide the {n} GPUs into equal shard groups: "
                         f"choose a divisor of {n} (e.g. the GPUs per node), or no shard size for flat "
                         f"sharding over all {n}",
                         "shard_size", f"分片组大小 {g} 不能把 {n} 张卡均分成若干组：请选 {n} 的约数，"
                         f"或留空表示在全部 {n} 张卡上分片")
    return g


@dataclass(frozen=True)
class MemoryPlan(ToDict):
    """The whole bill per GPU for stages 0–3 and whether it fits: ``to_dict()`` keys ``model``,
    ``n``, ``hardware``, ``hbm_bytes``, ``precision``, ``param_bytes``, ``grad_bytes``, ``k``,
    ``fp32_grad_acc``, ``seq``, ``micro_batch``, ``recompute``, ``attention``, ``stages`` (each a
    :class:`ModelStates` dict whose ``total_bytes`` here is states + gathered units +
    activations, with ``activation_bytes`` and ``fits``: total ≤ HBM), ``activations`` (or null),
    ``includes`` (what the total counts, in words), ``warnings`` (figures that rest on an
    assumption), ``assumed_shape`` ([layers, hidden] guessed from Ψ, or null), and
    ``includes_zh``/``warnings_zh``, the same in Chinese, ``shard_size`` (g: the GPUs each
    stage shards over, = n when flat; guide §14) and ``replicas`` (n/g).

    Every "fits" the CLI, ``/api/memory`` and the page show is ``stages[i]["fits"]``."""

    model: dict
    n: int
    hardware: str
    hbm_bytes: float
    precision: str
    param_bytes: float
    grad_bytes: float
    k: float
    fp32_grad_acc: bool
    seq: int | None
    micro_batch: int
    recompute: str
    stages: list
    activations: dict | None
    includes: list
    warnings: list
    assumed_shape: list | None
    includes_zh: list
    warnings_zh: list
    shard_size: int | None = None
    replicas: int = 1
    optimizer: str = "adamw"
    attention: str = DEFAULT_ATTENTION


def memory_plan(model, n: int, hardware, precision: str = "bf16", k: float | None = None,
                fp32_grad_acc: bool = False, seq: int | None = None, micro_batch: int = 1,
                recompute: str | None = None, shard_size: int | None = None,
                headroom: float = HEADROOM, optimizer: str = "adamw",
                attention: str = DEFAULT_ATTENTION) -> MemoryPlan:
    """Model states, ZeRO-3's two gathered units (from the model's largest block) and the
    activations of one micro-batch (when ``seq`` is given), per GPU, for stages 0–3, against the
    HBM of ``hardware`` (a :class:`~zerodp.plan.Hardware` or preset name). ``shard_size``: hybrid
    sharding (guide §14), stages 1–3 shard over groups of g GPUs, a divisor of ``n``; the
    states are the flat ones with N → g. None: flat, g = n. ``recompute`` (None:
    :data:`DEFAULT_RECOMPUTE`) and ``attention`` ("flash", the default, or "eager") shape the
    activations (:func:`activations`). Each stage's ``verdict`` is
    :func:`verdict` with ``headroom``; ``fits`` is verdict == "fits".

    ``optimizer``: "adamw" (the k column above) or one that reads whole tensors, "adafactor" or
    "muon" (Muon on the blocks' matrices, AdamW on the rest): stages 1–3 then hold what tensor
    ownership gives the fullest rank (:mod:`zerodp.plan.ownership`, guide §12.3), each stage row
    with an ``ownership`` dict; ``k`` is then the mean bytes per parameter (master + states)."""
    if recompute is None:
        recompute = DEFAULT_RECOMPUTE
    check_attention(attention)
    from zerodp.plan.hardware import get_hardware
    from zerodp.plan.models import assumed_shape, get_model

    m = get_model(model)
    hw = get_hardware(hardware)
    n = int(check_range("n (data-parallel GPUs)", n, 1, MAX_GPUS,
                        "no cluster holds more than a million", integer=True, field="n"))
    check_range("params", m.params, 1, MAX_PARAMS, "a thousand trillion at most", field="params")
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}",
                         "precision", f"精度必须是 {'、'.join(PRECISIONS)} 之一，收到的是 {precision!r}")
    prec = PRECISIONS[precision]
    k_given = k is not None
    k = float(prec["k"] if k is None else check_range("k (optimizer bytes per parameter)", k, 0,
                                                      MAX_K, "Adam with fp64 states needs 24",
                                                      field="k"))
    from zerodp.plan.ownership import PER_TENSOR, check_optimizer, model_tensors
    owned = check_optimizer(optimizer) in PER_TENSOR
    if owned and k_given:
        raise InputError(f"k (--k) sets the bytes per parameter of an elementwise optimizer; {optimizer} "
                         "is priced tensor by tensor: drop --k, or choose optimizer adamw", "k",
                         f"k 是按元素的优化器每参数的字节数；{optimizer} 按张量计算：请清空 k，或选择 adamw")
    if fp32_grad_acc and prec["grad_bytes"] >= FP32:
        raise InputError("fp32 gradients already accumulate in fp32: drop fp32_grad_acc "
                         "(--fp32-grad-acc) or choose precision bf16/fp8", "fp32_grad_acc",
                         "fp32 梯度本身就以 fp32 累积：去掉 fp32 梯度累积，或选择 bf16/fp8 精度")
    if recompute not in RECOMPUTE_MODES:
        raise InputError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {recompute!r}",
                         "recompute")
    micro_batch = int(check_range("micro_batch", micro_batch, 1, MAX_MICRO_BATCH, integer=True,
                                  field="micro_batch"))
    g = check_shard_size(n, shard_size)
    if owned:  # tensor ownership over a shard group of g (stage 2 lays out stage 1's buckets)
        tensors = model_tensors(m, optimizer)
        per_tensor = _ownerships(tuple(tensors), g, optimizer, prec["param_bytes"])
        zero = per_tensor[0]
        k = prec["master_bytes"] + zero.max_state_bytes / zero.params
    warnings, warnings_zh = [], []
    shape = None
    layers, unit = m.layers, m.unit_params
    root = m.embedding_params if m.layers else 0.0
    if not m.layers:
        layers, hidden = assumed_shape(m.params)
        shape = [layers, hidden]
        unit = m.params / layers
        warnings.append(f"{m.name} has no shape: ZeRO-3's gathered units assume {layers} layers "
                        f"of hidden size {hidden:,} (12·L·h² = Ψ); give a config.json or "
                        "layers/hidden for the real ones")
        warnings_zh.append(f"{m.name} 没有结构信息：ZeRO-3 的两个聚合单元按 {layers} 层、隐藏维度 "
                           f"{hidden:,} 估算（12·L·h² = Ψ）；给出 config.json 或层数/隐藏维度可得实际值")
    act = None
    if seq is None:
        if micro_batch != 1 or recompute != "none" or attention != DEFAULT_ATTENTION:
            raise InputError("micro_batch (--micro-batch), recompute and attention only change "
                             "activations: give seq (--seq-len) too, or leave them at 1, none and "
                             f"{DEFAULT_ATTENTION}", "seq",
                             "微批次、重计算和注意力实现只影响激活值：请同时给出序列长度，或保持 1、none 和 "
                             f"{DEFAULT_ATTENTION}")
        warnings.append("activations are not counted: give seq (--seq-len) to add them")
        warnings_zh.append("未计入激活值：给出序列长度 seq 即可加入")
    else:
        seq = int(check_range("seq", seq, 1, MAX_SEQ, "ten million tokens at most", integer=True,
                              field="seq"))
        if not (m.layers and m.hidden and m.heads):
            raise InputError(f"activations need the model's shape and {m.name} has none: give a "
                             "config.json (--config) or layers, hidden and heads, or drop seq",
                             "seq", f"计算激活值需要模型结构，而 {m.name} 没有：请给出 config.json "
                             "或层数、隐藏维度和头数，或清空序列长度")
        act = activations(m.layers, m.hidden, m.heads, seq, micro_batch, m.ffn or 4 * m.hidden,
                          m.vocab or 0, recompute, q_dim=m.q_dim, kv_dim=m.kv_dim,
                          gated_mlp=m.gated_mlp, attention=attention)
    act_bytes = act.total_bytes if act else 0.0
    rows = []
    for s in all_stages(m.params, g, k, fp32_grad_acc, unit or 0.0, layers,
                        prec["param_bytes"], prec["grad_bytes"], root):
        d = s.to_dict()
        if owned:
            _own(d, per_tensor[s.stage], prec, fp32_grad_acc)
        total = d["model_state_bytes"] + d["gathered_unit_bytes"] + act_bytes
        v = verdict(total, hw.hbm_bytes, headroom)
        d.update(n=n, shard_size=g, activation_bytes=act_bytes, total_bytes=total,
                 fits=v == "fits", verdict=v)
        rows.append(d)
    zh_recompute = {"none": "不重计算", "selective": "选择性重计算", "full": "完全重计算",
                    "op": "按算子选择性重计算", "layer": "隔层完全重计算"}
    pb, gb, mb = prec["param_bytes"], prec["grad_bytes"], prec["master_bytes"]
    both = [(f"parameters ({pb:g} B)", f"参数（{pb:g} B）"), (f"gradients ({gb:g} B)", f"梯度（{gb:g} B）"),
            (f"optimizer states (k = {k:g} B)", f"优化器状态（k = {k:g} B）") if not owned else
            (f"{optimizer} states by tensor ownership (the fullest rank) + master ({mb:g} B)",
             f"{optimizer} 状态按张量分配（每个张量整块放在一张卡上，取最多的那张卡）+ fp32 参数（{mb:g} B）")]
    if fp32_grad_acc:
        both.append(("fp32 gradient accumulation (4 B)", "fp32 梯度累积缓冲（4 B）"))
    exchange = (" (or the owner exchange's buffers at the step, if larger)",
                "（或优化器一步中整块张量的通信缓冲，取其中大的）") if owned else ("", "")
    both.append((("2 gathered blocks + the root unit (embedding, head) at ZeRO-3" if root
                  else "2 gathered units at ZeRO-3") + exchange[0],
                 ("ZeRO-3 的 2 个聚合块 + 根单元（嵌入、输出层）" if root else "ZeRO-3 的 2 个聚合单元") + exchange[1]))
    if act:
        both.append((f"activations (seq {seq:,}, micro-batch {micro_batch}, recompute {recompute}, "
                     f"{attention} attention)",
                     f"激活值（序列 {seq:,}，微批次 {micro_batch}，{zh_recompute[recompute]}，{attention} 注意力）"))
    includes, includes_zh = [en for en, _ in both], [zh for _, zh in both]
    if owned:
        covered = per_tensor[0].params / m.params
        if abs(covered - 1) > 1e-6:
            warnings.append(f"tensor ownership: the rebuilt tensors hold {100 * covered:.3f}% of Ψ "
                            f"({m.name}'s family has parameters the planner does not lay out one by one)")
            warnings_zh.append(f"张量分配：列出的张量是 Ψ 的 {100 * covered:.3f}%（{m.name} 有规划器"
                               "没有一一列出的参数）")
        two = per_tensor[2]
        in_flight = prec["grad_bytes"] * two.largest_group_numel
        if in_flight > prec["grad_bytes"] * two.shard_numel:
            warnings.append(f"tensor ownership ({optimizer}): at ZeRO-2 the largest bucket, at least N times its "
                            f"largest tensor, holds its full gradient ({fmt_bytes(in_flight)}) from its first "
                            "gradient to its ReduceScatter — more than the gradient shard the table counts")
            warnings_zh.append(f"张量分配（{optimizer}）：在 ZeRO-2，最大的桶（至少是其中最大张量的 N 倍）自第一个梯度"
                               f"到 ReduceScatter 之间保存完整梯度（{fmt_bytes(in_flight)}），超过表中计入的梯度分片")
        worst = max(per_tensor[1:], key=lambda o: o.imbalance)
        if worst.imbalance > 1.5:
            big = max(tensors, key=lambda t: t.numel)
            warnings.append(f"tensor ownership ({optimizer}): the fullest rank holds "
                            f"{worst.imbalance:.2f}x the mean optimizer state at {worst.stage_name}; "
                            f"each tensor is owned whole (the largest, {big.name}, has "
                            f"{big.numel:,} elements) and each group is padded to its largest "
                            "owned set")
            warnings_zh.append(f"张量分配（{optimizer}）：在 {worst.stage_name}，最多的一张卡的优化器状态是"
                               f"均值的 {worst.imbalance:.2f} 倍；每个张量整块放在一张卡上（最大的 "
                               f"{big.name} 有 {big.numel:,} 个元素），每组按该组最多的那张卡的元素数分片")
    return MemoryPlan(model=m.to_dict(), n=n, hardware=hw.name, hbm_bytes=hw.hbm_bytes,
                      precision=precision, param_bytes=prec["param_bytes"],
                      grad_bytes=prec["grad_bytes"], k=k, fp32_grad_acc=fp32_grad_acc, seq=seq,
                      micro_batch=micro_batch, recompute=recompute, stages=rows,
                      activations=act.to_dict() if act else None, includes=includes,
                      warnings=warnings, assumed_shape=shape, includes_zh=includes_zh,
                      warnings_zh=warnings_zh, shard_size=g, replicas=n // g, optimizer=optimizer,
                      attention=attention)


@functools.lru_cache(maxsize=64)
def _ownerships(tensors: tuple, g: int, optimizer: str, elem_bytes: float) -> tuple:
    """Tensor ownership at stages 0-3 over a shard group of ``g`` (stage 2 lays out stage 1's
    buckets); the same for every micro-batch and recomputation, so plan recommend, which asks for
    many of them, computes it once per shard group."""
    from zerodp.plan.ownership import ownership

    zero, one, three = (ownership(list(tensors), g, s, optimizer, elem_bytes=elem_bytes)
                        for s in (0, 1, 3))
    return (zero, one, dataclasses.replace(one, stage=2, stage_name=STAGE_NAMES[2]), three)


def _own(row: dict, o, prec: dict, fp32_grad_acc: bool) -> None:
    """One stage row under tensor ownership (:mod:`zerodp.plan.ownership`): shards are each
    rank's padded slices (Σ_groups the largest owned set), optimizer states the fullest rank's."""
    stage, shard = row["stage"], o.shard_numel
    if stage == 3:
        row["param_bytes"] = prec["param_bytes"] * shard
        # the owner exchange's buffers live during the step, when no unit is gathered: the larger counts
        row["gathered_unit_bytes"] = max(row["gathered_unit_bytes"], o.exchange_peak_bytes)
    if stage >= 2:
        row["grad_bytes"] = prec["grad_bytes"] * shard
        row["grad_acc_bytes"] = FP32 * shard if fp32_grad_acc else 0.0
    row["optimizer_bytes"] = prec["master_bytes"] * shard + o.max_state_bytes
    states = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"] + row["grad_acc_bytes"]
    row.update(model_state_bytes=states, k=row["optimizer_bytes"] / (o.params / o.n) if stage else
               row["optimizer_bytes"] / o.params, bytes_per_param=states / o.params,
               comm_elements_per_step=o.comm_elements_per_step, ownership=o.to_dict())
