"""The training engine on torch.distributed: one flat group per bucket or unit, four stage policies.

Entry point: :func:`parallelize`. Every module, one concept each (docs/layout.md says more):

- ``api``          parallelize, engine_class;  ``config``  EngineConfig, MixedPrecision, Dtypes, Policy
- ``base``         StageEngine: the public face (an nn.Module), the process groups, its parts
- ``ddp`` / ``zero1`` / ``zero2`` / ``reducer``  stages 0-2: buckets filled by the gradient hooks
- ``fsdp``         stage 3: gather before use, prefetch, free, reduce after a unit's backward (§9.3, §10)
- ``construct``    building the flat groups once;  ``step``  the step machine;  ``states``  the enums
- ``group`` / ``gradbuf``  FlatGroup (one bucket or unit) and its gradient buffers (guide §12.1-§12.2)
- ``buckets`` / ``unit`` / ``layout``  the bucket plan, the unit plan, the flat layout as data
- ``comm``         the recorded collectives and the queue in flight;  ``control``  calls a script makes
- ``optimizer_plan``  what the optimizer is (a factory, or the script's built ones) and where it runs,
                   decided once (guide §12.3)
- ``master`` / ``exchange`` / ``optim`` / ``adopt``  fp32 master and optimizer, owner exchange,
                   torch's optimizer API, the script's optimizer taken over (guide §12.3, §12.9)
- ``grads``        ShardedGrad for torch's clipping;  ``guard``  skip non-finite steps
- ``state_dict`` / ``hf`` / ``dcp`` / ``durable``  state dicts by name and the checkpoint part,
                   safetensors, DCP, durable writes
- ``deferred`` / ``devices`` / ``module_view`` / ``nest`` / ``compiled``  meta models, device checks,
                   stage 3's module view, nested inputs, host bookkeeping kept out of compiled graphs
- ``foreign``      DDP's and FSDP2's own calls on the model, served or refused in one line
- ``quant``        blockwise int8, ZeRO++ qwZ and qgZ (guide §15);  ``schedule``  stage 3's unit schedule
- ``outer``        DiLoCo's outer loop over the replica groups of hybrid sharding (guide §16)
- ``trace`` / ``stats``  the per-rank event recorder; measured memory and comm vs the guide's formulas
"""

from zerodp.engine.api import engine_class, parallelize
from zerodp.engine.config import DiLoCo, EngineConfig, MixedPrecision

__all__ = ["parallelize", "engine_class", "EngineConfig", "MixedPrecision", "DiLoCo"]
