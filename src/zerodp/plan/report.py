"""The guide's worked examples, recomputed by the planner (``zerodp plan report``, ``make demo``),
and published FSDP runs predicted by it (``zerodp plan validate``, :func:`validate`).

Each row names the guide section, the quantity, the value the planner computes, and the value the
guide quotes, so a reader can check one against the other (guide §9.4 and the sections it draws on).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from zerodp.plan._common import GB, MB, ToDict, fmt_bytes, fmt_count, fmt_time, table
from zerodp.plan.batch import plan_batch
from zerodp.plan.collectives import collective_time
from zerodp.plan.hardware import get_hardware
from zerodp.plan._common import BF16
from zerodp.plan.memory import ADAM_K, max_params, model_states
from zerodp.plan.models import get_model
from zerodp.plan.units import STAGE_NAMES, STAGES
from zerodp.plan.roofline import layer_prefetch, max_devices, threshold
from zerodp.plan.timeline import model_layers, simulate_backward
from zerodp.plan.collectives import network_cost

#: guide §7.2: Llama 3 405B trained on about 16K H100s
LLAMA3_405B_GPUS = 16384
#: guide §7.2: DeepSeek-V3 on 2048 H800s
DEEPSEEK_V3_GPUS = 2048
#: guide §7.2: TPU v5p pod
TPU_POD_CHIPS = 8960
#: guide §7.5: DeepSeek-V2's largest batch, 9216 sequences of 4K tokens; a 16M-token batch
DEEPSEEK_V2_BATCH_TOKENS = 9216 * 4096
LLAMA3_FINAL_BATCH_TOKENS = 16e6
#: guide §6.1 example: 4M tokens, 4k sequences, mbs 2 on 128 or 512 GPUs
BATCH_EXAMPLE = dict(target_tokens=4 * 2**20, seq=4096, micro_batch=2)
#: guide §2.4: an 8B model's bf16 gradients
EIGHT_B = 8e9
#: guide §4 demo on 8×H100: tokens per GPU for the overlapped and the communication-bound cases
DEMO_TOKENS, DEMO_FEW_TOKENS = 4096, 256
DEMO_BUCKETS = (50e3, 25e6, 10e9)


@dataclass(frozen=True)
class ReportRow(ToDict):
    """``key`` (stable id), ``section`` (guide §), ``quantity``, ``value`` (number, in ``unit``),
    ``unit``, ``shown`` (value as printed), ``seed`` (what the guide says)."""

    key: str
    section: str
    quantity: str
    value: float
    unit: str
    shown: str
    seed: str


@dataclass(frozen=True)
class Report(ToDict):
    """``rows`` (ReportRows) and ``simulation`` (rows of the guide §4 bucket demo)."""

    rows: list = field(default_factory=list)
    simulation: list = field(default_factory=list)

    def row(self, key: str) -> ReportRow:
        for r in self.rows + self.simulation:
            if r.key == key:
                return r
        raise KeyError(key)

    def text(self) -> str:
        def fmt(rows):
            return [[r.section, r.quantity, r.shown, r.seed] for r in rows]

        return "\n\n".join([
            table(["guide", "quantity", "planner", "guide says"], fmt(self.rows), align="llrl",
                  title="The guide's worked examples, recomputed by zerodp.plan"),
            table(["guide", "quantity", "planner", "guide says"], fmt(self.simulation), align="llrl",
                  title=_demo_title()),
        ])


def _demo_title() -> str:
    hw = get_hardware("H100")
    return (f"Guide §4 bucket demo: llama3-8b on 8x{hw.name}, α′ = {fmt_time(hw.small_message_latency)}, "
            f"NVLink {hw.intra_bw / GB:g} GB/s")


def _row(key, section, quantity, value, unit, shown, seed):
    return ReportRow(key, section, quantity, float(value), unit, shown, seed)


def build_report() -> Report:
    """Recompute every number of the guide's worked examples (and its bucket demo, guide §4) with the
    public API."""
    rows = []
    names = [STAGE_NAMES[s] for s in STAGES]
    seed_mem = ["120", "31.4", "16.6", "1.88"]
    for stage in range(4):
        v = model_states(7.5e9, 64, stage, k=ADAM_K).model_state_bytes / GB
        rows.append(_row(f"memory_7.5b_stage{stage}", "§9.4", f"7.5B, k=12, N=64: {names[stage]} per GPU",
                         v, "GB", f"{v:.3g} GB", f"{seed_mem[stage]} GB"))
    v = model_states(70e9, 1, 0).param_bytes / GB
    rows.append(_row("memory_70b_bf16_params", "§8", "70B: bf16 parameters alone", v, "GB",
                     f"{v:.3g} GB", "140 GB"))
    v = model_states(70e9, 64, 2).model_state_bytes / GB
    rows.append(_row("memory_70b_zero2_64", "§9.4", "70B on 64 GPUs, ZeRO-2", v, "GB",
                     f"{v:.4g} GB", "> 140 GB"))
    tpu = get_hardware("TPU v5p")
    v = max_params(tpu.hbm_bytes, BF16 + 8).max_params / 1e9
    rows.append(_row("max_params_pure_dp", "§8", "pure DP max model, 10 B/param, 96 GB", v, "B params",
                     f"{v:.3g}B", "≈ 9B"))
    grads = BF16 * EIGHT_B
    v = collective_time("all_reduce", grads, 8, "H100").bandwidth_s * 1e3
    rows.append(_row("allreduce_8b_node", "§2.4", "8B bf16 grads AllReduce, 8xH100 NVLink", v, "ms",
                     f"{v:.3g} ms", "≈ 62 ms"))
    v = collective_time("all_reduce", grads, LLAMA3_405B_GPUS, "H100").bandwidth_s * 1e3
    rows.append(_row("allreduce_8b_nodes", "§2.4", "same across 2048 nodes, 400 GB/s each", v, "ms",
                     f"{v:.3g} ms", "≈ 80 ms"))
    v = collective_time("all_reduce", 0, 8, "H100").latency_bytes / MB
    rows.append(_row("latency_bytes_h100", "§4", "bytes NVLink moves in α′ = 16 µs", v, "MB",
                     f"{v:.2g} MB", "≈ 7 MB"))
    b128 = plan_batch(dp=128, **BATCH_EXAMPLE)
    b512 = plan_batch(dp=512, **BATCH_EXAMPLE)
    rows.append(_row("batch_samples", "§6.1", "gbs 4M tokens / seq 4k", b128.samples, "samples",
                     str(b128.samples), "1024"))
    rows.append(_row("batch_grad_acc_128", "§6.1", "mbs 2 on 128 GPUs: grad_acc", b128.grad_acc, "",
                     str(b128.grad_acc), "4"))
    rows.append(_row("batch_grad_acc_512", "§6.1", "mbs 2 on 512 GPUs: grad_acc", b512.grad_acc, "",
                     str(b512.grad_acc), "1"))
    for key, sec, q, v, seed in [
        ("threshold_h100_nodes", "§7.2", "H100 across nodes", threshold("H100").threshold_tokens, "2475"),
        ("c_over_w_h100_node", "§10.2", "H100 inside a node, C/W", threshold("H100").intra_c_over_w, "≈ 2200"),
        ("threshold_h100_2nodes", "§7.3", "H100 on 2 nodes (NVLink leg)", threshold("H100", 16).threshold_tokens,
         "≈ 1900"),
        ("threshold_h800_nodes", "§7.2", "H800 across nodes (229 GB/s leg)", threshold("H800").threshold_tokens,
         "≈ 4300"),
        ("threshold_tpu_1axis", "§10.1", "TPU v5p, one axis", threshold("TPU v5p").threshold_tokens, "2550"),
        ("threshold_tpu_3axes", "§7.2", "TPU v5p, three axes", threshold("TPU v5p", axes=3).threshold_tokens, "850"),
        ("threshold_gpt_oss", "§7.3", "gpt-oss-120b (E/k = 32) on H100",
         threshold("H100", model="gpt-oss-120b").threshold_tokens, "≈ 79,000"),
        ("threshold_deepseek_v3", "§7.3", "DeepSeek-V3 (E/k = 32) on H800",
         threshold("H800", model="deepseek-v3").threshold_tokens, "≈ 138,000"),
    ]:
        rows.append(_row(key, sec, q + ": tokens/GPU", v, "tokens", f"{v:,.0f}", seed))
    for key, sec, q, r, seed in [
        ("min_batch_llama3_405b", "§7.2", f"Llama 3 405B on {LLAMA3_405B_GPUS} H100: min batch",
         threshold("H100", LLAMA3_405B_GPUS), "≈ 40M (used 16M)"),
        ("min_batch_deepseek_v3_dense", "§7.2", f"DeepSeek-V3 on {DEEPSEEK_V3_GPUS} H800, if dense",
         threshold("H800", DEEPSEEK_V3_GPUS), "≈ 8.8M"),
        ("min_batch_tpu_pod", "§7.2", f"TPU v5p pod of {TPU_POD_CHIPS}, 3 axes: min batch",
         threshold("TPU v5p", TPU_POD_CHIPS, axes=3), "≈ 7.6M"),
    ]:
        rows.append(_row(key, sec, q, r.min_batch_tokens, "tokens", fmt_count(r.min_batch_tokens) + " tokens", seed))
    for key, q, batch, seed in [
        ("max_chips_deepseek_v2", "DeepSeek-V2 batch 9216x4K at 850/chip", DEEPSEEK_V2_BATCH_TOKENS, "≈ 44,000"),
        ("max_chips_16m", "16M-token batch at 850/chip", LLAMA3_FINAL_BATCH_TOKENS, "≈ 18,800"),
    ]:
        v = max_devices("TPU v5p", batch, axes=3).max_devices
        rows.append(_row(key, "§7.5", q, v, "chips", f"{v:,} chips", seed))
    p = layer_prefetch(4096, 4096, 1, 8, "H100")
    rows.append(_row("fsdp_prefetch_h100", "§10.2", "FSDP layer h=4096, seq 4096, mbs 1, 8xH100: "
                     "forward/AllGather", p.ratio, "x", f"{p.ratio:.2f}x (hidden)" if p.hidden_by_compute
                     else f"{p.ratio:.2f}x (exposed)", "hidden (> C/W ≈ 2200)"))
    return Report(rows=rows, simulation=bucket_demo())


def bucket_demo() -> list[ReportRow]:
    """The four states of the guide §4 bucket demo, from the simulator."""
    cost = network_cost("H100", 8)
    out = []
    for tokens in (DEMO_TOKENS, DEMO_FEW_TOKENS):
        layers = model_layers(get_model("llama3-8b"), "H100", tokens)
        for size in DEMO_BUCKETS:
            r = simulate_backward(layers, cost, size)
            label = f"{tokens} tokens/GPU, bucket {fmt_bytes(size)}"
            shown = (f"{r.num_buckets:,} buckets, comm {r.comm_s * 1e3:,.0f} ms, "
                     f"exposed {r.exposed_comm_s * 1e3:,.1f} ms of {r.backward_s * 1e3:.0f} ms bwd")
            out.append(_row(f"demo_{tokens}_{int(size)}", "§4", label, r.exposed_comm_s, "s", shown,
                            _demo_expectation(tokens, size)))
    return out


def _demo_expectation(tokens: int, size: float) -> str:
    if tokens == DEMO_FEW_TOKENS:
        return "exposed at every size"
    return {DEMO_BUCKETS[0]: "thousands, latency rules", DEMO_BUCKETS[1]: "sweet spot, small tail",
            DEMO_BUCKETS[2]: "1-2 buckets, last exposed"}[size]


# ---- the planner against published runs (zerodp plan validate) ----------------------------
#: the published FSDP runs (source, settings, measured throughput and memory): docs/planner.md,
#: "Validation against published runs", says how they were chosen
VALIDATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validation.json")
#: torch's max reserved bytes over the planner's peak (the caching allocator's slack, not
#: modelled): fitted on the one published run with memory on 8 GPUs (82.4 GiB against 72.6 GiB),
#: held out on the other (docs/planner.md)
RESERVED_OVER_PEAK = 1.135
#: the compute constants ``zerodp plan validate --fit`` fits (hardware.ComputeConstants)
FITTED = ("token_knee", "elementwise_passes", "layer_overhead_s", "attention_scale")


def load_validation(path: str = VALIDATION_FILE) -> dict:
    """The validation table: ``tps_band``, ``memory_band`` and ``runs`` (docs/planner.md)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _run_model(spec):
    from zerodp.plan.models import custom_model
    if isinstance(spec, str):
        return get_model(spec)
    d = dict(spec)
    return custom_model(name=d.pop("name"), **d)


