"""When data parallelism is communication-bound (guide §7, §10.1, §10.2).

Per layer (guide §7.1), backward compute 8·D·F·B/(X·C) against AllReduce 8·D·F/W: compute-bound iff
the tokens per device B/X exceed C/W, the hardware's "network arithmetic intensity". Corrections:

* small DP (guide §7.3): the ring's (X−1)/X factor: B/X > C/W · (X−1)/X;
* across nodes (guide §7.2, §7.3): two legs, NVLink per device inside a node with (g−1)/g and NIC
  egress per node between nodes with (m−1)/m; the slower leg sets W:
  ``threshold = C · max((g−1)/g / W_intra, (m−1)/m / W_inter)``. "At scale" (``n=None``) means
  many nodes, (m−1)/m → 1, the guide's 2475 (H100) and 4300 (H800) tokens/GPU;
* MoE (guide §7.3): compute follows the k active experts, gradients all E: threshold × E/k.

The guide's quoted "C/W" numbers (e.g. H100 inside a node ≈ 2200) are ``intra_c_over_w`` and
``inter_c_over_w``: C over one leg's bandwidth, without any (n−1)/n.

Past one node (guide §14) the threshold takes the two levers. In general it is
``C/4 · max(bytes_intra / W_intra, bytes_inter / W_inter)`` with the bytes per parameter each GPU
(each node, on the NICs) moves per step: a ReduceScatter of gradients at b_g bytes per element and
an AllGather of parameters at b_p (the guide's bf16 AllReduce is b_g = b_p = 2, giving the forms
above). Compression lowers b_g and b_p (:func:`~zerodp.plan.hybrid.wire_bytes`); hybrid sharding
(shard groups of g) keeps the ReduceScatter and AllGather inside the group, (g−1)/g·(b_g + b_p) on
NVLink when g ≤ GPUs per node p, and sends only the AllReduce of the 1/g shard across nodes,
2(R−1)/R·b_g/g per GPU with min(g, p) of them sharing one node's NICs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.plan._common import BF16, InputError, ToDict, check_count, check_positive
from zerodp.plan.collectives import network_cost
from zerodp.plan.hardware import Hardware, get_hardware
from zerodp.plan.hybrid import QUANT_BLOCK, check_placement, check_shard_size, wire_bytes
from zerodp.plan.models import Model, get_model

#: guide §7.4: backward ≈ 4·tokens·Ψ FLOPs (twice the forward's 2·tokens·Ψ)
BACKWARD_FLOPS_PER_TOKEN_PARAM = 4
FORWARD_FLOPS_PER_TOKEN_PARAM = 2
#: guide §10.2: a transformer layer has about 16h² parameters
PARAMS_PER_LAYER_PER_H2 = 16


@dataclass(frozen=True)
class Roofline(ToDict):
    """Tokens-per-device threshold. ``to_dict()`` keys:

    ``hardware``, ``n`` (devices; null = at scale), ``axes``, ``flops``, ``intra_c_over_w`` and
    ``inter_c_over_w`` (C over each leg's bandwidth, uncorrected; inter null without a network),
    ``intra_factor`` (g−1)/g, ``inter_factor`` (m−1)/m (null on one node), ``bottleneck``
    ("intra"/"inter"), ``dense_threshold_tokens`` (corrected), ``moe_factor`` (E/k),
    ``threshold_tokens`` (dense × E/k, tokens per device to be compute-bound),
    ``min_batch_tokens`` (threshold × n; null at scale), and for guide §14: ``shard_size`` (g;
    null: flat), ``replicas`` (n/g; null when flat or at scale), ``compress``,
    ``wire_grad_bytes`` and ``wire_param_bytes`` (bytes per element on the wire), and
    ``intra_bytes_per_param`` and ``inter_bytes_per_param`` (per GPU per step; inter: the GPU's
    share of its node's NIC bytes). With a shard size, ``intra_factor`` is (g−1)/g of the group's
    part inside a node and ``inter_factor`` (R−1)/R of the replicas (1 at scale).
    """

    hardware: str
    n: int | None
    axes: int
    flops: float
    intra_c_over_w: float
    inter_c_over_w: float | None
    intra_factor: float
    inter_factor: float | None
    bottleneck: str
    dense_threshold_tokens: float
    moe_factor: float
    threshold_tokens: float
    min_batch_tokens: float | None
    shard_size: int | None = None
    replicas: int | None = None
    compress: str = "none"
    wire_grad_bytes: float = BF16
    wire_param_bytes: float = BF16
    intra_bytes_per_param: float = 0.0
    inter_bytes_per_param: float = 0.0


def _moe(model, experts, experts_per_token) -> float:
    if model is not None:
        if experts != 1 or experts_per_token != 1:
            raise ValueError("give either a model or experts/experts_per_token, not both")
        return get_model(model).moe_factor
    e = check_count("experts", experts)
    k = check_count("experts_per_token", experts_per_token)
    if k > e:
        raise InputError(f"experts_per_token ({k}) must be <= experts ({e})", "experts_per_token",
                         f"每个 token 的专家数（{k}）不能超过专家数（{e}）")
    return e / k


def threshold(hardware: Hardware | str, n: int | None = None, axes: int = 1,
             model: Model | str | None = None, experts: int = 1,
             experts_per_token: int = 1, shard_size: int | None = None, compress: str = "none",
             block: int = QUANT_BLOCK) -> Roofline:
    """The tokens-per-device threshold on ``n`` devices (``None``: at scale, many nodes).

    MoE from ``model`` (a preset or :class:`Model`) or ``experts``/``experts_per_token``;
    ``shard_size`` (hybrid sharding: shard groups of g) and ``compress`` (bytes per element on the
    wire, blocks of ``block`` elements per int8 scale): guide §14, module docstring.
    """
    hw = get_hardware(hardware)
    axes = check_count("axes", axes)
    if axes > hw.axes:
        raise InputError(f"{hw.name} has {hw.axes} DP axis(es); got axes={axes}", "axes",
                         f"{hw.name} 只有 {hw.axes} 个可做数据并行的轴，收到 axes={axes}")
    moe = _moe(model, experts, experts_per_token)
    wire = wire_bytes(compress, BF16, BF16, block)
    sync = wire.wire_grad_bytes + wire.wire_param_bytes  # bytes per parameter: RS + AG
    w_intra = hw.intra_bw * axes
    has_inter = hw.inter_bw > 0
    p = hw.devices_per_node
    if n is not None:
        n = check_count("n (devices)", n)
        network_cost(hw, n, axes)  # validates that n fits this hardware's network
    replicas = None
    if shard_size is None:
        if n is None:
            g = p
            inter_factor = 1.0 if has_inter else None
        else:
            g = min(n, p)
            nodes = math.ceil(n / p)
            inter_factor = (nodes - 1) / nodes if nodes > 1 else None
        intra_factor = (g - 1) / g
        intra_bytes = intra_factor * sync
        node_bytes = inter_factor * sync if inter_factor is not None else 0.0
    else:
        g = check_count("shard size", shard_size) if n is None else check_shard_size(n, shard_size)
        check_placement(hw, g)
        gi = min(g, p)
        intra_factor = (gi - 1) / gi
        intra_bytes = intra_factor * sync
        group_nodes = g // p if g > p else 1
        node_bytes = (group_nodes - 1) / group_nodes * sync
        if n is None:
            inter_factor = 1.0  # (R−1)/R with many replicas
        else:
            replicas = n // g
            inter_factor = (replicas - 1) / replicas
        replica_bytes = 2 * inter_factor * wire.wire_replica_grad_bytes / g  # AllReduce of the 1/g shard
        if (n is not None and n <= p) or not has_inter:
            intra_bytes += replica_bytes
        else:
            node_bytes += replica_bytes * gi
        if n is not None and n <= p:
            inter_factor = None  # one node: no replica crosses a NIC
    intra_term = intra_bytes / (2 * BF16 * w_intra)
    inter_term = node_bytes / (2 * BF16 * hw.inter_bw) if has_inter else 0.0
    bottleneck = "inter" if inter_term > intra_term else "intra"
    dense = hw.flops * max(intra_term, inter_term)
    thr = dense * moe
    return Roofline(hardware=hw.name, n=n, axes=axes, flops=hw.flops,
                    intra_c_over_w=hw.flops / w_intra,
                    inter_c_over_w=hw.flops / hw.inter_bw if has_inter else None,
                    intra_factor=intra_factor, inter_factor=inter_factor, bottleneck=bottleneck,
                    dense_threshold_tokens=dense, moe_factor=moe, threshold_tokens=thr,
                    min_batch_tokens=thr * n if n is not None else None,
                    shard_size=shard_size if shard_size is None else g, replicas=replicas,
                    compress=wire.compress, wire_grad_bytes=wire.wire_grad_bytes,
                    wire_param_bytes=wire.wire_param_bytes, intra_bytes_per_param=intra_bytes,
                    inter_bytes_per_param=node_bytes / p if has_inter else 0.0)


@dataclass(frozen=True)
class MaxDevices(ToDict):
    """Most devices a batch keeps compute-bound: ``hardware``, ``batch_tokens``, ``axes``,
    ``moe_factor``, ``threshold_tokens`` (at scale), ``max_devices`` = floor(batch/threshold)."""

    hardware: str
    batch_tokens: float
    axes: int
    moe_factor: float
    threshold_tokens: float
    max_devices: int


def max_devices(hardware: Hardware | str, batch_tokens: float, axes: int = 1,
                model: Model | str | None = None, experts: int = 1,
                experts_per_token: int = 1, shard_size: int | None = None,
                compress: str = "none", block: int = QUANT_BLOCK) -> MaxDevices:
    """Largest DP size whose tokens per device stay above the at-scale threshold (guide §7.5;
    ``shard_size`` and ``compress``: guide §14)."""
    check_positive("batch_tokens", batch_tokens)
    r = threshold(hardware, None, axes, model, experts, experts_per_token, shard_size, compress,
                  block)
    return MaxDevices(r.hardware, batch_tokens, axes, r.moe_factor, r.threshold_tokens,
                      int(batch_tokens // r.threshold_tokens))


@dataclass(frozen=True)
class WholeModel(ToDict):
    """Guide §7.4 for a whole model: ``params``, ``active_params``, ``tokens_per_device``, ``n``,
    ``compute_s`` (4·tokens·Ψ_active/C), ``comm_s`` (AllReduce of 2Ψ bytes, bandwidth term of the
    slower leg), ``ratio`` (compute/comm), ``compute_bound``, ``threshold_tokens``
    (tokens per device where compute = comm)."""

    params: float
    active_params: float
    tokens_per_device: float
    n: int
    compute_s: float
    comm_s: float
    ratio: float
    compute_bound: bool
    threshold_tokens: float


def whole_model(params: float, tokens_per_device: float, n: int, hardware: Hardware | str,
                active_params: float | None = None, axes: int = 1) -> WholeModel:
    """t_compute = 4·tokens·Ψ/C against t_comm = 2Ψ·2(N−1)/N / W (guide §7.4)."""
    hw = get_hardware(hardware)
    check_positive("params", params)
    check_positive("tokens_per_device", tokens_per_device)
    active = params if active_params is None else check_positive("active_params", active_params)
    cost = network_cost(hw, n, axes)
    compute = BACKWARD_FLOPS_PER_TOKEN_PARAM * tokens_per_device * active / hw.flops
    comm = cost.seconds_per_byte("all_reduce") * BF16 * params
    thr = comm * hw.flops / (BACKWARD_FLOPS_PER_TOKEN_PARAM * active)
    return WholeModel(params, active, tokens_per_device, n, compute, comm,
                      compute / comm if comm > 0 else math.inf, compute > comm, thr)


@dataclass(frozen=True)
class LayerPrefetch(ToDict):
    """Guide §10.2, FSDP per-layer prefetch: ``hidden``, ``tokens_per_device`` (seq·mbs), ``n``,
    ``layer_params`` (16h²), ``allgather_s`` (32h²·(N−1)/N / W), ``forward_s``
    (2·tokens·16h²/C), ``ratio`` (forward/allgather), ``hidden_by_compute``."""

    hidden: int
    tokens_per_device: float
    n: int
    layer_params: float
    allgather_s: float
    forward_s: float
    ratio: float
    hidden_by_compute: bool


def layer_prefetch(hidden: int, seq: int, micro_batch: int, n: int,
                   hardware: Hardware | str) -> LayerPrefetch:
    """Is one layer's AllGather hidden behind its forward? (guide §10.2)"""
    hw = get_hardware(hardware)
    h = check_count("hidden", hidden)
    tokens = check_count("seq", seq) * check_count("micro_batch", micro_batch)
    layer_params = PARAMS_PER_LAYER_PER_H2 * h * h
    ag = network_cost(hw, n).seconds_per_byte("all_gather") * BF16 * layer_params
    fwd = FORWARD_FLOPS_PER_TOKEN_PARAM * tokens * layer_params / hw.flops
    return LayerPrefetch(h, tokens, n, layer_params, ag, fwd,
                         fwd / ag if ag > 0 else math.inf, fwd > ag)


def labels(r) -> dict:
    """The two pairs ``zerodp plan roofline`` prints for a :func:`threshold` result, formatted
    once for the CLI and the page: wire bytes per element (gradients, parameters; four digits,
    so that int8's 1 + 4/B shows) and synchronised bytes per parameter per GPU (NVLink, NIC
    share; three significant digits, as every other figure)."""
    return {"wire": f"{r.wire_grad_bytes:.4g}, {r.wire_param_bytes:.4g}",
            "sync": f"{r.intra_bytes_per_param:.3g}, {r.inter_bytes_per_param:.3g}"}
