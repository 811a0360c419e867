"""The training engine on torch.distributed: flat buffers, buckets and the four stage policies.

Entry point: :func:`parallelize`. Modules, one concept each:

- ``config``  EngineConfig / MixedPrecision          - ``layout``  flat-buffer layout as data
- ``comm``    recorded collectives (AR, RS, AG)       - ``trace``   per-rank event recorder
- ``master``  fp32 master + stock optimizer, pieces   - ``base``    shared step template, API
- ``buckets`` bucket plan and flat buffers (stage 0-2) - ``ddp``     stage 0 (guide §2-§5)
- ``reducer`` hooks → one collective per bucket       - ``zero1``   stage 1 (guide §9.1)
- ``zero2``   stage 2 (guide §9.2)                      - ``fsdp``    stage 3 (guide §9.3, §10)
- ``stats``   measured memory and comm per step vs the guide's formulas
"""

from zerodp.engine.api import engine_class, parallelize
from zerodp.engine.config import EngineConfig, MixedPrecision

__all__ = ["parallelize", "engine_class", "EngineConfig", "MixedPrecision"]
