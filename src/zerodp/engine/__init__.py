"""The training engine on torch.distributed: one flat group per bucket or unit, four stage policies.

Entry point: :func:`parallelize`. Modules, one concept each:

- ``group``       FlatGroup: one bucket or unit (layout, buffers, reduce, gather/free/publish,
                  backward state); Policy: what each stage keeps, which collective (guide §12.1-§12.2)
- ``base``        StageEngine: public API, step template, in-flight bound, all shared over groups
- ``reducer``     stages 0-2: gradient hooks fill buckets, each full bucket launches its collective
- ``fsdp``        stage 3: gather before use, prefetch, free, reduce after a unit's backward (§9.3, §10)
- ``buckets``     bucket plan, the three sync modes (guide §2.5, §3, §4)
- ``unit``        unit plan: which parameters each FSDP unit owns (guide §10.3)
- ``layout``      flat-buffer layout as data: offsets, padding, who owns which slice
- ``comm``        recorded collectives (AR, RS, AG) and the queue of collectives in flight
- ``master``      fp32 master + stock optimizer; checkpoint pieces (guide §12.3)
- ``ddp`` / ``zero1`` / ``zero2``  the stage classes of stages 0-2 and what each stage does
- ``deferred``    meta-device models, materialized per rank (guide §12.6)
- ``quant``       blockwise int8, ZeRO++ qwZ and qgZ (guide §15)
- ``state_dict``  state dicts and optimizer state dicts keyed by the model's names
- ``hf`` / ``dcp``  Hugging Face safetensors and PyTorch DCP in and out (guide §12.7)
- ``devices``     device and backend checks before the first collective
- ``guard``       skip steps with inf/NaN gradients on every rank alike
- ``config``      EngineConfig / MixedPrecision;  ``api``  parallelize, engine_class
- ``trace`` / ``stats``  per-rank event recorder; measured memory and comm vs the guide's formulas
"""

from zerodp.engine.api import engine_class, parallelize
from zerodp.engine.config import EngineConfig, MixedPrecision

__all__ = ["parallelize", "engine_class", "EngineConfig", "MixedPrecision"]
