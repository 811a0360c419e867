"""Engine configuration: one dataclass, validated once, shared by every stage.

The stage switch follows seed §9: 0 = plain data parallelism (DDP), 1 = ZeRO-1 (optimizer
states sharded), 2 = ZeRO-2 (+ gradients), 3 = ZeRO-3 / FSDP (+ parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

STAGES = (0, 1, 2, 3)
SYNC_MODES = ("naive", "overlap", "bucketed")  # seed §2.5, §3, §4
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb (seed §4)
DEFAULT_FIRST_BUCKET_MB = 1.0  # small first bucket: the last layers' gradients start moving early

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(value: str | torch.dtype | None, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"{what}={value!r} is not a dtype I know; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class MixedPrecision:
    """Seed §1: compute in ``param_dtype`` (bf16), keep fp32 master weights and optimizer states.

    ``reduce_dtype``: dtype of gradient communication (default: ``param_dtype``).
    ``fp32_grad_accum``: accumulate gradients across micro-batches in fp32 (+4 bytes/param, seed §9).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    fp32_grad_accum: bool = False

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @classmethod
    def parse(cls, value: "str | MixedPrecision | None") -> "MixedPrecision | None":
        if value is None or isinstance(value, MixedPrecision):
            return value
        dtype = parse_dtype(value, "mixed_precision")
        return None if dtype == torch.float32 else cls(param_dtype=dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Everything :func:`zerodp.parallelize` accepts besides the model and the optimizer."""

    stage: int = 0
    mixed_precision: MixedPrecision | None = None
    bucket_mb: float = DEFAULT_BUCKET_MB
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB
    sync: str = "bucketed"
    # Gradient accumulation under stages 2-3: True reduces every micro-batch (memory first, as
    # DeepSpeed does); False keeps full local gradients and reduces once (communication first).
    reduce_every_microbatch: bool = True
    find_unused_parameters: bool = False
    average_by_tokens: bool = False  # seed §2.2: weight each rank by its token count
    prefetch: bool = True  # stage 3: AllGather unit i±1 while unit i computes (seed §9.3)
    param_groups: Callable[[str, torch.nn.Parameter], dict[str, Any]] | None = None
    # Skip steps whose gradients hold inf/NaN on any rank; raise after this many in a row
    # (None: no check, the step is applied as torch's optimizers would). See engine.guard.
    max_nonfinite_skips: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use 0 (DDP), 1, 2 or 3 (FSDP)")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync={self.sync!r} is unknown; use one of {', '.join(SYNC_MODES)}")
        if not (self.bucket_mb > 0 and self.first_bucket_mb > 0):
            raise ValueError(
                f"bucket sizes must be positive MB, got bucket_mb={self.bucket_mb}, "
                f"first_bucket_mb={self.first_bucket_mb}"
            )
