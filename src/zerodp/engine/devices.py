"""Device checks that ``check_device`` in :mod:`zerodp.engine.base` does not make yet (guide §12, §13).

``check_device`` refuses a non-CUDA model on an NCCL-only group and a model on another CUDA device
than the current one. Two more mistakes are cheap to catch before the first collective:

- a **CUDA model on a group without NCCL** (gloo only): gloo copies every CUDA bucket through host
  memory, so data parallelism runs at PCIe-and-socket speed instead of NVLink's, silently;
- **every rank of a node on cuda:0**: ``LOCAL_RANK`` > 0 with the model on ``cuda:0`` on a node that
  has a GPU per local rank — ``model.cuda()`` without ``torch.cuda.set_device(local_rank)``. Ranks
  sharing one GPU make NCCL fail ("duplicate GPU") or hang.

The checks are pure functions of plain values (testable without a GPU) that return the problem in
one line, or None; :func:`check_devices` gathers the values and raises ``ValueError``.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
import torch.distributed as dist


def backend_device_problem(device_type: str, backend: str) -> str | None:
    """What is wrong with a model on ``device_type`` ("cpu", "cuda") under process-group ``backend``
    (as ``dist.get_backend`` names it, e.g. "gloo", "nccl", "cpu:gloo,cuda:nccl"), or None."""
    backend = str(backend).lower()
    if device_type == "cuda" and "nccl" not in backend:
        return (f"the model is on CUDA but the process group's backend is {backend!r}: data parallelism on "
                "CUDA needs NCCL (gloo copies every bucket through host memory); use "
                "init_process_group('nccl') or 'cpu:gloo,cuda:nccl'")
    if device_type != "cuda" and "nccl" in backend and "gloo" not in backend:
        return (f"the process group uses NCCL but the model is on {device_type}: move it to "
                "torch.device('cuda', local_rank), or use the gloo backend for CPU training")
    return None


def shared_gpu_problem(device_index: int | None, local_rank: int | None, local_world_size: int | None,
                       device_count: int) -> str | None:
    """The model of local rank ``local_rank`` > 0 on ``cuda:0`` while the node has a GPU for each of
    its ``local_world_size`` ranks: every rank is on cuda:0 (no ``set_device``). None if fine or
    unknown (no ``LOCAL_RANK``; one GPU visible per rank, as with per-rank ``CUDA_VISIBLE_DEVICES``)."""
    if local_rank is None or local_world_size is None or device_index is None:
        return None
    if local_rank > 0 and device_index == 0 and local_world_size > 1 and device_count >= local_world_size:
        return (f"local rank {local_rank} of {local_world_size} has its model on cuda:0 and this node has "
                f"{device_count} GPUs: ranks sharing a GPU make NCCL fail or hang; call "
                "torch.cuda.set_device(local_rank) and build the model on torch.device('cuda', local_rank)")
    return None


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def check_devices(device: torch.device, group: dist.ProcessGroup | None = None, backend: str | None = None,
                  env: Mapping[str, str] | None = None, device_count: int | None = None) -> None:
    """Raise ``ValueError`` (one line) for the mistakes of the module docstring. ``backend``
    defaults to ``group``'s, ``env`` to ``os.environ``, ``device_count`` to CUDA's."""
    if backend is None:
        backend = str(dist.get_backend(group))
    problem = backend_device_problem(device.type, backend)
    if problem is None and device.type == "cuda":
        env = os.environ if env is None else env
        if device_count is None:
            device_count = torch.cuda.device_count()
        problem = shared_gpu_problem(device.index, _env_int(env, "LOCAL_RANK"), _env_int(env, "LOCAL_WORLD_SIZE"),
                                     device_count)
    if problem is not None:
        raise ValueError(problem)
