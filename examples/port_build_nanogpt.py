"""build-nanogpt's ``train_gpt2.py``, in its shape, ported to zerodp by the import and the wrap line
alone.

    torchrun --standalone --nproc-per-node 2 examples/port_build_nanogpt.py --wrap zerodp --stage 2

What makes it that script's: the forward under ``torch.autocast(dtype=torch.bfloat16)`` with fp32
parameters; ``raw_model = model.module`` and the optimizer built after the wrap from it (adopted by
zerodp at its first ``step()``); gradient accumulation with ``require_backward_grad_sync``; the
accumulated loss all-reduced across ranks for the log line (the script's own collective); the
learning rate set in ``optimizer.param_groups`` after clipping; and a checkpoint of
``raw_model.state_dict()`` written by the master process alone every ``CKPT_EVERY`` steps.
``tests/test_porting_scripts.py`` compares every logged loss with DDP's at stages 0-3 (within the
bound derived there for bf16 autocast).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from porting_ddp import GRAD_ACC, TinyGPT, configure_optimizers, get_batch, get_lr, run_example

CKPT_EVERY = 2


def train(rank: int, world: int, wrap: str = "ddp", stage: int = 0, steps: int = 6,
          out_dir: str | None = None, device: torch.device = torch.device("cpu")) -> dict:
    """One rank's run: the all-reduced loss and the gradient norm of each step (the log line)."""
    torch.manual_seed(1337)
    model = TinyGPT().to(device)
    model = DDP(model) if wrap == "ddp" else zerodp.parallelize(model, stage=stage)  # the wrap line
    raw_model = model.module
    optimizer = configure_optimizers(raw_model)
    master_process = rank == 0
    out = {"loss": [], "norm": []}
    for step in range(steps):
        if step % CKPT_EVERY == 0 and master_process and out_dir is not None:
            torch.save({"model": raw_model.state_dict(), "step": step}, os.path.join(out_dir, f"model_{step:05d}.pt"))
        model.train()
        optimizer.zero_grad()
        loss_accum = torch.zeros((), device=device)
        for micro_step in range(GRAD_ACC):
            x, y = get_batch(1000 * step + micro_step, rank, world, device)
            model.require_backward_grad_sync = micro_step == GRAD_ACC - 1
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            loss = loss / GRAD_ACC
            loss_accum += loss.detach()
            loss.backward()
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # build-nanogpt: ReduceOp.AVG (NCCL); gloo has SUM
        loss_accum /= world
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(step, steps)
        optimizer.step()
        out["loss"].append(loss_accum.item())
        out["norm"].append(norm.item())
    return out


def main(argv: list[str] | None = None) -> dict:
    rank, out = run_example(__doc__, 6, lambda a, rank, world, device, folder: train(
        rank, world, a.wrap, a.stage, a.steps, folder, device), argv)
    for step, (loss, norm) in enumerate(zip(out["loss"], out["norm"])):
        if rank == 0:
            print(f"step {step:4d} | loss: {loss:.6f} | norm: {norm:.4f}")
    return out


if __name__ == "__main__":
    main()
