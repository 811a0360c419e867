"""A DDP script's ending, ported by the wrap line (run by tests/test_engine_script_end.py under
torchrun): train, then ``if rank == 0: torch.save({"model": model.state_dict(), "optimizer":
optimizer.state_dict()}, path)`` after the last step — the other ranks go straight to their end
(``dist.destroy_process_group()`` when asked, or none) and serve the call from there. With
``uneven``, rank 0 has one batch more than the others (a sampler without ``drop_last``) and takes
one more step, which no other rank joins.

    python -m torch.distributed.run --nproc-per-node 2 tests/_script_end.py STAGE PATH [destroy] [uneven]
"""

import sys

import torch
import torch.distributed as dist

import zerodp

STEPS, ROWS, LR, MOMENTUM = 3, 4, 0.1, 0.9


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows of step ``step``: rank r takes rows [r·ROWS, (r+1)·ROWS)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * ROWS, 8, generator=g), torch.randn(world * ROWS, 4, generator=g)


def main(stage: int, path: str, destroy: bool, uneven: bool = False) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = model()
    net = zerodp.parallelize(m, stage=stage, units=[m[0], m[2]] if stage == 3 else None)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS + (uneven and rank == 0)):
        x, y = batch(step, world)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)
    if destroy:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], "destroy" in sys.argv[3:], "uneven" in sys.argv[3:])
