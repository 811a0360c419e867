"""timm's ``train.py``, in its shape, ported to zerodp by the import and the wrap line alone.

    torchrun --standalone --nproc-per-node 2 examples/port_timm.py --wrap zerodp --stage 1

What makes it that script's: the model and its optimizer are built, then ``--resume`` loads the
model's and the optimizer's state *before* the wrap (timm's ``resume_checkpoint``); the wrapped
model is then stored as a child module of a task object (``task.trainable_module = model``), which
computes the loss; an EMA of the weights (timm's ``ModelEmaV2``: a copy made before the wrap,
lerped towards the unwrapped model's ``state_dict()`` after each step, on every rank); and the
``CheckpointSaver`` on rank 0 only: ``unwrap_model(model).state_dict()``, ``optimizer.state_dict()``
and the EMA's. zerodp's engine is an ``nn.Module`` as DDP's wrapper is, so it can be a child module;
the optimizer that loaded state before the wrap is adopted with that state at its first ``step()``.
``tests/test_porting_scripts.py`` runs ``train`` with DDP and zerodp stages 0-3, once whole and once
resumed from the halfway checkpoint, and compares every loss.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from port_imagenet import TinyResNet, loader
from porting_ddp import run_example


class Task(nn.Module):
    """timm's ``TrainingTask``: the model and the loss, one module."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module):
        super().__init__()
        self.trainable_module = model
        self.loss_fn = loss_fn

    def forward(self, images, target):
        return self.loss_fn(self.trainable_module(images), target)


class ModelEmaV2(nn.Module):
    def __init__(self, model: nn.Module, decay: float = 0.9):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v.to(ema_v.dtype), 1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


def unwrap_model(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def train(rank: int, world: int, wrap: str = "ddp", stage: int = 0, epochs: int = 4, iters: int = 2,
          ckpt: str | None = None, save_epoch: int | None = None, resume: bool = False,
          device: torch.device = torch.device("cpu")) -> dict:
    """One rank's run, from the start or resumed from ``ckpt``: training losses and EMA checks."""
    torch.manual_seed(0)
    model = TinyResNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    model_ema = ModelEmaV2(model)
    start = 0
    if resume:  # timm's resume_checkpoint: before the wrap
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["state_dict"])
        optimizer.load_state_dict(state["optimizer"])
        model_ema.module.load_state_dict(state["state_dict_ema"])
        start = state["epoch"]
    model = DDP(model) if wrap == "ddp" else zerodp.parallelize(model, stage=stage)  # the wrap line
    task = Task(model, nn.CrossEntropyLoss())
    out = {"loss": [], "ema": []}
    for epoch in range(start, epochs):
        task.train()
        for images, target in loader(epoch, rank, world, iters, device):
            loss = task(images, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            model_ema.update(unwrap_model(model))
            out["loss"].append(loss.item())
        out["ema"].append(sum(v.double().sum().item() for v in model_ema.module.state_dict().values()))
        if rank == 0 and ckpt is not None and epoch + 1 == save_epoch:  # CheckpointSaver, rank 0
            torch.save({"epoch": epoch + 1, "state_dict": unwrap_model(model).state_dict(),
                        "optimizer": optimizer.state_dict(), "state_dict_ema": model_ema.module.state_dict()}, ckpt)
    torch.distributed.barrier()  # the checkpoint is on disk before any rank resumes from it
    return out


def main(argv: list[str] | None = None) -> dict:
    def run(a, rank, world, device, folder):
        path = os.path.join(folder, "last.pth.tar")
        whole = train(rank, world, a.wrap, a.stage, a.steps, ckpt=path, save_epoch=a.steps // 2, device=device)
        return whole, train(rank, world, a.wrap, a.stage, a.steps, ckpt=path, resume=True, device=device)

    rank, (out, resumed) = run_example(__doc__, 4, run, argv, what="epochs")
    if rank == 0:
        print("losses ", " ".join(f"{x:.4f}" for x in out["loss"]))
        print("resumed", " " * 7 * (len(out["loss"]) - len(resumed["loss"])),
              " ".join(f"{x:.4f}" for x in resumed["loss"]))
    return out


if __name__ == "__main__":
    main()
