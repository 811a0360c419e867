"""A wrap line changed and nothing else (docs/porting.md): torch DDP's keyword arguments and torch's
mixed-precision policy objects, kept in ``zerodp.parallelize``'s call, mean what they meant, or are
refused in one line that says what to change.

The spawned group trains DDP with every keyword a script may write, and the engine with the same
keywords at stages 0 and 3, on the same rows: each step within ``trajectory_tolerance`` of DDP
(the runs differ only in the order of a step's gradient sum).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecision as FSDP1Policy
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from _engine_common import Net, regression_batch, shard, spawn_once, trajectory_tolerance
from zerodp.engine.config import MixedPrecision

WORLD, ROWS, STEPS = 2, 3, 3
#: what a DDP script writes: each of DDP's keywords, with the values that mean what the engine does
DDP_KEYWORDS = dict(device_ids=None, output_device=None, dim=0, broadcast_buffers=True, init_sync=True,
                    bucket_cap_mb=0.0001, find_unused_parameters=False, check_reduction=False,
                    gradient_as_bucket_view=True, static_graph=True)


def _train(wrapped, optimizer, rank: int, values) -> list[dict]:
    """``STEPS`` steps; ``values()`` after each: the parameters by name."""
    out = []
    for k in range(STEPS):
        x, y = regression_batch(300 + k, WORLD * ROWS)
        wrapped(shard(x, rank, ROWS), shard(y, rank, ROWS)).backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(values())
    return out


def _refusals(engine) -> list[str]:
    """DDP's methods with no counterpart: each call's one line."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = []
    for call in (lambda: engine.join(), lambda: engine.register_comm_hook(None, default_hooks.bf16_compress_hook)):
        try:
            call()
        except NotImplementedError as e:
            out.append(str(e))
    return out


def _mesh(stage: int) -> tuple:
    """DDP's ``device_mesh=``: a 1-D mesh is its group; a 2-D one is refused in one line."""
    from torch.distributed.device_mesh import init_device_mesh

    engine = zerodp.parallelize(Net(0), stage=stage, device_mesh=init_device_mesh("cpu", (WORLD,)))
    try:
        zerodp.parallelize(Net(0), stage=stage, device_mesh=init_device_mesh("cpu", (1, WORLD)))
    except ValueError as e:
        return engine.world_size, str(e)
    return engine.world_size, None


def _keywords(rank: int, world: int) -> dict:
    torch.manual_seed(rank)  # different models per rank: every wrap starts from rank 0's, as DDP does
    reference = DDP(Net(rank), process_group=dist.group.WORLD, **DDP_KEYWORDS)
    ref = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), rank,
                 lambda: {n: p.detach().clone() for n, p in reference.module.named_parameters()})
    out = {}
    for stage in (0, 3):
        engine = zerodp.parallelize(Net(rank), stage=stage, process_group=dist.group.WORLD, **DDP_KEYWORDS)
        mine = _train(engine, torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9), rank,
                      engine.full_state_dict)  # stage 3's parameters at rest are placeholders
        out["bucket_mb", stage] = engine.config.bucket_mb  # bucket_cap_mb's value, under the engine's name
        out["refusals", stage] = _refusals(engine)
        out["mesh", stage] = _mesh(stage)
        out[stage] = [max(((m[n] - r[n]).abs().max() / r[n].abs().max()).item() for n in r)
                      for m, r in zip(mine, ref)]
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage", (0, 3))
def test_ddp_keywords_in_the_wrap_line_mean_what_they_meant(stage):
    for rank, result in enumerate(spawn_once(_keywords, WORLD)):
        assert result["bucket_mb", stage] == DDP_KEYWORDS["bucket_cap_mb"]
        assert result["mesh", stage] == (WORLD, "device_mesh with 2 dimensions: DDP takes a 1-D mesh; for "
                                                "replicas of shard groups pass shard_size=g (docs/porting.md, HSDP)")
        join, hook = result["refusals", stage]
        assert join.startswith("join() (DDP's uneven inputs) is not supported") and "drop_last=True" in join
        assert hook == ("register_comm_hook(bf16_compress_hook): communication hooks are not supported; pass "
                        "reduce_dtype='bf16' to zerodp.parallelize instead")
        for k, error in enumerate(result[stage]):
            assert error <= trajectory_tolerance(WORLD * ROWS, k + 1), (rank, k, error)


@pytest.mark.parametrize("keywords,words", [
    (dict(device_ids=[0]), "device_ids=[0] with the model on the CPU: DDP takes device_ids only for a model on one "
                           "accelerator; drop device_ids"),
    (dict(output_device="cuda:0"), "output_device='cuda:0': the engine returns the module's outputs where the "
                                   "module puts them (cpu); drop output_device"),
    (dict(dim=1), "dim= (a torch DDP option) other than 0: each rank's batch is its own input"),
    (dict(init_sync=False), "init_sync= (a torch DDP option) other than True: every rank starts from rank 0's"),
    (dict(skip_all_reduce_unused_params=True), "unused parameters follow find_unused_parameters; drop it"),
    (dict(delay_all_reduce_named_params=[("w", None)]), "DDP's option has no counterpart in this engine; drop it"),
    (dict(bucket_cap_mb=25, bucket_mb=10), "parallelize got both bucket_mb= and DDP's bucket_cap_mb=: pass one"),
    (dict(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)),
     "mixed_precision=MixedPrecisionPolicy(..., output_dtype=torch.float32): no counterpart here"),
    (dict(mixed_precision=FSDP1Policy(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)),
     "mixed_precision=MixedPrecision(..., buffer_dtype=torch.bfloat16): no counterpart here"),
    (dict(mixed_precision=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)),
     "without a param_dtype: compute in fp32 and reduce in torch.bfloat16 with parallelize(..., reduce_dtype="),
])
def test_what_has_no_counterpart_is_refused_in_one_line(keywords, words):
    with pytest.raises((ValueError, TypeError)) as caught:
        zerodp.parallelize(Net(0), **keywords)  # refused before any process group is needed
    message = str(caught.value)
    assert "\n" not in message and words in message, message


@pytest.mark.parametrize("policy,expected", [
    (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
     MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    (MixedPrecisionPolicy(param_dtype=torch.bfloat16), MixedPrecision(param_dtype=torch.bfloat16)),
    (MixedPrecisionPolicy(), None),
    (FSDP1Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.float32),
     MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    (torch.bfloat16, MixedPrecision(param_dtype=torch.bfloat16)),
    (torch.float32, None),
])
def test_torch_policies_read_as_the_engines(policy, expected):
    assert MixedPrecision.parse(policy) == expected, re.sub(r"\s+", " ", repr(policy))