def predict_run(run: dict, constants=None) -> dict:
    """The planner's prediction of one published run as it ran (its stage, GPUs, micro-batch,
    grad_acc, sequence and recomputation; no search): ``tps`` per GPU, ``step_s``, ``mfu``,
    ``peak_gib`` (the planner's peak per GPU) and ``memory_gib`` (× :data:`RESERVED_OVER_PEAK`,
    what torch reports as reserved)."""
    from zerodp.plan.hardware import with_power_limit
    from zerodp.plan.recommend import recommend

    m = _run_model(run["model"])
    hw = with_power_limit(get_hardware(run["hardware"]), run.get("power_limit_w"))
    n = run["gpus"]
    gpn = min(n, hw.devices_per_node)
    mbs, ga, seq = run["micro_batch"], run["grad_acc"], run["seq"]
    r = recommend(m, hw, n // gpn, gpn, mbs * ga * n * seq, seq, stages=(run.get("stage", 3),),
                  recompute=(run["recompute"],), compress=("none",), bucket_mb=(25,),
                  micro_batches=[mbs], shard_sizes_searched=[n], round_batch=False,
                  require_fit=False, top=1, headroom=0.0, constants=constants)
    c = r.candidates[0]
    return {"tps": c.tokens_per_s_per_gpu, "step_s": c.step_s, "mfu": c.mfu,
            "peak_gib": c.memory_bytes / 2**30, "memory_gib": c.memory_bytes * RESERVED_OVER_PEAK / 2**30}


