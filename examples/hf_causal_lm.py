"""Train a Hugging Face causal LM with zerodp at stage 3 (FSDP), then save it as a Hugging Face directory.

    torchrun --standalone --nproc-per-node 2 examples/hf_causal_lm.py \\
        --config examples/configs/tiny-llama --steps 30 --out runs/tiny-llama-hf
    torchrun --standalone --nproc-per-node 2 examples/hf_causal_lm.py \\
        --checkpoint runs/tiny-llama-hf --steps 30 --out runs/tiny-llama-hf-2

``--config DIR`` builds the model from ``DIR/config.json`` with random weights; ``--checkpoint DIR``
continues from a local Hugging Face directory (config.json + *.safetensors): the model is built from
its config, wrapped at stage 3, and ``zerodp.engine.hf.load_hf`` fills each rank's 1/N shard,
reading only those bytes from the files (guide §12.1). Nothing is downloaded.

The model (any ``AutoModelForCausalLM``) is wrapped with
``zerodp.parallelize(model, optimizer=..., stage=3, units=<its decoder layers>, mixed_precision="bf16")``
— one FSDP unit per decoder layer plus a root unit for embeddings, final norm and head (guide §10.3)
— with activation checkpointing in every layer. It trains on the bundled corpus (Python's own
documentation, one byte per token, ids < vocab_size), and ``zerodp.engine.hf.save_hf`` writes the
result, which ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads. Gloo on CPU, NCCL
when CUDA is available. Without torchrun it runs as a single process (world size 1).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from zerodp.engine.hf import load_hf, save_hf
from zerodp.train.data import Windows, load_corpus
from porting_ddp import setup  # the process group as this folder's DDP example sets it up

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_CONFIG = os.path.join(HERE, "configs", "tiny-llama")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default=None,
                     help=f"directory with a config.json: random initial weights (default {TINY_CONFIG})")
    src.add_argument("--checkpoint", default=None,
                     help="local Hugging Face directory (config.json + *.safetensors) to start from")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on 1-D parameters)")
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 compute with fp32 master weights, or fp32 throughout")
    p.add_argument("--no-activation-checkpointing", action="store_true",
                   help="keep every layer's activations instead of recomputing them in backward")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches")
    p.add_argument("--compile", action="store_true",
                   help="model.compile() before parallelize (inductor on CUDA, aot_eager on CPU; docs/engine.md)")
    p.add_argument("--out", default=None, help="write the trained model here as a Hugging Face directory")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the saved weights")
    args = p.parse_args(argv)
    if args.config is None and args.checkpoint is None:
        args.config = TINY_CONFIG
    for name in ("steps", "seq_len", "micro_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    src = args.config or args.checkpoint
    if not os.path.isfile(os.path.join(src, "config.json")):
        p.error(f"{src} holds no config.json: give --config or --checkpoint a directory with one")
    return args


def build_model(args: argparse.Namespace) -> nn.Module:
    """The causal LM of ``config.json``, randomly initialised from ``args.seed`` (the same on every
    rank); with ``--checkpoint`` its weights are loaded after ``parallelize`` (see :func:`train`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.config or args.checkpoint)
    config.use_cache = False
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (one FSDP unit each): ``model.model.layers`` for Llama, Mistral, Qwen...,
    otherwise the largest ``nn.ModuleList``."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of layers to use as FSDP units")
    return list(max(lists, key=len))


def global_batch(step: int, windows: Windows, n: int, seed: int, vocab_size: int):
    """The ``n`` sequences of a step, the same on every rank (rank r trains on its rows), and the
    same for a single process training on all of them: input ids and next-token targets."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x, y = windows.batch(torch.randint(0, windows.count, (n,), generator=g).tolist())
    if vocab_size < 256:  # byte tokens; a vocabulary smaller than a byte folds them
        x, y = x % vocab_size, y % vocab_size
    return x, y


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def no_decay_on_vectors(name: str, p: torch.Tensor) -> dict:
    return {"weight_decay": 0.0} if p.ndim < 2 else {}


def enable_activation_checkpointing(model: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device, log=print) -> dict:
    """Build, wrap, (load,) train and (save) on this rank; returns the losses and the engine."""
    model = build_model(args).to(device)
    if not args.no_activation_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    if getattr(args, "compile", False):  # in place: the engine's hooks stay outside the graphs
        model.compile(backend="inductor" if device.type == "cuda" else "aot_eager")
    engine = zerodp.parallelize(
        model, optimizer=lambda groups: torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay),
        stage=args.stage, units=decoder_layers(model) if args.stage == 3 else None,
        mixed_precision="bf16" if args.mixed_precision == "bf16" else None,
        param_groups=no_decay_on_vectors)
    loaded = None
    if args.checkpoint:
        loaded = load_hf(engine, args.checkpoint)
        log(f"rank {rank}: read {loaded.bytes_read / 2**20:.2f} MiB of {loaded.file_bytes / 2**20:.2f} MiB "
            f"from {args.checkpoint}")
    corpus = load_corpus()
    windows = Windows(corpus.train, args.seq_len, "train", corpus.name)
    vocab = model.config.vocab_size
    mb = args.micro_batch
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = global_batch(step, windows, mb * world, args.seed, vocab)
        x, y = x[rank * mb:(rank + 1) * mb].to(device), y[rank * mb:(rank + 1) * mb].to(device)
        loss = lm_loss(engine, x, y)
        loss.backward()
        engine.step()
        engine.zero_grad()
        mean = loss.detach().float().reshape(1).clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            log(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)")
    if args.out:
        config = json.loads(model.config.to_json_string(use_diff=False))
        config.update(dtype=args.save_dtype, torch_dtype=args.save_dtype)
        save_hf(engine, args.out, dtype=getattr(torch, args.save_dtype), config=config)
        if rank == 0:
            log(f"saved {args.out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return {"losses": losses, "final_loss": losses[-1], "out": args.out, "engine": engine, "loaded": loaded}


def _device(backend: str) -> torch.device:
    if "nccl" in backend:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> dict:
    """Under torchrun (or zerodp.spawn.run_local) one rank of the run; alone, a world of 1."""
    args = parse_args(argv)
    own_group = not dist.is_initialized()
    if own_group:
        setup()  # torchrun's process group (NCCL on CUDA, else gloo), or a single process without torchrun
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        result = train(args, rank, world, _device(str(dist.get_backend())))
        if rank == 0:
            print(f"final loss {result['final_loss']:.4f} after {args.steps} steps on {world} rank(s), stage "
                  f"{args.stage}, {args.mixed_precision}")
        result.pop("engine")
        return result
    finally:
        if own_group:
            dist.destroy_process_group()


def run_rank(rank: int, world: int, argv: list[str]) -> dict:
    """For ``zerodp.spawn.run_local(run_rank, 2, argv)``: the process group is already up."""
    return main(argv)


if __name__ == "__main__":
    main()
