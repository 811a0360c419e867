"""A DDP training script, and the same script on zerodp: only the wrap changes (docs/porting.md).

    torchrun --standalone --nproc-per-node 2 examples/porting_ddp.py --wrap ddp
    torchrun --standalone --nproc-per-node 2 examples/porting_ddp.py --wrap zerodp --stage 3

A small GPT trained on synthetic token sequences made in this file (nothing is downloaded), written
the way DDP scripts are: AdamW with decay / no-decay param groups built before the wrap
(``configure_optimizers``), a cosine learning rate set by hand in ``optimizer.param_groups``,
gradient accumulation with ``require_backward_grad_sync``, ``torch.nn.utils.clip_grad_norm_(
model.parameters(), 1.0)``, a ``GradScaler`` that is disabled in fp32 (``scaler.step(optimizer)``),
evaluation under ``no_grad`` on rank 0, and a checkpoint of ``model.state_dict()`` and
``optimizer.state_dict()`` that ``--resume`` continues from — built, as pytorch/examples' scripts do,
after the wrap: ``raw_model = model.module``, the optimizer over ``raw_model.parameters()``,
``model.zero_grad()``, ``raw_model.state_dict()`` in the checkpoint. ``--wrap ddp`` and ``--wrap
zerodp`` run the same code but for the wrap line::

    model = DDP(model)                                 # DDP
    model = zerodp.parallelize(model, stage=stage)     # zerodp: 0 (DDP), 1, 2 (ZeRO-1/2), 3 (FSDP)

(the optimizer built next is adopted by the engine at its first step: rebuilt over the fp32 master)
and nothing else: the evaluation and the checkpoint run on rank 0 alone, as in the DDP script (at
stages 1-3 the other ranks serve them from their next step's collectives). ``train(rank, world, wrap, stage,
steps)`` is one rank of a run and returns its per-step losses: ``tests/test_porting.py`` calls it on
2 gloo ranks with each wrap and compares the losses. Gloo on CPU, NCCL when CUDA is available;
without torchrun it runs as a single process (world size 1).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp

# ---- the model: a small GPT -------------------------------------------------------------------
VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 2, 2
MICRO_BATCH = 2  # sequences per rank per micro-batch
GRAD_ACC = 2  # micro-batches per optimizer step
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 2
EVAL_EVERY = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.fc = nn.Linear(DIM, 4 * DIM, bias=False)
        self.out = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.04)  # GPT-2 uses 0.02; here the clip at 1.0 acts

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def configure_optimizers(model: nn.Module, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """nanoGPT's split: matrices and embeddings decay, biases and norms do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def get_lr(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to MIN_LR."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    ratio = (step - WARMUP) / max(1, steps - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


# ---- synthetic data: a noisy rule the model can learn -----------------------------------------
def get_batch(seed: int, rank: int, world: int, device: torch.device):
    """The global batch of ``seed`` (the same on every rank); rank r takes its own rows.

    Each sequence follows x[t+1] = (5·x[t] + 3) mod VOCAB, with 10% of the tokens random."""
    g = torch.Generator().manual_seed(seed)
    n = world * MICRO_BATCH
    x = torch.empty(n, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = (5 * x[:, t] + 3) % VOCAB
    noise = torch.rand(n, SEQ + 1, generator=g) < 0.1
    x = torch.where(noise, torch.randint(0, VOCAB, (n, SEQ + 1), generator=g), x)
    rows = x[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH].to(device)
    return rows[:, :-1], rows[:, 1:]


# ---- one rank of the run ------------------------------------------------------------------------
def train(rank: int, world: int, wrap: str = "ddp", stage: int = 0, steps: int = 8,
          checkpoint: str | None = None, save_at: int | None = None, resume: bool = False) -> dict:
    """Train ``steps`` optimizer steps; return ``{"loss": [...], "grad_norm": [...], "eval": {step: loss}}``
    (this rank's training loss and the clipped norm per step, from the first step run; the
    evaluation losses on the ranks that evaluated). ``save_at``: write ``checkpoint`` after that
    many steps; ``resume``: continue from ``checkpoint``."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = TinyGPT().to(device)

    # ---- the only line that differs between DDP and zerodp -------------------------------------
    model = DDP(model) if wrap == "ddp" else zerodp.parallelize(model, stage=stage)
    # --------------------------------------------------------------------------------------------
    raw_model = model.module
    optimizer = configure_optimizers(raw_model)  # after the wrap, over the module's parameters

    scaler = torch.amp.GradScaler(device.type, enabled=False)  # enabled only for fp16 autocast
    start = 0
    if resume:
        ckpt = torch.load(checkpoint, map_location=device, weights_only=True)
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = ckpt["step"]

    out = {"loss": [], "grad_norm": [], "eval": {}}
    model.train()
    for step in range(start, steps):
        if step % EVAL_EVERY == 0 and step > start and rank == 0:  # as nanoGPT: before the step, rank 0 only
            model.eval()
            with torch.no_grad():
                x, y = get_batch(10**6, 0, 1, device)  # one fixed validation batch
                out["eval"][step] = model(x, y).item()
            model.train()
        lr = get_lr(step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(GRAD_ACC):
            model.require_backward_grad_sync = micro == GRAD_ACC - 1  # synchronize the last one only
            x, y = get_batch(1000 * step + micro, rank, world, device)
            loss = model(x, y) / GRAD_ACC
            scaler.scale(loss).backward()
            loss_sum += loss.item()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad(set_to_none=True)
        out["loss"].append(loss_sum)
        out["grad_norm"].append(norm.item())

        if checkpoint is not None and step + 1 == save_at and rank == 0:
            ckpt = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            torch.save(ckpt, checkpoint)  # on disk before any rank ends the next step, which needs rank 0
    return out


def run_example(doc: str, steps: int, run, argv: list[str] | None = None, what: str = "optimizer steps"):
    """The command line of the ported examples (``--wrap``, ``--stage``, ``--steps``), the process
    group, a scratch folder for checkpoints shared by the ranks: ``run(args, rank, world, device,
    folder)`` is the run, whose result comes back with this rank's number."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--wrap", choices=("ddp", "zerodp"), default="zerodp")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=0, help="zerodp's ZeRO stage")
    p.add_argument("--steps", type=int, default=steps, help=what)
    args = p.parse_args(argv)
    rank, world, device = setup()
    box = [tempfile.mkdtemp(prefix="zerodp-example-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one folder for every rank (one machine: torchrun --standalone)
    try:
        return rank, run(args, rank, world, device, box[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
        dist.destroy_process_group()


def setup() -> tuple[int, int, torch.device]:
    """torchrun's process group (NCCL on CUDA, else gloo), or a single process without torchrun."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wrap", choices=("ddp", "zerodp"), default="zerodp")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="zerodp's ZeRO stage")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--checkpoint", default=None, help="file to save at --save-at, or to --resume from")
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    rank, world, _ = setup()
    try:
        out = train(rank, world, args.wrap, args.stage, args.steps, args.checkpoint, args.save_at, args.resume)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        first = 0 if not args.resume else args.steps - len(out["loss"])
        for i, (loss, norm) in enumerate(zip(out["loss"], out["grad_norm"])):
            step = first + i + 1
            extra = f"  eval {out['eval'][step]:.4f}" if step in out["eval"] else ""
            print(f"step {step:3d}  loss {loss:.4f}  grad norm {norm:.3f}{extra}")
    return out


if __name__ == "__main__":
    main()