@dataclass(frozen=True)
class Validation(ToDict):
    """``zerodp plan validate``: ``rows`` (per run: ``id``, ``source``, ``url``, ``date``,
    ``hardware``, ``model``, ``gpus``, ``micro_batch``, ``grad_acc``, ``seq``, ``recompute``,
    ``measured_tps``, ``predicted_tps``, ``tps_ratio``, ``measured_memory_gib`` (null where the
    source gives none), ``predicted_memory_gib``, ``peak_gib``, ``memory_ratio``, ``within``),
    ``tps_band``, ``memory_band``, ``constants`` (the compute constants used), ``ok`` (every row
    within its bands) and ``holdout`` (``--holdout``: per split the fitted constants and the
    errors on the runs fitted and held out)."""

    rows: list
    tps_band: float
    memory_band: float
    constants: dict
    ok: bool
    holdout: list = field(default_factory=list)

    def text(self) -> str:
        cells = [[r["id"], r["hardware"], str(r["gpus"]), f"{r['micro_batch']}x{r['seq']}",
                  r["recompute"], f"{r['measured_tps']:,.0f}", f"{r['predicted_tps']:,.0f}",
                  f"{r['tps_ratio']:.3f}",
                  "-" if r["measured_memory_gib"] is None else f"{r['measured_memory_gib']:.1f}",
                  f"{r['predicted_memory_gib']:.1f}",
                  "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}",
                  "yes" if r["within"] else "NO"] for r in self.rows]
        ratios = [r["tps_ratio"] for r in self.rows]
        out = [table(["run", "hardware", "GPUs", "mbs x seq", "recompute", "TPS/GPU", "predicted",
                      "ratio", "GiB", "predicted GiB", "ratio", "in band"], cells,
                     title=f"The planner against {len(self.rows)} published FSDP runs "
                           f"(TPS/GPU within ±{self.tps_band:.0%}, memory within "
                           f"±{self.memory_band:.0%} where published)",
                     align="llrrlrrrrrrl"),
               f"TPS ratios {min(ratios):.3f}-{max(ratios):.3f}, mean |error| "
               f"{sum(abs(x - 1) for x in ratios) / len(ratios):.1%}; predicted GiB = the planner's "
               f"peak x {RESERVED_OVER_PEAK} (torch's reserved over allocated, fitted on one run); "
               "sources and settings: zerodp/plan/validation.json",
               "constants: " + ", ".join(f"{k} {v:.3g}" for k, v in self.constants.items())]
        for h in self.holdout:
            out.append(f"hold-out {h['split']}: fitted {', '.join(f'{k} {v:.3g}' for k, v in h['constants'].items())}; "
                       f"error on the {h['fitted_runs']} fitted runs max {h['fit_max']:.1%} (rms "
                       f"{h['fit_rms']:.1%}), on the {h['held_runs']} held out max {h['held_max']:.1%} "
                       f"(rms {h['held_rms']:.1%})")
        out.append("all within the band" if self.ok else "OUTSIDE THE BAND: see the rows marked NO")
        return "\n".join(out)


