"""What ``zerodp check`` runs: the model, the optimizer, the batches and the usages, as one
dataclass (:class:`CheckConfig`), and how each is resolved on a rank (guide §2.2, §5, §12.3).

The model is a factory (``"pkg.module:build"`` or a callable, called with no arguments after
``torch.manual_seed(seed)``: the same weights every time it is built) or a Hugging Face
``config.json`` (``AutoModelForCausalLM.from_config``: random weights, nothing downloaded). The
optimizer is a stock ``torch.optim`` name with keyword arguments, or a factory called with the
model that returns one optimizer or a list over disjoint parameters (Muon + AdamW). Batches come
from a factory ``fn(step, micro, rows)`` returning the global micro-batch (a tuple of positional
arguments or a dict of keyword arguments, tensors with ``rows`` rows; each rank takes its slice of
the rows), called after ``torch.manual_seed``; without one, a batch of the model's input shape is
generated. The loss is the model's output when it is a scalar, its ``.loss`` (a ``transformers``
output given ``labels``), ``loss(output, batch)`` when a loss factory is named, else the mean
square of the output.

Torch is imported inside the functions that need it: the CLI's parser stays light.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

#: stock optimizers by lower-case name (a torch.optim class name, case-insensitive, also works)
STOCK = ("sgd", "adam", "adamw", "adafactor", "rmsprop", "adagrad", "nadam", "radam", "adamax", "muon+adamw")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")


class CheckInputError(ValueError):
    """A setting of ``zerodp check`` that cannot run; the message says what to give instead."""


@dataclass
class CheckConfig:
    """Everything one ``zerodp check`` runs (``zerodp check -h`` describes each field's flag).

    ``perturb_lr`` is a test-only seam: every learning rate of the engine's optimizer (not the
    reference's) is multiplied by ``1 + perturb_lr`` — the check must then FAIL (the check of the
    check, docs/check.md)."""

    model: Any = None                      # "pkg.module:build" or a callable returning an nn.Module
    config: str | None = None              # a Hugging Face config.json (or its directory)
    optimizer: str = "adamw"               # a stock name (STOCK)
    optimizer_args: dict = field(default_factory=lambda: {"lr": 1e-2})
    optimizer_factory: Any = None          # "pkg.module:fn" or callable(model) -> optimizer | [optimizers]
    batch: Any = None                      # "pkg.module:fn" or callable(step, micro, rows) -> tuple | dict
    loss: Any = None                       # "pkg.module:fn" or callable(output, batch) -> scalar
    input_shape: tuple = ()                # generated batches: one row's shape
    vocab: int = 0                         # generated batches of token ids below this (0: floats)
    seq: int = 32                          # generated token batches of an HF config: tokens per row
    units: str | None = None               # stage 3 units: an attribute path to a ModuleList
    stages: tuple = (0, 1, 2, 3)
    worlds: tuple = (2,)
    steps: int = 3
    micro_batches: int = 2                 # per step; all but the last under no_sync (guide §5)
    rows: int = 2                          # rows per rank per micro-batch
    clip: float | None = 1.0               # clip_grad_norm_ before each step (None: no clipping)
    precision: str = "fp32"                # "fp32" or "bf16" (mixed precision, fp32 master)
    reshard: bool = True                   # save at each row's stage/world, load at another
    seed: int = 0
    device: str = "auto"
    timeout: float = 900.0
    perturb_lr: float = 0.0

    def validate(self) -> "CheckConfig":
        """One line naming the first setting that cannot run (:class:`CheckInputError`)."""
        if (self.model is None) == (self.config is None):
            raise CheckInputError("give the model: --model pkg.module:build (a factory returning an nn.Module) "
                                  "or --config config.json (a Hugging Face config, random weights), one of them")
        if self.config is not None and not os.path.exists(self.config):
            raise CheckInputError(f"--config {self.config}: no such file or directory (give a Hugging Face "
                                  "config.json or the directory holding it)")
        if self.optimizer_factory is None and self.optimizer.lower() not in STOCK:
            raise CheckInputError(f"--optimizer {self.optimizer!r}: use one of {', '.join(STOCK)}, or "
                                  "--optimizer-factory pkg.module:fn for any other")
        bad = [s for s in self.stages if s not in (0, 1, 2, 3)]
        if bad or not self.stages:
            raise CheckInputError(f"--stages {bad or 'none'}: stages are 0 (DDP), 1, 2 and 3 (FSDP)")
        if not self.worlds or any(int(w) < 1 for w in self.worlds):
            raise CheckInputError(f"--worlds {list(self.worlds)}: world sizes are whole numbers >= 1")
        for name in ("steps", "micro_batches", "rows"):
            if int(getattr(self, name)) < 1:
                raise CheckInputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.reshard and self.steps < 2:
            raise CheckInputError("--steps must be >= 2 with resharding (one step before the checkpoint, one after); "
                                  "or pass --no-reshard")
        if self.precision not in PRECISIONS:
            raise CheckInputError(f"--mixed-precision {self.precision!r}: use fp32 or bf16")
        if self.device not in DEVICES:
            raise CheckInputError(f"--device {self.device!r}: use auto, cpu or cuda")
        if self.clip is not None and not self.clip > 0:
            raise CheckInputError(f"--clip must be > 0 (or 0 for no clipping), got {self.clip}")
        if self.batch is None and self.config is None and not self.input_shape:
            raise CheckInputError("give the batches: --batch pkg.module:fn (fn(step, micro, rows) returns the "
                                  "global micro-batch) or --input-shape C,H,W (one row's shape; --vocab N for "
                                  "token ids)")
        return self

    @property
    def ranks(self) -> int:
        """Ranks to spawn: the largest world asked for."""
        return max(int(w) for w in self.worlds)


def resolve(ref: Any, what: str) -> Callable:
    """A callable from ``"pkg.module:name"`` (or the callable itself)."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or ":" not in ref:
        raise CheckInputError(f"{what} {ref!r}: give pkg.module:name (a module on the Python path and a "
                              "function in it)")
    module, _, name = ref.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise CheckInputError(f"{what} {ref}: cannot import {module} ({e}); is its folder on PYTHONPATH?") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise CheckInputError(f"{what} {ref}: {module} has no {name}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CheckInputError(f"{what} {ref}: {name} is not callable")
    return obj


def hf_config(path: str):
    """The ``transformers`` config of a ``config.json`` (or the directory holding one)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise CheckInputError("--config needs transformers: pip install 'zerodp[hf]'") from None
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        data = json.loads(open(file).read())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckInputError(f"--config {path}: cannot read it as JSON ({e})") from None
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise CheckInputError(f"--config {path}: no model_type (a Hugging Face config.json names its model_type)")
    return AutoConfig.for_model(model_type, **data)


def build_model(cfg: CheckConfig):
    """The model, built after ``torch.manual_seed(cfg.seed)``: the same weights on every call."""
    import torch

    torch.manual_seed(cfg.seed)
    if cfg.config is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config(cfg.config))
    else:
        model = resolve(cfg.model, "--model")()
    if not isinstance(model, torch.nn.Module):
        raise CheckInputError(f"--model {cfg.model}: returned a {type(model).__name__}, not a torch.nn.Module")
    return model.train()


def find_units(model, path: str | None):
    """Stage 3's FSDP units (guide §10.3): the ModuleList at ``path``, else the ModuleList holding
    the most parameters (a transformer's blocks), else none (the whole model is one unit)."""
    import torch.nn as nn

    if path:
        obj = model
        for part in path.split("."):
            if not hasattr(obj, part):
                raise CheckInputError(f"--units {path}: the model has no {part}")
            obj = getattr(obj, part)
        return list(obj)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return None
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def stock_class(name: str):
    import torch

    by_lower = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
                if isinstance(getattr(torch.optim, n), type)}
    return by_lower[name.lower()]


def engine_optimizer(cfg: CheckConfig, model):
    """What ``parallelize`` takes as ``optimizer`` for this config (built over ``model``)."""
    name = cfg.optimizer.lower()
    if cfg.optimizer_factory is not None:
        return _checked(resolve(cfg.optimizer_factory, "--optimizer-factory")(model), cfg)
    if name == "muon+adamw":
        return muon_adamw(model, cfg.optimizer_args)
    cls, args = stock_class(name), dict(cfg.optimizer_args)
    return lambda groups: cls(groups, **args)


def reference_optimizer(cfg: CheckConfig, model):
    """The same optimizer over the single-process reference's parameters."""
    from zerodp.check.core import Stepped

    name = cfg.optimizer.lower()
    if cfg.optimizer_factory is not None:
        built = _checked(resolve(cfg.optimizer_factory, "--optimizer-factory")(model), cfg)
    elif name == "muon+adamw":
        built = muon_adamw(model, cfg.optimizer_args)
    else:
        built = stock_class(name)([p for p in model.parameters() if p.requires_grad], **cfg.optimizer_args)
    return Stepped(built) if isinstance(built, (list, tuple)) else built


def muon_adamw(model, args: dict):
    """Muon over the 2-D weights but the embeddings and the head (as Muon is used), AdamW over
    the rest, both with ``args`` (docs/engine.md, "Optimizers")."""
    import torch

    skip = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = getattr(model, "get_output_embeddings", lambda: None)()
    if out is not None:
        skip.add(id(out.weight))
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trainable if p.ndim == 2 and id(p) not in skip]
    rest = [p for p in trainable if not (p.ndim == 2 and id(p) not in skip)]
    opts = [torch.optim.Muon(matrices, **args)] if matrices else []
    return opts + ([torch.optim.AdamW(rest, **args)] if rest else [])


