"""The local launcher that every multi-rank test stands on: results come back, failures end every rank."""

import time

import pytest

from zerodp.spawn import RankFailure, run_local


def _sum_ranks(rank, world, scale):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item() * scale


def _rank1_raises_then_others_block(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # would wait forever for rank 1


pytestmark = pytest.mark.dist


def test_results_come_back_by_rank():
    assert run_local(_sum_ranks, 3, 2.0) == [12.0, 12.0, 12.0]


def test_one_failing_rank_ends_all_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_local(_rank1_raises_then_others_block, 2, timeout=60, grace=3)
    assert time.monotonic() - t0 < 45


def _return_tensor(rank, world):
    import torch

    return torch.full((3,), float(rank))


def test_tensors_come_back_by_value():
    a, b = run_local(_return_tensor, 2)
    assert a.tolist() == [0.0, 0.0, 0.0] and b.tolist() == [1.0, 1.0, 1.0]


def _killed(rank, world):
    import os
    import signal

    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does
    dist.barrier()


def test_a_rank_killed_by_sigkill_is_reported_as_such_not_as_a_connection_error():
    import pytest

    from zerodp.spawn import RankFailure, run_local

    with pytest.raises(RankFailure) as info:
        run_local(_killed, 2, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 was killed by SIGKILL") and "out-of-memory killer" in msg
    assert "Connection reset" not in msg and "\n" not in msg
