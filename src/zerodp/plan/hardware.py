"""Hardware presets and user hardware files (guide §2.4, §4, §7.2, §8).

A :class:`Hardware` holds what the guide's cost models need about one accelerator and its network:

==================  =========================================================================
field               meaning
==================  =========================================================================
``flops``           dense bf16 FLOP/s per device (the guide's C)
``hbm_bytes``       device memory in bytes
``intra_bw``        per-device bandwidth inside a node, one direction, bytes/s, for one DP axis
                    (NVLink per GPU; TPU: the two ICI links of one torus axis)
``devices_per_node`` devices that share the intra-node fabric (TPU: one pod is one ICI domain)
``inter_bw``        inter-node egress per node, one direction, bytes/s (0: no inter-node network)
``alpha``           latency of one ring step, seconds. A small-message AllReduce on a full node
                    costs α′ = 2(g−1)·α, which is what nccl-tests reports (guide §4: α′ ≈ 16 µs)
``inter_alpha``     latency of one ring step across nodes (defaults to ``alpha``)
``inter_group_bw``  bandwidth between replica groups, bytes/s per GPU, one way (guide §16: a link
                    slower than the nodes' own network joining groups of nodes; None: the
                    inter-node figures, each GPU's share of its node's ``inter_bw``)
``inter_group_alpha`` latency of one ring step between replica groups, seconds (None:
                    ``inter_alpha``)
``axes``            mesh axes that can each carry DP traffic at ``intra_bw`` at once (TPU torus: 3)
``hbm_bw``          HBM bandwidth per device, bytes/s (0: unknown; the compute model then
                    assumes flops / 300, an A100-like ratio)
``matmul_efficiency`` sustained fraction of ``flops`` a large bf16 GEMM reaches (the maximum
                    achievable matmul FLOPS, MAMF, over the peak; 0: :data:`GENERIC_MATMUL`)
``attention_efficiency`` fraction of ``flops`` FlashAttention's forward + backward reaches
                    (0: :data:`GENERIC_ATTENTION`)
``tdp_w``, ``power_limit_w`` the board's power at its rated clock and the limit the run sets
                    (0: at TDP); a limit scales the compute clock by (limit/TDP)^(1/3)
==================  =========================================================================

The step's compute (:func:`zerodp.plan.compute.step_compute`) is priced from these: matrix multiplications at
``flops × matmul_efficiency`` scaled by the GEMM's shape (hidden size, tokens per micro-batch),
FlashAttention at ``flops × attention_efficiency``, memory-bound elementwise work at ``hbm_bw``,
a per-layer overhead, the recomputation the mode actually runs and the optimizer step's HBM
traffic; the shape constants shared by all hardware are :data:`COMPUTE` (docs/planner.md,
"The compute model": sources, dates, and how they were fitted).

Hardware files (``load_hardware``) are TOML or JSON objects with exactly these keys (``name``,
``flops``, ``hbm_bytes``, ``intra_bw``, ``devices_per_node`` required; ``inter_bw`` defaults to 0,
``axes`` to 1). Instead of ``alpha`` a file may give ``small_message_latency`` (α′, seconds, measured
on ``devices_per_node`` ranks); ``alpha`` is then α′/(2(g−1)). ``zerodp calibrate`` writes this
schema. Numbers may be written as strings with suffixes ("450e9", "80GB").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace

from zerodp.plan._common import ToDict, check_count, check_positive, parse_quantity

#: guide §4: "8×H100 节点内 AllReduce 一个很小的张量，实测要 16 µs 左右" (nccl-tests, one node)
H100_SMALL_MESSAGE_LATENCY = 16e-6
#: NVIDIA HGX nodes carry 8 GPUs on one NVSwitch fabric
GPUS_PER_HGX_NODE = 8
#: guide §7.2/§10: TPU v5p: 9e10 B/s per ICI link one way, 2 links per axis (wraparound ring)
TPU_V5P_ICI_LINK_BW = 9e10
TPU_V5P_LINKS_PER_AXIS = 2
TPU_V5P_POD_CHIPS = 8960


@dataclass(frozen=True)
class Hardware(ToDict):
    """One accelerator type and its network, as the guide's formulas see it (module docstring)."""

    name: str
    flops: float
    hbm_bytes: float
    intra_bw: float
    devices_per_node: int
    inter_bw: float = 0.0
    alpha: float = 0.0
    inter_alpha: float | None = None
    axes: int = 1
    note: str = ""
    hbm_bw: float = 0.0
    matmul_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    tdp_w: float = 0.0
    power_limit_w: float = 0.0
    inter_group_bw: float | None = None
    inter_group_alpha: float | None = None

    def __post_init__(self):
        if not self.name:
            raise ValueError("hardware name must be a non-empty string")
        check_positive("flops", self.flops)
        check_positive("hbm_bytes", self.hbm_bytes)
        check_positive("intra_bw", self.intra_bw)
        check_count("devices_per_node", self.devices_per_node)
        check_positive("inter_bw", self.inter_bw, allow_zero=True)
        check_positive("alpha", self.alpha, allow_zero=True)
        if self.inter_alpha is not None:
            check_positive("inter_alpha", self.inter_alpha, allow_zero=True)
        check_count("axes", self.axes)
        check_positive("hbm_bw", self.hbm_bw, allow_zero=True)
        for name in ("matmul_efficiency", "attention_efficiency"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be a fraction of flops in [0, 1], got {value!r}")
        check_positive("tdp_w", self.tdp_w, allow_zero=True)
        check_positive("power_limit_w", self.power_limit_w, allow_zero=True)
        if self.inter_group_bw is not None:
            check_positive("inter_group_bw", self.inter_group_bw)
        if self.inter_group_alpha is not None:
            check_positive("inter_group_alpha", self.inter_group_alpha, allow_zero=True)
        if self.power_limit_w and self.tdp_w and self.power_limit_w > self.tdp_w:
            raise ValueError(f"power_limit_w ({self.power_limit_w:g} W) above tdp_w "
                             f"({self.tdp_w:g} W): a limit can only lower the board's power")

    @property
    def node_alpha(self) -> float:
        """Ring-step latency across nodes (``inter_alpha``, else ``alpha``)."""
        return self.alpha if self.inter_alpha is None else self.inter_alpha

    @property
    def small_message_latency(self) -> float:
        """α′ = 2(g−1)·α: a tiny AllReduce on one full node (guide §4)."""
        return 2 * (self.devices_per_node - 1) * self.alpha

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["small_message_latency"] = self.small_message_latency
        return d


def _per_hop(latency: float, ranks: int) -> float:
    """α from a measured small-message AllReduce latency α′ on ``ranks`` ranks: α′/(2(ranks−1))."""
    return latency / (2 * (ranks - 1))


_ALPHA_8GPU = _per_hop(H100_SMALL_MESSAGE_LATENCY, GPUS_PER_HGX_NODE)

#: sustained fractions of peak (docs/planner.md, "The compute model", where each comes from):
#: the maximum achievable matmul FLOPS (MAMF, bf16, best shape) over the peak, measured with
#: ml-engineering's mamf-finder (S. Bekman, compute/accelerator/README.md, 2024): A100 SXM 267.9 of
#: 312 TFLOP/s, H100 SXM 792.1 of 989, GH200 (the H100 die with HBM3e, as H200) 821.0 of 989
MAMF_A100 = 267.9 / 312
MAMF_H100 = 792.1 / 989
MAMF_GH200 = 821.0 / 989
#: FlashAttention-2's forward + backward (causal, head dim 128, long sequences) as a fraction of
#: peak: about 190 TFLOP/s on A100 and about 335 TFLOP/s on H100 SXM (Dao 2023, arXiv 2307.08691,
#: fig. 6-7; on Hopper FlashAttention-2 does not use its new instructions, Shah et al. 2024)
FA2_A100 = 190e12 / 312e12
FA2_H100 = 335e12 / 989e12
#: where a part's sustained figures are not published: the H100's (an assumption, said in notes)
GENERIC_MATMUL = MAMF_H100
GENERIC_ATTENTION = FA2_H100

PRESETS: dict[str, Hardware] = {h.name: h for h in [
    Hardware("H100", flops=9.9e14, hbm_bytes=80e9, intra_bw=450e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU, hbm_bw=3.35e12, matmul_efficiency=MAMF_H100,
             attention_efficiency=FA2_H100, tdp_w=700,
             note="H100 SXM5 80GB HBM3 (3.35 TB/s), 700 W; NVLink 450 GB/s per GPU one way; "
                  "8x400 Gbps NICs per node (guide §2.4)"),
    Hardware("H100 96GB", flops=9.9e14, hbm_bytes=96e9, intra_bw=450e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU, hbm_bw=2.4e12, matmul_efficiency=MAMF_H100,
             attention_efficiency=FA2_H100, tdp_w=700, power_limit_w=500,
             note="H100 SXM 96GB HBM2e (2.4 TB/s) as in Meta's Grand Teton hosts, run at their "
                  "default 500 W limit (torchtitan docs/performance.md, 2025-01); "
                  "--power-limit 700 for full TDP"),
    Hardware("H800", flops=9.9e14, hbm_bytes=80e9, intra_bw=200e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU, hbm_bw=3.35e12, matmul_efficiency=MAMF_H100,
             attention_efficiency=FA2_H100, tdp_w=700,
             note="NVLink cut to 200 GB/s per GPU one way (guide §7.2); compute, HBM and latency "
                  "assumed as H100"),
    Hardware("H200", flops=9.9e14, hbm_bytes=141e9, intra_bw=450e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU, hbm_bw=4.8e12, matmul_efficiency=MAMF_GH200,
             attention_efficiency=FA2_H100, tdp_w=700,
             note="H100 compute and NVLink with 141 GB HBM3e (4.8 TB/s); matmul as GH200's "
                  "measured MAMF (same die and memory); latency assumed as H100"),
    Hardware("A100", flops=3.12e14, hbm_bytes=80e9, intra_bw=300e9, devices_per_node=8,
             inter_bw=200e9, alpha=_ALPHA_8GPU, hbm_bw=2.039e12, matmul_efficiency=MAMF_A100,
             attention_efficiency=FA2_A100, tdp_w=400,
             note="A100 SXM 80GB HBM2e (2.04 TB/s), 400 W; NVLink3 300 GB/s per GPU one way; "
                  "8x200 Gbps HDR per node; latency assumed as H100"),
    Hardware("A100 40GB", flops=3.12e14, hbm_bytes=40e9, intra_bw=300e9, devices_per_node=8,
             inter_bw=200e9, alpha=_ALPHA_8GPU, hbm_bw=1.555e12, matmul_efficiency=MAMF_A100,
             attention_efficiency=FA2_A100, tdp_w=400,
             note="A100 SXM 40GB HBM2 (1.56 TB/s), 400 W; otherwise as A100"),
    Hardware("B200", flops=2.25e15, hbm_bytes=180e9, intra_bw=900e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU, hbm_bw=8e12, tdp_w=1000,
             note="HGX B200 (180 GB HBM3e per GPU, 8 TB/s), 1000 W; NVLink5 900 GB/s per GPU one "
                  "way; 8x400 Gbps per node; no published MAMF: matmul and attention assumed at "
                  "H100's fractions; latency assumed as H100"),
    Hardware("TPU v5p", flops=4.59e14, hbm_bytes=96e9,
             intra_bw=TPU_V5P_LINKS_PER_AXIS * TPU_V5P_ICI_LINK_BW,
             devices_per_node=TPU_V5P_POD_CHIPS, inter_bw=0.0, alpha=1e-6, axes=3,
             hbm_bw=2.765e12,
             note="3D torus; one pod (8960 chips) is one ICI domain; 2 ICI links of 9e10 B/s "
                  "per axis one way (guide §7.2); alpha 1 µs per hop is an assumption; "
                  "sustained fractions assumed as H100's"),
]}
#: other names of the presets (the part's full name)
ALIASES = {"H100 SXM": "H100", "H100 80GB": "H100", "H100 SXM 80GB": "H100", "A100 80GB": "A100",
           "A100 SXM": "A100", "H100 HBM2e": "H100 96GB"}


def _normalize(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def hardware_names() -> list[str]:
    """The preset names, in a stable order."""
    return list(PRESETS)


def get_hardware(name_or_file: str | Hardware) -> Hardware:
    """A preset by name (case and spaces ignored: "h100", "tpu-v5p") or a TOML/JSON file path."""
    if isinstance(name_or_file, Hardware):
        return name_or_file
    key = _normalize(str(name_or_file))
    for name, hw in PRESETS.items():
        if _normalize(name) == key:
            return hw
    for alias, name in ALIASES.items():
        if _normalize(alias) == key:
            return PRESETS[name]
    if os.path.exists(name_or_file) or str(name_or_file).endswith((".toml", ".json")):
        return load_hardware(name_or_file)
    raise ValueError(f"unknown hardware {name_or_file!r}: use one of {', '.join(PRESETS)} "
                     "or the path of a .toml/.json hardware file (see docs/planner.md)")


_NUMBER_FIELDS = ("flops", "hbm_bytes", "intra_bw", "inter_bw", "alpha", "inter_alpha",
                  "small_message_latency", "hbm_bw", "matmul_efficiency", "attention_efficiency",
                  "tdp_w", "power_limit_w", "inter_group_bw", "inter_group_alpha")
_INT_FIELDS = ("devices_per_node", "axes")


def hardware_from_dict(data: dict, source: str = "hardware") -> Hardware:
    """Build a :class:`Hardware` from a mapping with the schema of the module docstring."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a table/object of hardware fields")
    if "hardware" in data and isinstance(data["hardware"], dict):  # allow a [hardware] table
        data = data["hardware"]
    known = {f.name for f in fields(Hardware)} | {"small_message_latency"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; known keys: {sorted(known)}")
    missing = [k for k in ("name", "flops", "hbm_bytes", "intra_bw", "devices_per_node") if k not in data]
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}")
    kw = {}
    for key, value in data.items():
        if value is None:  # JSON null: use the default
            continue
        if key in _NUMBER_FIELDS:
            kw[key] = parse_quantity(value, key)
        elif key in _INT_FIELDS:
            kw[key] = check_count(key, parse_quantity(value, key))
        else:
            kw[key] = str(value)
    latency = kw.pop("small_message_latency", None)
    if latency is not None:
        if kw["devices_per_node"] < 2:
            raise ValueError(f"{source}: small_message_latency needs devices_per_node >= 2")
        alpha = _per_hop(latency, kw["devices_per_node"])
        if "alpha" in kw and abs(kw["alpha"] - alpha) > 1e-9 * max(alpha, 1e-30):
            raise ValueError(f"{source}: alpha ({kw['alpha']:g} s) and small_message_latency "
                             f"({latency:g} s = 2(g-1)·{alpha:g} s) disagree; give one of them")
        kw["alpha"] = alpha
    try:
        return Hardware(**kw)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_hardware(path: str) -> Hardware:
    """Read a hardware file (``.toml`` or ``.json``) with the schema of the module docstring."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"hardware file {path!r} not found; presets: {', '.join(PRESETS)}")
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".json"):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    else:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise ValueError(f"{path}: reading TOML needs Python 3.11+; use a .json file") from None
        try:
            data = tomllib.loads(raw.decode())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return hardware_from_dict(data, source=path)


def save_hardware(hw: Hardware, path: str) -> str:
    """Write ``hw`` as a ``.json`` or ``.toml`` hardware file that :func:`load_hardware` reads back."""
    path = os.fspath(path)
    data = {k: v for k, v in hw.to_dict().items() if v is not None}
    if path.endswith(".json"):
        text = json.dumps(data, indent=2) + "\n"
    elif path.endswith(".toml"):
        text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items())  # JSON scalars are TOML
    else:
        raise ValueError(f"hardware file {path!r} must end in .json or .toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path



# ---- what the hardware sustains: the compute model -----------------------------------------
@dataclass(frozen=True)
class ComputeConstants(ToDict):
    """The compute model's constants shared by all hardware (docs/planner.md, "The compute
    model"). ``hidden_knee`` and ``token_knee``: a GEMM of hidden size h over t tokens reaches
    h/(h + hidden_knee) · t/(t + token_knee) of the hardware's sustained matmul fraction (wave and
    tile quantization, and the small-K/N inefficiency of thin matrices); ``elementwise_passes``:
    bytes the memory-bound operations (norms, activations, residual adds, rotary, casts) move per
    byte of one layer's stored activations, forward (backward twice that);
    ``layer_overhead_s``: seconds per layer per micro-batch forward that do not scale with tokens
    (kernel launches, hooks; backward twice that); ``attention_backward``: FlashAttention's
    backward FLOPs over its forward's (5 matmuls against 2); ``optimizer_bytes``: HBM bytes AdamW
    moves per parameter it steps (reads fp32 value, gradient, two moments; writes value and
    moments: 28); ``attention_scale``: the share of the FlashAttention benchmark's rate
    (``attention_efficiency``) attention reaches inside a training step."""

    hidden_knee: float = 0.0
    token_knee: float = 1340.0
    elementwise_passes: float = 4.49
    layer_overhead_s: float = 8.6e-4
    attention_backward: float = 2.5
    optimizer_bytes: float = 28.0
    attention_scale: float = 0.56


#: the constants every prediction uses unless given others: token_knee, elementwise_passes,
#: layer_overhead_s and attention_scale least-squares fitted (log ratios) on the 22 published runs
#: of zerodp/plan/validation.json (``zerodp plan validate --fit``); hidden_knee fitted too and
#: found 0 for hidden sizes 1,536-8,192 (no measurable effect there); docs/planner.md
COMPUTE = ComputeConstants()


def clock_factor(hw: Hardware) -> float:
    """The compute clock under a power limit relative to TDP: (limit/TDP)^(1/3), dynamic power
    growing as f·V² with the voltage following the clock (1.0 without a limit)."""
    if hw.power_limit_w and hw.tdp_w and hw.power_limit_w < hw.tdp_w:
        return (hw.power_limit_w / hw.tdp_w) ** (1 / 3)
    return 1.0


def with_inter_group(hw: Hardware, bandwidth: float | None = None,
                     latency: float | None = None) -> Hardware:
    """``hw`` with an inter-group link (guide §16): ``bandwidth`` bytes/s per GPU one way,
    ``latency`` seconds per ring step; None keeps what ``hw`` says (by default the inter-node
    figures)."""
    if bandwidth is not None:
        check_positive("inter_group_bw", bandwidth)
    if latency is not None:
        check_positive("inter_group_alpha", latency, allow_zero=True)
    return replace(hw, inter_group_bw=hw.inter_group_bw if bandwidth is None else float(bandwidth),
                   inter_group_alpha=hw.inter_group_alpha if latency is None else float(latency))


def with_power_limit(hw: Hardware, watts: float | None) -> Hardware:
    """``hw`` run at ``watts`` (None: as it is; ValueError above its TDP)."""
    if watts is None:
        return hw
    check_positive("power_limit_w", watts)
    if not hw.tdp_w:
        raise ValueError(f"{hw.name} has no tdp_w: a power limit needs the board's TDP "
                         "(add tdp_w to the hardware file)")
    return replace(hw, power_limit_w=0.0 if watts >= hw.tdp_w else float(watts))


def sustained(hw: Hardware) -> dict:
    """The sustained figures the compute model uses for ``hw``, and where each comes from."""
    clock = clock_factor(hw)
    mm = hw.matmul_efficiency or GENERIC_MATMUL
    at = hw.attention_efficiency or GENERIC_ATTENTION
    bw = hw.hbm_bw or hw.flops / 300
    return {"matmul_flops": hw.flops * mm * clock, "attention_flops": hw.flops * at * clock,
            "hbm_bw": bw, "clock_factor": clock, "matmul_efficiency": mm,
            "attention_efficiency": at,
            "assumed": [k for k, v in (("matmul_efficiency", hw.matmul_efficiency),
                                       ("attention_efficiency", hw.attention_efficiency),
                                       ("hbm_bw", hw.hbm_bw)) if not v]}
