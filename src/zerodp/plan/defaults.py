"""Every question's starting values, in one place (docs/planner.md, "defaults").

``zerodp plan``, the JSON API of ``zerodp ui`` (``/api/schema``) and the page (which takes its
starting values from ``/api/schema``) read their defaults from :data:`DEFAULTS`, keyed by question
and by the API's parameter name; ``tests/test_plan_defaults.py`` walks every parameter of every
question and compares the three. ``None`` means "absent": the planner then uses what the value
stands for (the hardware's GPUs per node, no activations counted, flat sharding, ...).

The examples are the guide's: the ZeRO paper's Ψ = 7.5B on N = 64 GPUs (guide §9.4), 4Mi tokens
of 4,096 with micro-batch 2 on 128 GPUs (guide §6.1), Llama 3 405B on 16,384 H100 and its final
16M-token batch (guide §7.2), Llama 3 8B with 4,096 tokens per GPU and 25 MB buckets (guide §4).
"""

from __future__ import annotations

#: the hardware every question starts on (a preset of zerodp.plan.hardware)
HARDWARE = "H100"
#: attention implementations of the activation model (guide §8): "flash" is FlashAttention / SDPA,
#: which never stores the s × s scores (what practitioners run); "eager" stores them
ATTENTION = ("flash", "eager")
#: 25 MiB, PyTorch DDP's bucket_cap_mb = 25 and zerodp train's --bucket-mb default (guide §4)
BUCKET_BYTES = 25 * 2**20
#: the optimizer memory and recommend price (zerodp.plan.ownership.OPTIMIZERS): AdamW, elementwise,
#: what zerodp train steps; adafactor and muon are priced by tensor ownership (guide §12.3)
OPTIMIZER = "adamw"

DEFAULTS: dict[str, dict[str, object]] = {
    # guide §8-§9: the ZeRO paper's example, no activations until a sequence length is given
    "memory": dict(model="zero-7.5b", n=64, hardware=HARDWARE, precision="bf16", k=None,
                   optimizer=OPTIMIZER, fp32_grad_acc=False, seq=None, micro_batch=1,
                   recompute="none", attention="flash", shard_size=None, compress="none",
                   tied=False),
    # guide §4: one backward with bucketed gradient communication
    "overlap": dict(model="llama3-8b", hardware=HARDWARE, bucket_bytes=float(BUCKET_BYTES),
                    tokens_per_gpu=4096.0, n=8, collective="all_reduce", latency=None,
                    bandwidth=None),
    # guide §7: at scale (many nodes; n None), with Llama 3 405B's final batch
    "roofline": dict(hardware=HARDWARE, n=None, axes=1, experts=1, experts_per_token=1,
                     batch_tokens=16e6, shard_size=None, compress="none"),
    # guide §6.1: "手上有 128 张卡"
    "batch": dict(target_tokens=float(4 * 2**20), seq=4096, micro_batch=2, dp=128),
    # plan recommend: Llama 3 8B on one node of 8 H100, 4Mi tokens of 4,096
    "recommend": dict(model="llama3-8b", hardware=HARDWARE, nodes=1, gpus_per_node=None,
                      global_batch_tokens=float(4 * 2**20), seq=4096, attention="flash",
                      efficiency=None, headroom=0.1, optimizer=OPTIMIZER),
}


def default(question: str, name: str):
    """The starting value of parameter ``name`` of ``question`` (KeyError: no such parameter)."""
    return DEFAULTS[question][name]
