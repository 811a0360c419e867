"""The guide's worked examples, recomputed by the planner (``zerodp plan report``, ``make demo``).

Each row names the guide section, the quantity, the value the planner computes, and the value the
guide quotes, so a reader can check one against the other (guide §9.4 and the sections it draws on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerodp.plan._common import GB, MB, ToDict, fmt_bytes, fmt_count, fmt_time, table
from zerodp.plan.batch import plan_batch
from zerodp.plan.collectives import collective_time
from zerodp.plan.hardware import get_hardware
from zerodp.plan.memory import ADAM_K, BF16, max_params, model_states
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
