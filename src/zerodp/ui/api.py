"""The page's JSON API: each endpoint validates its parameters and calls the planner, nothing more.

No formula lives here: every figure the page shows is a field of a planner result's ``to_dict()``
(or a label the planner's own formatters wrote), so the page and ``zerodp plan`` cannot disagree.

=============  ==============================================================================
endpoint       planner calls
=============  ==============================================================================
``schema``     the parameters of every endpoint, with defaults (the page's starting values)
``presets``    hardware and model presets
``memory``     :func:`~zerodp.plan.memory_plan`, :func:`~zerodp.plan.step_comm` (guide §8, §9, §14)
``overlap``    :func:`~zerodp.plan.simulate_backward` and :func:`~zerodp.plan.sweep_buckets` (§4)
``roofline``   :func:`~zerodp.plan.threshold`, :func:`~zerodp.plan.max_devices` (§7, §14)
``batch``      :func:`~zerodp.plan.plan_batch` (§6.1)
``recommend``  :func:`~zerodp.plan.recommend` (§6.1, §7, §9, §14): the ranked table's own cells
``measured``   the calibration profile and trace given to ``zerodp ui`` (if any)
=============  ==============================================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from zerodp import plan
from zerodp.plan.roofline import labels as roofline_labels
from zerodp.plan.recommend import COLUMNS as RECOMMEND_COLUMNS
from zerodp.plan.recommend import rows as recommend_rows
from zerodp.plan.recommend import text as recommend_text
from zerodp.plan.recommend import zh as recommend_zh
from zerodp.plan import ownership as plan_ownership
from zerodp.plan._common import fmt_bytes, fmt_count, fmt_time, plural
from zerodp.plan.hf import parse_config
from zerodp.plan.hybrid import COMPRESSIONS
from zerodp.plan.defaults import ATTENTION, DEFAULTS
from zerodp.plan.memory import RECOMPUTE, STAGE_NAMES
from zerodp.ui.measured import Measured
from zerodp.ui.params import ApiError, Param, field_of, parse

#: every starting value is zerodp.plan.defaults' (the CLI's too): MEM["n"] is guide §9.4's N_d = 64
MEM, SIM, ROOF, BATCH, REC = (DEFAULTS[q] for q in ("memory", "overlap", "roofline", "batch",
                                                   "recommend"))
CUSTOM = "custom"
RECOMMEND_MAX_NODES = 4096
#: DP sizes drawn in the "per GPU vs N" and "grad_acc vs dp" curves: powers of two up to 2^LOG2_MAX
LOG2_MAX_GPUS = 16
#: buckets drawn one by one in the timeline; beyond this the page draws runs of equal buckets
MAX_DRAWN_BUCKETS = 1000
MAX_PARAMS = 1e15
#: the shape a user can type on the page: name, label, largest value
SHAPE_PARAMS = [("layers", "layers L", 100_000), ("hidden", "hidden size h", 1_000_000),
                ("heads", "attention heads", 100_000), ("kv_heads", "key/value heads", 100_000),
                ("ffn", "MLP width (SwiGLU)", 10_000_000), ("vocab", "vocabulary", 100_000_000),
                ("experts", "routed experts E", 100_000),
                ("experts_per_token", "experts per token k", 100_000),
                ("shared_experts", "shared experts", 100_000)]
SHAPE_NAMES = [name for name, _, _ in SHAPE_PARAMS]


def _lever_params() -> list[Param]:
    """Guide §14's two levers: the shard-group size g (empty: flat) and the wire's compression."""
    return [
        Param("shard_size", "count", MEM["shard_size"], "shard-group size g (empty: flat over N)",
              optional=True, maximum=plan.memory.MAX_GPUS, why="no cluster holds more than a million"),
        Param("compress", "choice", MEM["compress"], "compression on the wire",
              choices=lambda: list(COMPRESSIONS)),
    ]


def _optimizer_param(default: str) -> Param:
    """The optimizer memory and recommend price (zerodp plan memory/recommend --optimizer):
    elementwise ones flat, adafactor and muon by tensor ownership (guide §12.3)."""
    return Param("optimizer", "choice", default, "optimizer (adafactor, muon: tensor ownership)",
                 choices=lambda: list(plan_ownership.OPTIMIZERS))


def _comm_labels(c) -> dict:
    """A step's communication (:class:`~zerodp.plan.StepComm`) with the CLI's own labels."""
    return dict(c.to_dict(), labels={
        "intra_bytes": fmt_bytes(c.intra_bytes) if c.intra_bytes else "-",
        "inter_bytes": fmt_bytes(c.inter_bytes) if c.inter_bytes else "-",
        "time": fmt_time(c.time_s)})


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
        preset = MEM["hardware"]
        # the overlap panel simulates the calibrated machine when a profile was given
        hw = self.measured.hardware or plan.get_hardware(SIM["hardware"])
        eps = [
            Endpoint("schema", [], self.schema, "parameters of every endpoint, with defaults"),
            Endpoint("presets", [], self.presets, "hardware and model presets"),
            Endpoint("measured", [], self.measured.to_dict, "profile and trace given at start"),
            Endpoint("model", [
                self._model_param(MEM["model"], with_custom=False),
                Param("config", "text", None, "config.json text", optional=True),
            ], self.model, "a preset or a pasted config.json: parameter count and shape"),
            Endpoint("memory", [
                self._model_param(MEM["model"], with_custom=True),
                Param("config", "text", None, "config.json (model custom)", optional=True),
                Param("params", "quantity", None, "parameters Ψ (model custom)", optional=True,
                      minimum=1, maximum=MAX_PARAMS, why="a thousand trillion at most",
                      count_units=True),
                *[Param(name, "count", None, label, optional=True, maximum=high,
                        minimum=0 if name == "shared_experts" else None)
                  for name, label, high in SHAPE_PARAMS],
                Param("tied", "flag", MEM["tied"], "tied input and output embeddings"),
                Param("precision", "choice", MEM["precision"], "precision",
                      choices=lambda: list(plan.memory.PRECISIONS)),
                Param("k", "quantity", MEM["k"], "optimizer bytes per parameter k", allow_zero=True,
                      optional=True, maximum=plan.memory.MAX_K,
                      why="Adam with fp64 states needs 24"),
                _optimizer_param(MEM["optimizer"]),
                Param("n", "count", MEM["n"], "data-parallel GPUs N",
                      maximum=plan.memory.MAX_GPUS, why="no cluster holds more than a million"),
                Param("fp32_grad_acc", "flag", MEM["fp32_grad_acc"], "fp32 gradient accumulation"),
                self._hardware_param(preset, "HBM of"),
                Param("seq", "count", MEM["seq"], "sequence length (empty: no activations)",
                      optional=True, maximum=plan.memory.MAX_SEQ,
                      why="ten million tokens at most"),
                Param("micro_batch", "count", MEM["micro_batch"], "micro-batch",
                      maximum=plan.memory.MAX_MICRO_BATCH),
                Param("recompute", "choice", MEM["recompute"], "activation recomputation",
                      choices=lambda: list(RECOMPUTE)),
                Param("attention", "choice", MEM["attention"], "attention implementation",
                      choices=lambda: list(ATTENTION)),
                *_lever_params(),
            ], self.memory, "the bill per GPU for stages 0-3 and whether it fits (guide §8, §9)"),
            Endpoint("overlap", [
                self._model_param(SIM["model"], with_custom=False),
                self._hardware_param(hw.name, "compute of"),
                Param("bucket_bytes", "quantity", SIM["bucket_bytes"], "bucket size",
                      minimum=1, maximum=1e13, why="10 TB at most; and at most 2,000,000 buckets"),
                Param("tokens_per_gpu", "quantity", SIM["tokens_per_gpu"],
                      "tokens per GPU", maximum=1e9, why="a billion at most", count_units=True),
                Param("latency", "quantity", hw.small_message_latency,
                      "small-message latency α′ (s)", allow_zero=True, maximum=1,
                      why="a second at most"),
                Param("bandwidth", "quantity", hw.intra_bw, "bandwidth per GPU (B/s)",
                      minimum=1e3, maximum=1e15, why="1 kB/s to 1 PB/s"),
                Param("n", "count", hw.devices_per_node if self.measured.hardware else SIM["n"],
                      "GPUs in the ring", minimum=2,
                      maximum=plan.memory.MAX_GPUS, why="no cluster holds more than a million"),
                Param("collective", "choice", SIM["collective"], "gradient collective",
                      choices=lambda: ["all_reduce", "reduce_scatter"]),
            ], self.overlap, "one backward with bucketed gradient communication (guide §4)"),
            Endpoint("roofline", [
                self._hardware_param(preset),
                Param("n", "count", ROOF["n"], "data-parallel GPUs",
                      optional=True, maximum=plan.memory.MAX_GPUS,
                      why="no cluster holds more than a million"),
                Param("axes", "count", ROOF["axes"], "mesh axes doing DP", maximum=3,
                      why="a mesh has at most 3 axes"),
                Param("experts", "count", ROOF["experts"], "experts E", maximum=100_000),
                Param("experts_per_token", "count", ROOF["experts_per_token"],
                      "experts per token k", maximum=100_000),
                Param("batch_tokens", "quantity", ROOF["batch_tokens"],
                      "global batch (tokens)", minimum=1, maximum=1e15,
                      why="a quadrillion at most", count_units=True),
                *_lever_params(),
            ], self.roofline, "tokens-per-GPU threshold, minimum batch, maximum GPUs (guide §7)"),
            Endpoint("batch", [
                Param("target_tokens", "quantity", BATCH["target_tokens"],
                      "target global batch (tokens)", minimum=1, maximum=1e15,
                      why="a quadrillion at most", count_units=True),
                Param("seq", "count", BATCH["seq"], "sequence length",
                      maximum=plan.memory.MAX_SEQ, why="ten million tokens at most"),
                Param("micro_batch", "count", BATCH["micro_batch"],
                      "micro-batch mbs", maximum=plan.memory.MAX_MICRO_BATCH),
                Param("dp", "count", BATCH["dp"], "data-parallel GPUs dp",
                      maximum=plan.memory.MAX_GPUS, why="no cluster holds more than a million"),
            ], self.batch, "gbs = mbs × grad_acc × dp (guide §6.1)"),
            Endpoint("recommend", [
                self._model_param(REC["model"], with_custom=False),
                Param("config", "text", None, "config.json (instead of the preset)", optional=True),
                self._hardware_param(REC["hardware"]),
                Param("nodes", "count", REC["nodes"], "nodes", maximum=RECOMMEND_MAX_NODES,
                      why="the search answers in about a second up to this"),
                Param("gpus_per_node", "count", REC["gpus_per_node"],
                      "GPUs per node (empty: the hardware's)", optional=True, maximum=64,
                      why="no node holds more"),
                Param("global_batch_tokens", "quantity", REC["global_batch_tokens"],
                      "target global batch (tokens)", minimum=1, maximum=1e12,
                      why="a trillion at most", count_units=True),
                Param("seq", "count", REC["seq"], "sequence length", maximum=1_000_000,
                      why="a million tokens at most"),
                _optimizer_param(REC["optimizer"]),
                Param("attention", "choice", REC["attention"], "attention implementation",
                      choices=lambda: list(ATTENTION)),
                Param("efficiency", "quantity", REC["efficiency"],
                      "fraction of peak FLOP/s (empty: the hardware's compute model)",
                      maximum=1, why="a fraction of peak FLOP/s", optional=True),
                Param("headroom", "quantity", REC["headroom"], "fraction of HBM kept free",
                      allow_zero=True, maximum=0.99, why="a fraction of HBM"),
            ], self.recommend, "the fastest configurations that fit, ranked (plan recommend)"),
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
            field = getattr(exc, "field", None) or field_of(str(exc), endpoint.params)
            zh = getattr(exc, "message_zh", None) or f"输入无法计算：{exc}"
            raise ApiError(field, str(exc), "", zh) from None

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

    def model(self, model, config):
        m = self._config_model(config) if config else plan.get_model(model)
        return {"model": m.to_dict(), "labels": {"params": fmt_count(m.params),
                                                 "active": fmt_count(m.active)}}

    @staticmethod
    def _config_model(text):
        try:
            return parse_config(text, name="config.json", source="config.json pasted on the page")
        except ValueError as exc:
            raise ApiError("config", str(exc), "a Hugging Face config.json",
                           f"config.json 无法读取：{exc}") from None

    def _memory_model(self, model, config, params, shape, tied):
        given = [n for n in SHAPE_NAMES if shape[n] is not None]
        if model != CUSTOM:
            extra = ([n for n, v in (("config", config), ("params", params)) if v] + given
                     + (["tied"] if tied else []))
            if extra:
                raise ApiError(extra[0], f"model {model} fixes the shape and size, so {extra[0]} "
                               f"would be ignored: choose model custom to give your own",
                               "empty with a preset",
                               f"模型 {model} 已确定结构和规模，{extra[0]} 会被忽略：请先选择 custom")
            return plan.get_model(model)
        if config:
            extra = (["params"] if params else []) + given
            if extra:
                raise ApiError(extra[0], f"config fixes the shape and size, so {extra[0]} would "
                               "be ignored: clear it, or clear config", "empty with config",
                               f"config.json 已确定结构和规模，{extra[0]} 会被忽略：请清空其一")
            return self._config_model(config)
        if params is None and not given:
            raise ApiError("params", "model custom needs params, a shape (layers, hidden, ...) "
                           "or a config.json", "a number",
                           "custom 模型需要参数量、结构（层数、隐藏维度……）或 config.json")
        try:
            return plan.custom_model(
                params=params, layers=shape["layers"], hidden=shape["hidden"],
                heads=shape["heads"], ffn=shape["ffn"], vocab=shape["vocab"],
                experts=shape["experts"] or 1, experts_per_token=shape["experts_per_token"] or 1,
                kv_heads=shape["kv_heads"], shared_experts=shape["shared_experts"] or 0,
                tied_embeddings=tied)
        except ValueError as exc:
            field = getattr(exc, "field", None) or field_of(str(exc), self.endpoints()["memory"].params)
            raise ApiError(field or "layers", str(exc)) from None

    def memory(self, model, config, params, tied, precision, k, optimizer, n, fp32_grad_acc, hardware,
               seq, micro_batch, recompute, attention, shard_size, compress, **shape):
        m = self._memory_model(model, config, params, shape, tied)
        hw = self.get_hardware(hardware)

        def bill(gpus):
            return plan.memory_plan(m, gpus, hw, precision, k, fp32_grad_acc, seq, micro_batch,
                                    recompute, shard_size=shard_size, optimizer=optimizer,
                                    attention=attention)

        mp = bill(n)
        try:  # the step's communication by leg (guide §14), where n fits this hardware's network
            comm = [_comm_labels(plan.step_comm(hw, n, s, m.params, shard_size, precision, compress))
                    for s in plan.memory.STAGES]
        except ValueError as exc:
            if getattr(exc, "field", None) == "shard_size":
                raise
            comm = None
        rows = []
        for s in mp.stages:
            rows.append(dict(s, label=fmt_bytes(s["model_state_bytes"]),
                             total_label=fmt_bytes(s["total_bytes"])))
        act = None if mp.activations is None else dict(
            mp.activations, label=fmt_bytes(mp.activations["total_bytes"]))
        curve_n = sorted({2**i for i in range(LOG2_MAX_GPUS + 1)} | {n})
        if shard_size is not None:  # the curve keeps g: only N that g divides
            curve_n = [gpus for gpus in curve_n if gpus % shard_size == 0]
        curve = {STAGE_NAMES[s]: [] for s in plan.memory.STAGES}
        for gpus in curve_n:
            for s in bill(gpus).stages:
                curve[s["stage_name"]].append(s["total_bytes"])
        return dict(mp.to_dict(), model=m.to_dict(), stages=rows, activations=act, comm=comm,
                    compress=compress,
                    hbm_label=fmt_bytes(hw.hbm_bytes), curve={"n": curve_n, "bytes": curve},
                    labels={"params": fmt_count(m.params), "n": plural(n, "GPU"),
                            "active": fmt_count(m.active)})

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

    def roofline(self, hardware, n, axes, experts, experts_per_token, batch_tokens, shard_size,
                 compress):
        hw = self.get_hardware(hardware)
        kw = dict(axes=axes, experts=experts, experts_per_token=experts_per_token,
                  shard_size=shard_size, compress=compress)
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
        if shard_size is not None:  # the curve keeps g: only sizes that g divides
            sizes = {size for size in sizes if size % shard_size == 0}
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
                **roofline_labels(here),  # the CLI's own strings
                "shard_size": "flat" if here.shard_size is None else
                f"{here.shard_size}" + (f" × {here.replicas} replicas" if here.replicas else ""),
            },
        }

    def batch(self, target_tokens, seq, micro_batch, dp):
        p = plan.plan_batch(target_tokens, seq, micro_batch, dp)
        sizes = sorted({2**i for i in range(LOG2_MAX_GPUS + 1)} | {dp})
        sweep = []
        for size in sizes:
            try:
                sweep.append(plan.plan_batch(target_tokens, seq, micro_batch, size))
            except ValueError:  # too many micro-steps at this dp: not drawn
                pass
        return {
            "plan": p.to_dict(),
            "sweep": {"dp": [s.dp for s in sweep], "exact_grad_acc": [s.exact_grad_acc for s in sweep],
                      "grad_acc": [s.grad_acc for s in sweep],
                      "gpu_rich": [s.gpu_rich for s in sweep]},
            "warnings_zh": _batch_warnings_zh(p),
            "labels": {"target": fmt_count(target_tokens),
                       "global_batch_tokens": fmt_count(p.global_batch_tokens),
                       "exact_grad_acc": f"{p.exact_grad_acc:.3g}"},  # as zerodp plan batch prints it
        }



    def recommend(self, model, config, hardware, nodes, gpus_per_node, global_batch_tokens, seq,
                  optimizer, attention, efficiency, headroom):
        m = self._config_model(config) if config else model
        r = plan.recommend(m, self.get_hardware(hardware), nodes=nodes,
                           gpus_per_node=gpus_per_node, global_batch_tokens=global_batch_tokens,
                           seq=seq, attention=attention, efficiency=efficiency, headroom=headroom,
                           optimizer=optimizer)
        d = r.to_dict()
        d["columns"] = RECOMMEND_COLUMNS
        d["rows"] = recommend_rows(r)  # the CLI's cells, its rounding
        d["rows_zh"] = [[recommend_zh(cell) for cell in row] for row in d["rows"]]
        d["rejected"] = [dict(x, example_zh=recommend_zh(x["example"])) for x in d["rejected"]]
        d["notes_zh"] = [recommend_zh(x) for x in d["notes"]]
        d["text"] = recommend_text(r)
        d["efficiency_source_zh"] = _source_zh(r.efficiency_source)
        d["labels"] = {"n": plural(r.n, "GPU"), "samples": f"{r.samples:,}",
                       "target": fmt_count(r.global_batch_tokens), "hbm": fmt_bytes(r.hbm_bytes)}
        return d


def _source_zh(source: str) -> str:
    """Where recommend's compute figures come from, in Chinese (the page's 计算 line)."""
    import re
    if source.startswith("calibration profile"):
        return "校准文件（实测的前向、反向和优化器时间）"
    m = re.match(r"given: (\S+) of peak", source)
    if m:
        return f"给定：每种配置都按峰值的 {m.group(1)}"
    return (source.replace(" compute model: matmul ", " 计算模型：矩阵乘法持续达到峰值的 ")
            .replace(" of peak sustained (MAMF), FlashAttention ", "（MAMF），FlashAttention ")
            .replace(", HBM ", "，HBM ").replace("; assumed: ", "；假设值：")
            .replace(", clock x", "，时钟 ×").replace(' (docs/planner.md, "The compute model")',
                                                     "（各常数的来源和日期见规划器文档的“计算模型”一节）"))


def _batch_warnings_zh(p) -> list[str]:
    """The batch plan's warnings in Chinese, from the plan's own fields."""
    out = []
    if p.gpu_rich:
        out.append(f"GPU 过多：全局批次 {p.samples} 个样本 < mbs×dp = {p.micro_batch * p.dp}；"
                   f"最多用 {max(p.samples // p.micro_batch, 1)} 张卡，或加大全局批次、减小微批次")
    elif p.exact_grad_acc != p.grad_acc:
        out.append(f"不能整除：全局批次 {p.samples} / (mbs {p.micro_batch} × dp {p.dp}) = "
                   f"{p.exact_grad_acc:.3g}；梯度累积取 {p.grad_acc}，每步处理 "
                   f"{p.effective_samples} 个样本")
    return out