def _checked(built, cfg: CheckConfig):
    import torch

    items = built if isinstance(built, (list, tuple)) else [built]
    if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise CheckInputError(f"--optimizer-factory {cfg.optimizer_factory}: must return a torch.optim optimizer "
                              f"or a list of them, got {type(built).__name__}")
    return list(built) if isinstance(built, (list, tuple)) else built


def make_batch(cfg: CheckConfig, step: int, micro: int, rows: int, device):
    """The global micro-batch ``(args, kwargs)`` of ``step``/``micro`` with ``rows`` rows, the
    same on every rank and in the reference (the RNG is seeded from the step and micro-batch)."""
    import torch

    torch.manual_seed(1_000_003 * (cfg.seed + 1) + 1009 * step + micro)
    if cfg.batch is not None:
        out = resolve(cfg.batch, "--batch")(step, micro, rows)
    elif cfg.config is not None:
        vocab = cfg.vocab or hf_config(cfg.config).vocab_size
        ids = torch.randint(0, vocab, (rows, cfg.seq))
        out = {"input_ids": ids, "labels": ids}
    elif cfg.vocab:
        out = (torch.randint(0, cfg.vocab, (rows, *cfg.input_shape)),)
    else:
        out = (torch.randn(rows, *cfg.input_shape),)
    if isinstance(out, torch.Tensor):
        out = (out,)
    args, kwargs = (tuple(out), {}) if isinstance(out, (tuple, list)) else ((), dict(out))
    def move(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def shard(batch, rank: int, world: int, rows: int):
    """Rank ``rank``'s rows of the global micro-batch (tensors with ``rows`` rows are sliced)."""
    import torch

    args, kwargs = batch
    per = rows // world

    def cut(t):
        return t[rank * per:(rank + 1) * per] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == rows else t
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def loss_of(cfg: CheckConfig, output, batch):
    """The scalar loss of a forward (module docstring)."""
    import torch

    if cfg.loss is not None:
        return resolve(cfg.loss, "--loss")(output, batch)
    if isinstance(output, torch.Tensor) and output.ndim == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().square().mean()
    raise CheckInputError(f"the model returned a {type(output).__name__}: give --loss pkg.module:fn "
                          "(fn(output, batch) returns a scalar)")
