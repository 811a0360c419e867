"""Names and units every part of zerodp shares, defined once (torch-free).

``MIB``: a mebibyte (DDP's ``bucket_cap_mb`` and the engine's ``bucket_mb`` count these);
``AUTO``: the value that asks for a chosen bucket size (``bucket_mb="auto"``, guide §4);
``STAGE_NAMES``: what stage 0-3 are called (guide §9); :func:`fmt_mib`: bytes in binary units,
as memory is measured. (The planner's tables use decimal units: ``zerodp.plan._common.fmt_bytes``.)
"""

from __future__ import annotations

MIB = 1 << 20
AUTO = "auto"
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def fmt_mib(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``3.40 MiB``, ``1.25 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
