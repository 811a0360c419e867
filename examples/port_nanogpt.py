"""nanoGPT's ``train.py``, in its shape, ported to zerodp by the import and the wrap line alone.

    torchrun --standalone --nproc-per-node 2 examples/port_nanogpt.py --wrap ddp
    torchrun --standalone --nproc-per-node 2 examples/port_nanogpt.py --wrap zerodp --stage 3

What makes it nanoGPT's: the optimizer is built before the wrap (``model.configure_optimizers``)
and never handed to the wrap; the learning rate is set by hand each iteration; gradient
accumulation with ``model.require_backward_grad_sync``; ``clip_grad_norm_(model.parameters())``;
and on the master process only, every ``EVAL_INTERVAL`` iterations, ``estimate_loss()`` under
``no_grad`` and a checkpoint of ``raw_model.state_dict()`` and ``optimizer.state_dict()``. Under
zerodp the optimizer is adopted at its first ``step()``; the rank-0 evaluation and checkpoint are
local at stage 0 (as DDP's) and served by the other ranks from their next step's collectives at
stages 1-3 (docs/porting.md, "Calls on rank 0 only"). ``tests/test_porting_scripts.py`` runs
``train`` on 2 gloo ranks with DDP and zerodp stages 0-3 and compares every loss.
"""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from porting_ddp import GRAD_ACC, TinyGPT, configure_optimizers, get_batch, get_lr, run_example

EVAL_INTERVAL, EVAL_ITERS = 2, 2


@torch.no_grad()
def estimate_loss(model, world: int, device) -> float:
    model.eval()
    losses = [model(*get_batch(10_000 + k, 0, world, device)).item() for k in range(EVAL_ITERS)]
    model.train()
    return sum(losses) / len(losses)


def train(rank: int, world: int, wrap: str = "ddp", stage: int = 0, steps: int = 6,
          out_dir: str | None = None, device: torch.device = torch.device("cpu")) -> dict:
    """One rank's run; returns its per-iteration losses and the master's evaluation losses."""
    torch.manual_seed(1337)
    model = TinyGPT().to(device)
    optimizer = configure_optimizers(model)  # nanoGPT: model.configure_optimizers(...), before the wrap
    model = DDP(model) if wrap == "ddp" else zerodp.parallelize(model, stage=stage)  # the wrap line
    raw_model = model.module
    master_process = rank == 0
    out = {"loss": [], "eval": {}}
    seed = 0
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, steps)
        if it % EVAL_INTERVAL == 0 and master_process:
            out["eval"][it] = estimate_loss(model, world, device)
            if out_dir is not None:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it}
                torch.save(checkpoint, os.path.join(out_dir, f"ckpt-{wrap}-{stage}-{rank}.pt"))
        for micro_step in range(GRAD_ACC):
            model.require_backward_grad_sync = micro_step == GRAD_ACC - 1
            loss = model(*get_batch(seed, rank, world, device)) / GRAD_ACC
            seed += 1
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["loss"].append(loss.item() * GRAD_ACC)
    return out


def main(argv: list[str] | None = None) -> dict:
    rank, out = run_example(__doc__, 6, lambda a, rank, world, device, folder: train(
        rank, world, a.wrap, a.stage, a.steps, folder, device), argv, what="iterations")
    for it, loss in enumerate(out["loss"]):
        ev = f"  eval {out['eval'][it]:.4f}" if it in out["eval"] else ""
        if rank == 0:
            print(f"iter {it}  loss {loss:.4f}{ev}")
    return out


if __name__ == "__main__":
    main()
