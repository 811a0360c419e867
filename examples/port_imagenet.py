"""pytorch/examples' ``imagenet/main.py``, in its shape, ported to zerodp by the import and the
wrap line alone.

    torchrun --standalone --nproc-per-node 2 examples/port_imagenet.py --wrap zerodp --stage 2

What makes it that script's: a convolutional network with BatchNorm; the wrap first, then the
criterion, ``SGD(model.parameters(), momentum, weight_decay)`` and a ``StepLR`` over it — built after
the wrap, so zerodp adopts the optimizer at its first ``step()``; ``optimizer.zero_grad()`` before
each backward; ``validate()`` on every rank in ``eval()`` mode under ``no_grad`` (BatchNorm's running
statistics: rank 0's, broadcast at each training forward, as DDP does); and ``save_checkpoint`` on
rank 0 only with ``model.state_dict()``, ``optimizer.state_dict()`` and the scheduler's — after each
epoch but the last: after their last step the other ranks have no collective to serve it from, and
a rank-0-only save there ends the job with a message that says to take the dicts on every rank
(docs/porting.md, "Calls on rank 0 only").
``tests/test_porting_scripts.py`` runs ``train`` on 2 gloo ranks with DDP and zerodp stages 0-3.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from porting_ddp import run_example

CLASSES, SIZE, BATCH = 4, 8, 4  # 8×8 RGB images in 4 classes, 4 per rank per iteration


class TinyResNet(nn.Module):
    """Two residual blocks of 3×3 convolutions with BatchNorm, as ResNet's, on 8×8 images."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
            for _ in range(2))
        self.fc = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.fc(x.mean((2, 3)))


def loader(seed: int, rank: int, world: int, iters: int, device):
    """What a ``DistributedSampler`` gives rank ``rank``: its rows of each global batch. The label
    is the brightest colour channel's quadrant (learnable), with 10% of labels random."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(iters):
        images = torch.randn(world * BATCH, 3, SIZE, SIZE, generator=g)
        target = (images.mean((2, 3)).argmax(1) + (images[:, :, :4, :4].mean((1, 2, 3)) > 0).long()) % CLASSES
        noise = torch.rand(world * BATCH, generator=g) < 0.1
        target = torch.where(noise, torch.randint(0, CLASSES, (world * BATCH,), generator=g), target)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        yield images[rows].to(device), target[rows].to(device)


def validate(val_loader, model, criterion) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for images, target in val_loader:
            total += criterion(model(images), target).item()
    model.train()
    return total


def train(rank: int, world: int, wrap: str = "ddp", stage: int = 0, epochs: int = 3, iters: int = 2,
          out_dir: str | None = None, device: torch.device = torch.device("cpu")) -> dict:
    """One rank's run: per-iteration training losses and per-epoch validation losses."""
    torch.manual_seed(0)
    model = TinyResNet().to(device)
    model = DDP(model) if wrap == "ddp" else zerodp.parallelize(model, stage=stage)  # the wrap line
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    out = {"loss": [], "val": []}
    for epoch in range(epochs):
        model.train()
        for images, target in loader(epoch, rank, world, iters, device):
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            out["loss"].append(loss.item())
        out["val"].append(validate(loader(1000 + epoch, rank, world, 1, device), model, criterion))
        scheduler.step()
        # save_checkpoint(..., is_best) on the first process; not after the last epoch, when the other
        # ranks have no step left to serve the state dicts from (docs/porting.md)
        if rank == 0 and out_dir is not None and epoch + 1 < epochs:
            state = {"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict()}
            torch.save(state, os.path.join(out_dir, f"checkpoint-{wrap}-{stage}.pth.tar"))
    return out


def main(argv: list[str] | None = None) -> dict:
    rank, out = run_example(__doc__, 3, lambda a, rank, world, device, folder: train(
        rank, world, a.wrap, a.stage, a.steps, out_dir=folder, device=device), argv, what="epochs")
    if rank == 0:
        print("losses", " ".join(f"{x:.4f}" for x in out["loss"]), "| val", " ".join(f"{x:.4f}" for x in out["val"]))
    return out


if __name__ == "__main__":
    main()
