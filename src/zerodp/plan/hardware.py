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
``axes``            mesh axes that can each carry DP traffic at ``intra_bw`` at once (TPU torus: 3)
==================  =========================================================================

Hardware files (``load_hardware``) are TOML or JSON objects with exactly these keys (``name``,
``flops``, ``hbm_bytes``, ``intra_bw``, ``devices_per_node`` required; ``inter_bw`` defaults to 0,
``axes`` to 1). Instead of ``alpha`` a file may give ``small_message_latency`` (α′, seconds, measured
on ``devices_per_node`` ranks); ``alpha`` is then α′/(2(g−1)). ``zerodp calibrate`` writes this
schema. Numbers may be written as strings with suffixes ("450e9", "80GB").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

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

PRESETS: dict[str, Hardware] = {h.name: h for h in [
    Hardware("H100", flops=9.9e14, hbm_bytes=80e9, intra_bw=450e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU,
             note="SXM; NVLink 450 GB/s per GPU one way; 8x400 Gbps NICs per node (guide §2.4)"),
    Hardware("H800", flops=9.9e14, hbm_bytes=80e9, intra_bw=200e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU,
             note="NVLink cut to 200 GB/s per GPU one way (guide §7.2); latency assumed as H100"),
    Hardware("H200", flops=9.9e14, hbm_bytes=141e9, intra_bw=450e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU,
             note="H100 compute and NVLink with 141 GB HBM3e; latency assumed as H100"),
    Hardware("A100", flops=3.12e14, hbm_bytes=80e9, intra_bw=300e9, devices_per_node=8,
             inter_bw=200e9, alpha=_ALPHA_8GPU,
             note="SXM 80GB; NVLink3 300 GB/s per GPU one way; 8x200 Gbps HDR per node; "
                  "latency assumed as H100"),
    Hardware("B200", flops=2.25e15, hbm_bytes=180e9, intra_bw=900e9, devices_per_node=8,
             inter_bw=400e9, alpha=_ALPHA_8GPU,
             note="HGX B200 (180 GB per GPU); NVLink5 900 GB/s per GPU one way; "
                  "8x400 Gbps per node; latency assumed as H100"),
    Hardware("TPU v5p", flops=4.59e14, hbm_bytes=96e9,
             intra_bw=TPU_V5P_LINKS_PER_AXIS * TPU_V5P_ICI_LINK_BW,
             devices_per_node=TPU_V5P_POD_CHIPS, inter_bw=0.0, alpha=1e-6, axes=3,
             note="3D torus; one pod (8960 chips) is one ICI domain; 2 ICI links of 9e10 B/s "
                  "per axis one way (guide §7.2); alpha 1 µs per hop is an assumption"),
]}


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
    if os.path.exists(name_or_file) or str(name_or_file).endswith((".toml", ".json")):
        return load_hardware(name_or_file)
    raise ValueError(f"unknown hardware {name_or_file!r}: use one of {', '.join(PRESETS)} "
                     "or the path of a .toml/.json hardware file (see docs/planner.md)")


_NUMBER_FIELDS = ("flops", "hbm_bytes", "intra_bw", "inter_bw", "alpha", "inter_alpha",
                  "small_message_latency")
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