def _log_error(runs, constants) -> float:
    return sum(math.log(predict_run(r, constants)["tps"] / r["measured_tps_per_gpu"]) ** 2
               for r in runs)


def _nelder_mead(f, x0, step=0.5, iters=150):
    """Minimize ``f`` from ``x0`` (a plain Nelder-Mead simplex, deterministic)."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        cen = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [2 * cen[j] - pts[-1][j] for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [3 * cen[j] - 2 * pts[-1][j] for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [(cen[j] + pts[-1][j]) / 2 for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[(pts[0][j] + p[j]) / 2 for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = min(range(n + 1), key=vals.__getitem__)
    return pts[best]


def fit_constants(runs, start=None, iters: int = 150):
    """The compute constants :data:`FITTED` that minimize Σ log(predicted/measured TPS)² over
    ``runs`` (the others as ``start``, default :data:`~zerodp.plan.hardware.COMPUTE`)."""
    from dataclasses import replace as _replace

    from zerodp.plan.hardware import COMPUTE
    base = COMPUTE if start is None else start
    x0 = [math.log(getattr(base, k)) for k in FITTED]

    def make(x):
        return _replace(base, **{k: math.exp(v) for k, v in zip(FITTED, x)})
    return make(_nelder_mead(lambda x: _log_error(runs, make(x)), x0, iters=iters))


def _errors(runs, constants) -> tuple[float, float]:
    e = [predict_run(r, constants)["tps"] / r["measured_tps_per_gpu"] - 1 for r in runs]
    return max(abs(x) for x in e), math.sqrt(sum(x * x for x in e) / len(e))


def holdout(runs, iters: int = 150) -> list[dict]:
    """Fit on some runs, predict the others: alternate rows both ways, and by source (fit on
    one framework's runs, predict the other's)."""
    tt = [r for r in runs if r["id"].startswith("tt-")]
    mo = [r for r in runs if not r["id"].startswith("tt-")]
    splits = [("even rows -> odd rows", runs[0::2], runs[1::2]),
              ("odd rows -> even rows", runs[1::2], runs[0::2]),
              ("MosaicML -> torchtitan", mo, tt), ("torchtitan -> MosaicML", tt, mo)]
    out = []
    for name, fit_on, held in splits:
        c = fit_constants(fit_on, iters=iters)
        fmax, frms = _errors(fit_on, c)
        hmax, hrms = _errors(held, c)
        out.append({"split": name, "constants": {k: getattr(c, k) for k in FITTED},
                    "fitted_runs": len(fit_on), "held_runs": len(held), "fit_max": fmax,
                    "fit_rms": frms, "held_max": hmax, "held_rms": hrms})
    return out


def validate(constants=None, path: str = VALIDATION_FILE, with_holdout: bool = False) -> Validation:
    """Every run of the validation table against the planner (``zerodp plan validate``)."""
    from zerodp.plan.hardware import COMPUTE
    data = load_validation(path)
    c = COMPUTE if constants is None else constants
    rows = []
    for run in data["runs"]:
        p = predict_run(run, c)
        ratio = p["tps"] / run["measured_tps_per_gpu"]
        mem = run.get("measured_memory_gib")
        mratio = None if mem is None else p["memory_gib"] / mem
        within = abs(ratio - 1) <= data["tps_band"] and (mratio is None or
                                                          abs(mratio - 1) <= data["memory_band"])
        model = run["model"] if isinstance(run["model"], str) else run["model"]["name"]
        rows.append({"id": run["id"], "source": run["source"], "url": run["url"], "date": run["date"],
                     "hardware": run["hardware"], "model": model, "gpus": run["gpus"],
                     "micro_batch": run["micro_batch"], "grad_acc": run["grad_acc"], "seq": run["seq"],
                     "recompute": run["recompute"], "measured_tps": run["measured_tps_per_gpu"],
                     "predicted_tps": p["tps"], "tps_ratio": ratio, "measured_memory_gib": mem,
                     "predicted_memory_gib": p["memory_gib"], "peak_gib": p["peak_gib"],
                     "memory_ratio": mratio, "within": within})
    return Validation(rows, data["tps_band"], data["memory_band"],
                      {k: getattr(c, k) for k in ("hidden_knee",) + FITTED},
                      all(r["within"] for r in rows),
                      holdout(data["runs"]) if with_holdout else [])
