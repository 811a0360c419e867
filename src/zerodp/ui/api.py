"""The page's JSON API: each endpoint validates its parameters and calls the planner, nothing more.

No formula lives here: every figure the page shows is a field of a planner result's ``to_dict()``
(or a label the planner's own formatters wrote), so the page and ``zerodp plan`` cannot disagree.

=============  ==============================================================================
endpoint       planner calls
=============  ==============================================================================
``schema``     the parameters of every endpoint, with defaults (the page's starting values)
``presets``    hardware and model presets
``memory``     :func:`~zerodp.plan.all_stages` (+ :func:`~zerodp.plan.activations`) (seed §8, §9)
``overlap``    :func:`~zerodp.plan.simulate_backward` and :func:`~zerodp.plan.sweep_buckets` (§4)
``roofline``   :func:`~zerodp.plan.threshold`, :func:`~zerodp.plan.max_devices` (§7)
``batch``      :func:`~zerodp.plan.plan_batch` (§6.1)
``measured``   the calibration profile and trace given to ``zerodp ui`` (if any)
=============  ==============================================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from zerodp import plan
from zerodp.plan import report as plan_report
from zerodp.plan._common import fmt_bytes, fmt_count, fmt_time
from zerodp.plan.memory import RECOMPUTE, STAGE_NAMES
from zerodp.ui.measured import Measured
from zerodp.ui.params import ApiError, Param, field_of, parse

#: seed §9.4: the ZeRO paper's example runs on N_d = 64 GPUs (with Ψ = 7.5B, k = 12)
ZERO_PAPER_GPUS = 64
ZERO_PAPER_MODEL = "zero-7.5b"
#: seed §6.1: "手上有 128 张卡"
BATCH_EXAMPLE_GPUS = 128
#: seed §4's demo model (the planner's report uses the same)
OVERLAP_MODEL = "llama3-8b"
CUSTOM = "custom"
#: DP sizes drawn in the "per GPU vs N" and "grad_acc vs dp" curves: powers of two up to 2^LOG2_MAX
LOG2_MAX_GPUS = 16
#: buckets drawn one by one in the timeline; beyond this the page draws runs of equal buckets
MAX_DRAWN_BUCKETS = 1000


@functools.lru_cache(maxsize=64)
def _sweep(model: str, hw: plan.Hardware, tokens: float, latency: float, bandwidth: float, n: int,
           collective: str):
    """Layers, ring cost and bucket sweep: all that does not depend on the bucket size, kept
    while a slider drags the bucket size."""
    layers = tuple(plan.model_layers(model, hw, tokens))
    cost = plan.RingCost.from_latency(latency, bandwidth, n)
    return layers, cost, plan.sweep_buckets(layers, cost, collective=collective)


@dataclass(frozen=True)
class Endpoint:
    name: str
    params: list[Param]
    handler: Callable[..., dict]
    doc: str = ""


@dataclass
class Api:
    """The endpoints, bound to what ``zerodp ui`` was started with (profile, trace)."""

    measured: Measured = field(default_factory=Measured)

    # ---- presets -------------------------------------------------------------------------------
    def hardware_choices(self) -> list[str]:
        extra = [self.measured.hardware.name] if self.measured.hardware else []
        return extra + plan.hardware_names()

    def get_hardware(self, name: str) -> plan.Hardware:
        """A preset or the calibrated profile, by name (case-insensitive); never a file path."""
        if self.measured.hardware and name.lower() == self.measured.hardware.name.lower():
            return self.measured.hardware
        for preset in plan.hardware_names():
            if preset.lower() == name.lower():
                return plan.get_hardware(preset)
        raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(self.hardware_choices())}")

    def _hardware_param(self, default: str, label="hardware") -> Param:
        return Param("hardware", "choice", default, label,
                     choices=self.hardware_choices, resolve=self.get_hardware)

    @staticmethod
    def _model_param(default: str, with_custom: bool, label="model preset") -> Param:
        def choices():
            return ([CUSTOM] if with_custom else []) + plan.model_names()

        def resolve(name):
            return None if (with_custom and name == CUSTOM) else plan.get_model(name)

        return Param("model", "choice", default, label, choices=choices, resolve=resolve)

    # ---- endpoints -----------------------------------------------------------------------------
    def endpoints(self) -> dict[str, Endpoint]:
        preset = plan.hardware_names()[0]
        # the overlap panel simulates the calibrated machine when a profile was given
        hw = self.measured.hardware or plan.get_hardware(preset)
        zero_paper = plan.get_model(ZERO_PAPER_MODEL)
        eps = [
            Endpoint("schema", [], self.schema, "parameters of every endpoint, with defaults"),
            Endpoint("presets", [], self.presets, "hardware and model presets"),
            Endpoint("measured", [], self.measured.to_dict, "profile and trace given at start"),
            Endpoint("memory", [
                self._model_param(ZERO_PAPER_MODEL, with_custom=True),
                Param("params", "quantity", zero_paper.params, "parameters Ψ (model custom)"),
                Param("k", "quantity", plan.ADAM_K, "optimizer bytes per parameter k",
                      allow_zero=True),
                Param("n", "count", ZERO_PAPER_GPUS, "data-parallel GPUs N"),
                Param("fp32_grad_acc", "flag", False, "fp32 gradient accumulation"),
                self._hardware_param(preset, "HBM of"),
                Param("seq", "count", plan_report.BATCH_EXAMPLE["seq"], "sequence length"),
                Param("micro_batch", "count", 1, "micro-batch"),
                Param("recompute", "choice", RECOMPUTE[0], "activation recomputation",
                      choices=lambda: list(RECOMPUTE)),
            ], self.memory, "bytes per GPU for stages 0-3 (seed §8, §9)"),
            Endpoint("overlap", [
                self._model_param(OVERLAP_MODEL, with_custom=False),
                self._hardware_param(hw.name, "compute of"),
                Param("bucket_bytes", "quantity", float(plan.DDP_DEFAULT_BUCKET_BYTES),
                      "bucket size"),
                Param("tokens_per_gpu", "quantity", float(plan_report.DEMO_TOKENS),
                      "tokens per GPU"),
                Param("latency", "quantity", hw.small_message_latency,
                      "small-message latency α′ (s)", allow_zero=True),
                Param("bandwidth", "quantity", hw.intra_bw, "bandwidth per GPU (B/s)"),
                Param("n", "count", hw.devices_per_node, "GPUs in the ring", minimum=2),
                Param("collective", "choice", "all_reduce", "gradient collective",
                      choices=lambda: ["all_reduce", "reduce_scatter"]),
            ], self.overlap, "one backward with bucketed gradient communication (seed §4)"),
            Endpoint("roofline", [
                self._hardware_param(preset),
                Param("n", "count", plan_report.LLAMA3_405B_GPUS, "data-parallel GPUs",
                      optional=True),
                Param("axes", "count", 1, "mesh axes doing DP"),
                Param("experts", "count", 1, "experts E"),
                Param("experts_per_token", "count", 1, "experts per token k"),
                Param("batch_tokens", "quantity", plan_report.LLAMA3_FINAL_BATCH_TOKENS,
                      "global batch (tokens)"),
            ], self.roofline, "tokens-per-GPU threshold, minimum batch, maximum GPUs (seed §7)"),
            Endpoint("batch", [
                Param("target_tokens", "quantity", float(plan_report.BATCH_EXAMPLE["target_tokens"]),
                      "target global batch (tokens)"),
                Param("seq", "count", plan_report.BATCH_EXAMPLE["seq"], "sequence length"),
                Param("micro_batch", "count", plan_report.BATCH_EXAMPLE["micro_batch"],
                      "micro-batch mbs"),
                Param("dp", "count", BATCH_EXAMPLE_GPUS, "data-parallel GPUs dp"),
            ], self.batch, "gbs = mbs × grad_acc × dp (seed §6.1)"),
        ]
        return {e.name: e for e in eps}

    def handle(self, name: str, query: dict[str, str]) -> dict:
        """Answer one request. Raises :class:`ApiError` (→ 422) or KeyError (→ 404)."""
        endpoint = self.endpoints()[name]
        kwargs = parse(endpoint.params, query)
        try:
            return endpoint.handler(**kwargs)
        except ValueError as exc:  # the planner's own checks, e.g. k experts > E
            if isinstance(exc, ApiError):
                raise
            raise ApiError(field_of(str(exc), endpoint.params), str(exc)) from None

    # ---- handlers ------------------------------------------------------------------------------
    def schema(self) -> dict:
        return {name: {"doc": e.doc, "params": [p.describe() for p in e.params]}
                for name, e in self.endpoints().items()}

    def presets(self) -> dict:
        return {
            "hardware": [self.get_hardware(n).to_dict() for n in self.hardware_choices()],
            "models": [plan.get_model(n).to_dict() for n in plan.model_names()],
            "stages": STAGE_NAMES,
            "recompute": list(RECOMPUTE),
        }

    def memory(self, model, params, k, n, fp32_grad_acc, hardware, seq, micro_batch, recompute):
        m = plan.custom_model(params=params) if model == CUSTOM else plan.get_model(model)
        hw = self.get_hardware(hardware)
        unit = m.block_params or 0.0

        def stages(gpus):
            return plan.all_stages(m.params, gpus, k, fp32_grad_acc, unit_params=unit,
                                   layers=m.layers)

        rows = []
        for s in stages(n):
            d = s.to_dict()
            d.update(label=fmt_bytes(s.model_state_bytes), total_label=fmt_bytes(s.total_bytes),
                     fits=s.total_bytes <= hw.hbm_bytes)
            rows.append(d)
        act = None
        if m.layers and m.hidden and m.heads:
            a = plan.activations(m.layers, m.hidden, m.heads, seq, micro_batch, m.ffn,
                                 m.vocab or 0, recompute)
            act = dict(a.to_dict(), label=fmt_bytes(a.total_bytes))
        curve_n = sorted({2**i for i in range(LOG2_MAX_GPUS + 1)} | {n})
        curve = {STAGE_NAMES[s]: [] for s in plan.memory.STAGES}
        for gpus in curve_n:
            for s in stages(gpus):
                curve[s.stage_name].append(s.model_state_bytes)
        return {
            "model": m.to_dict(), "hardware": hw.name, "hbm_bytes": hw.hbm_bytes,
            "hbm_label": fmt_bytes(hw.hbm_bytes), "stages": rows, "activations": act,
            "curve": {"n": curve_n, "bytes": curve},
        }

    def overlap(self, model, hardware, bucket_bytes, tokens_per_gpu, latency, bandwidth, n,
                collective):
        hw = self.get_hardware(hardware)
        layers, cost, sweep = _sweep(model, hw, tokens_per_gpu, latency, bandwidth, n, collective)
        run = plan.simulate_backward(layers, cost, bucket_bytes, collective)
        timeline = run.to_dict()
        if run.num_buckets > MAX_DRAWN_BUCKETS:
            timeline["buckets"] = []  # the page draws the runs instead
        return {
            "model": model, "hardware": hw.name, "flops": hw.flops,
            "cost": dict(cost.to_dict(), crossover_bytes=cost.crossover_bytes(),
                         crossover_label=fmt_bytes(cost.crossover_bytes())),
            "timeline": timeline,
            "sweep": sweep.to_dict(),
            "labels": {
                "bucket": fmt_bytes(bucket_bytes), "tokens": fmt_count(tokens_per_gpu),
                "latency": fmt_time(latency), "bandwidth": fmt_bytes(bandwidth) + "/s",
                "exposed": fmt_time(run.exposed_comm_s), "backward": fmt_time(run.backward_s),
                "comm": fmt_time(run.comm_s), "latency_total": fmt_time(run.latency_s),
                "buckets": fmt_count(run.num_buckets), "total_bytes": fmt_bytes(run.total_bytes),
                "best_bucket": fmt_bytes(sweep.best_bucket_bytes),
                "best_exposed": fmt_time(sweep.best_exposed_comm_s),
            },
        }

    def roofline(self, hardware, n, axes, experts, experts_per_token, batch_tokens):
        hw = self.get_hardware(hardware)
        kw = dict(axes=axes, experts=experts, experts_per_token=experts_per_token)
        here = plan.threshold(hw, n, **kw)
        at_scale = plan.threshold(hw, None, **kw)
        most = plan.max_devices(hw, batch_tokens, **kw)
        network = plan.network_cost(hw, n, axes).to_dict() if n is not None else None
        nodes = None
        if network is not None:
            nodes = network["inter"]["n"] if network.get("inter") else 1
        # DP sizes for the curve: powers of two (within one ICI domain if there is no network)
        limit = 2**(LOG2_MAX_GPUS + 1) if hw.inter_bw > 0 else hw.devices_per_node
        sizes = {2**i for i in range(1, LOG2_MAX_GPUS + 2) if 2**i <= limit}
        sizes |= {size for size in (n, hw.devices_per_node) if size and size > 1}
        sizes = sorted(sizes)
        curve = [plan.threshold(hw, size, **kw) for size in sizes]
        return {
            "threshold": here.to_dict(), "at_scale": at_scale.to_dict(), "max_devices": most.to_dict(),
            "network": network, "nodes": nodes,
            "curve": {"n": sizes, "threshold_tokens": [c.threshold_tokens for c in curve],
                      "bottleneck": [c.bottleneck for c in curve]},
            "labels": {
                "threshold": fmt_count(here.threshold_tokens),
                "at_scale": fmt_count(at_scale.threshold_tokens),
                "min_batch": (fmt_count(here.min_batch_tokens) if here.min_batch_tokens is not None
                              else None),
                "max_devices": fmt_count(most.max_devices),
                "batch": fmt_count(batch_tokens),
            },
        }

    def batch(self, target_tokens, seq, micro_batch, dp):
        p = plan.plan_batch(target_tokens, seq, micro_batch, dp)
        sizes = sorted({2**i for i in range(LOG2_MAX_GPUS + 1)} | {dp})
        sweep = [plan.plan_batch(target_tokens, seq, micro_batch, size) for size in sizes]
        return {
            "plan": p.to_dict(),
            "sweep": {"dp": sizes, "exact_grad_acc": [s.exact_grad_acc for s in sweep],
                      "grad_acc": [s.grad_acc for s in sweep],
                      "gpu_rich": [s.gpu_rich for s in sweep]},
            "labels": {"target": fmt_count(target_tokens),
                       "global_batch_tokens": fmt_count(p.global_batch_tokens)},
        }


