"""What every stage of the engine shares: the public contract and the step template.

Seed §9: stages 0-3 run the same training step — forward, backward with gradient communication,
an optimizer step on fp32 master values — and differ only in *what* each rank keeps and *which*
collectives move it (DESIGN §2, the table "one flat buffer, four policies"). This module holds
the part that does not depend on the stage:

- the public API the training app is written against (``engine(x, y)``, ``no_sync``,
  ``clip_grad_norm_``, ``step``, ``zero_grad``, ``stats``, ``export_chrome_trace``,
  checkpoint pieces, ``full_state_dict``, ``layout``);
- the step template: finish gradient sync → (clip) → master optimizer step → publish params;
- the bookkeeping every stage needs: process group, device, recorder and collectives, param
  groups, the start-up consistency check across ranks, the end-of-backward callback, averaging
  by tokens (seed §2.2), measured memory by kind.

Constructor (every stage, including ``zerodp.engine.fsdp.FSDPEngine``)::

    StageEngine(module, optimizer_factory, config: EngineConfig,
                units: list[nn.Module] | None = None, group: ProcessGroup | None = None)

``optimizer_factory(param_groups) -> torch.optim.Optimizer`` builds a stock, elementwise
optimizer over the engine's fp32 master tensors (see :mod:`zerodp.engine.master`). ``units`` is
used by stage 3 only (FSDP units, seed §10.3); stages 0-2 ignore it.

What a stage subclass must provide
----------------------------------
Set the class attribute ``stage`` (0..3). In ``__init__``: call ``super().__init__(...)`` first,
then build your flat buffers, then ``self.master = self._build_master(targets)`` with the
:class:`~zerodp.engine.master.Target` s of each flat buffer (fp32, the full buffer for stage 0,
the rank's shard for stages 1-3; one target per buffer, or several consecutive pieces of it from
:func:`split_target` with ``self._optimizer_chunk()`` — faster on CPU), then ``self._check_consistency(description)`` and
``self._start_clock()``. Then implement:

``_finish_grad_sync()``
    Block until every gradient collective of this step is done, so that the tensors
    returned by ``_master_grads`` hold final (averaged) gradients. Called by ``clip_grad_norm_``
    and ``step``; must be cheap when nothing is pending.
``_master_grads() -> list[Tensor | None]``
    One 1-D gradient per ``self.master.targets`` entry, same length as the target (any float
    dtype: the base casts to fp32 for the optimizer). ``None`` skips the target this step.
``_publish_params()``
    After the master step (called by the default ``_optimizer_step``) and after loading a
    checkpoint: bring the compute parameters up to date (cast fp32 → bf16, copy, AllGather).
    May launch asynchronous work; then override ``_wait_params``.
``_zero_grad()``
    Reset gradient accumulation for the next step.
``_memory_tensors() -> dict[str, list[Tensor]]``
    The tensors this rank holds by kind: ``params``, ``grads``, ``gathered`` (stage 3 units),
    ``comm_buffers`` (buckets in flight). ``master`` and ``optimizer_states`` are added here.

Optional overrides: ``grads_sharded`` (class attribute: True when ``_master_grads`` are this
rank's disjoint shards, so the gradient norm needs one AllReduce; False for stage 0's replicas),
``_before_forward()`` / ``_after_forward(out)``, ``_on_backward_end()`` (runs once at the end
of every backward in which ``_backward_started()`` was called — call it from your gradient
hooks), ``_wait_params()`` (wait for in-flight parameter collectives), ``_optimizer_step()``
(the default steps all targets at once, then calls ``_publish_params``), ``_owned_range(target)`` (what this rank saves),
``_layout_extra(i, target)``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from zerodp.engine.comm import Collectives
from zerodp.engine.config import EngineConfig
from zerodp.engine.guard import NonFiniteGuard
from zerodp.engine.layout import FlatLayout
from zerodp.engine.master import MasterOptimizer, OptimizerFactory, Piece, Target
from zerodp.engine.trace import COMPUTE, Recorder, write_chrome_trace

#: seed §1: what each kind of tensor is, for ``stats()``; the first four are the "model states".
MEMORY_KINDS = ("params", "grads", "master", "optimizer_states", "gathered", "comm_buffers")
MODEL_STATE_KINDS = MEMORY_KINDS[:4]
#: On CPU the stock optimizer's per-tensor path makes ~8 passes over each tensor it updates; over
#: chunks of this many elements (512 KiB of fp32) those passes stay in cache, where over one flat
#: buffer of millions of elements each pass goes to memory (AdamW on 11M elements: ~2-3x faster).
CPU_OPTIMIZER_CHUNK = 1 << 17
_NORM_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def module_device(module: nn.Module) -> torch.device:
    """The one device all of ``module``'s parameters live on (DDP's rule: one device per rank)."""
    devices = {p.device for p in module.parameters()}
    if not devices:
        raise ValueError("the model has no parameters: there is nothing to train data-parallel")
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are spread over {sorted(map(str, devices))}; data parallelism "
            "keeps one full replica per rank on one device: move the model with model.to(device)"
        )
    return devices.pop()


def resolve_param_groups(named_params: list[tuple[str, nn.Parameter]],
                         rule: Callable[[str, nn.Parameter], dict] | None) -> tuple[list[dict], list[int]]:
    """Map each parameter to an optimizer param group (e.g. no weight decay on norms and biases).

    ``rule(name, param)`` returns the group's options; parameters with equal options share a
    group, and each group gets its own flat buffers (a bucket never mixes groups). Returns the
    option dicts and, per parameter, its group index.
    """
    options: list[dict] = []
    index: list[int] = []
    for name, p in named_params:
        opts = {} if rule is None else rule(name, p)
        if not isinstance(opts, dict):
            raise ValueError(
                f"param_groups({name!r}, param) returned {type(opts).__name__}; it must return a dict "
                "of optimizer options such as {'weight_decay': 0.0} (or {} for the defaults)"
            )
        if "params" in opts:
            raise ValueError(f"param_groups({name!r}, param) must not return 'params': the engine fills it")
        if opts not in options:
            options.append(dict(opts))
        index.append(options.index(opts))
    return options, index


def split_target(tensor: torch.Tensor, layout: FlatLayout, flat_start: int, group: int,
                 chunk: int | None) -> list[Target]:
    """One master tensor as optimizer targets of at most ``chunk`` elements (views, no copies)."""
    n = tensor.numel()
    step = n if not chunk else chunk
    return [Target(tensor[a:min(a + step, n)], layout, flat_start + a, group) for a in range(0, max(n, 1), step)]


def describe_difference(mine: Any, other: Any, path: str = "") -> str | None:
    """The first place where two nested descriptions differ, in words (None when equal)."""
    if type(mine) is not type(other):
        return f"{path or 'value'}: {mine!r} vs {other!r}"
    if isinstance(mine, dict):
        for key in list(mine) + [k for k in other if k not in mine]:
            if key not in mine or key not in other:
                return f"{path}{key}: present on {'rank 0' if key in mine else 'the other rank'} only"
            diff = describe_difference(mine[key], other[key], f"{path}{key}.")
            if diff:
                return diff
        return None
    if isinstance(mine, (list, tuple)):
        for i, (a, b) in enumerate(zip(mine, other)):
            diff = describe_difference(a, b, f"{path}[{i}]")
            if diff:
                return diff
        if len(mine) != len(other):
            return f"{path.rstrip('.') or 'list'}: {len(mine)} entries vs {len(other)}"
        return None
    return None if mine == other else f"{path.rstrip('.')}: {mine!r} vs {other!r}"


class StageEngine:
    """Base class of the stage engines; see the module docstring for the subclass contract."""

    stage: ClassVar[int] = -1
    grads_sharded: ClassVar[bool] = True
    #: True when ``config.bucket_mb`` was chosen by ``bucket_mb="auto"`` (stages 0-2, seed §4).
    bucket_auto: bool = False

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, config: EngineConfig,
                 units: list[nn.Module] | None = None, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: launch with torchrun (which sets RANK and "
                "WORLD_SIZE) and call torch.distributed.init_process_group(), or use "
                "zerodp.spawn.run_local for local ranks"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"parallelize expects a torch.nn.Module, got {type(module).__name__}")
        if not callable(optimizer_factory) or isinstance(optimizer_factory, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a factory, e.g. optimizer=lambda groups: torch.optim.AdamW(groups, "
                "lr=3e-4): the engine builds the optimizer over its own fp32 master shards"
            )
        if config.stage != self.stage:
            raise ValueError(f"{type(self).__name__} runs stage {self.stage}, config asks for {config.stage}")
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = module_device(module)
        self.units = units
        self.recorder = Recorder(self.rank)
        self.comm = Collectives(self.recorder, group)
        self.mixed_precision = config.mixed_precision
        self._module = module
        self._factory = optimizer_factory
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no parameters with requires_grad=True: nothing to train")
        self.group_options, self.param_group_of = resolve_param_groups(self.named_params, config.param_groups)
        self.master: MasterOptimizer | None = None
        self._sync = True  # False inside no_sync(): gradients accumulate locally (seed §5)
        self._sync_at_forward = True
        self._tokens = 0.0  # this rank's tokens in this step (average_by_tokens, seed §2.2)
        self._token_factor_value: float | None = None
        self._backward_armed = False
        self._backward_event = None
        self._last_step_end: float | None = None
        self.last_step_time_s: float | None = None
        # Non-finite gradients: skip the step on every rank alike (see zerodp.engine.guard).
        skips = getattr(config, "max_nonfinite_skips", None)
        self.guard = None if skips is None else NonFiniteGuard(skips)

    # ---- public API ---------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model, with its parameters complete (waits for in-flight AllGathers)."""
        self._wait_params()
        return self._module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The stock optimizer over the fp32 master tensors (e.g. for an LR scheduler)."""
        return self.master.optimizer

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._sync_at_forward = self._sync  # as DDP: no_sync applies to the forward it wraps
        self._before_forward()
        with self.recorder.span("forward", COMPUTE):
            out = self._module(*args, **kwargs)
        self._after_forward(out)
        first = _first_grad_tensor(out)
        if first is not None:  # the output's gradient is the first thing backward computes
            first.register_hook(self._on_output_grad)
        return out

    def train(self, mode: bool = True) -> "StageEngine":
        self._module.train(mode)
        return self

    def eval(self) -> "StageEngine":
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Seed §5: inside, backward accumulates gradients locally and communicates nothing.

        ``with engine.no_sync(micro < grad_acc - 1):`` around forward and backward is the usual
        loop; as with DDP, what counts is whether the *forward* ran inside. ``enabled=False`` makes
        it a no-op. (Stage 2 by default still reduces every micro-batch — memory first — unless
        ``reduce_every_microbatch=False``; see :mod:`zerodp.engine.zero2`.)
        """
        previous = self._sync
        self._sync = previous and not enabled
        try:
            yield
        finally:
            self._sync = previous

    def count_tokens(self, n: int | float) -> None:
        """With ``average_by_tokens=True``: add this micro-batch's token count on this rank.

        Seed §2.2: when each rank's loss is the mean over its own tokens and ranks see different
        token counts, plain averaging is biased; rank r's gradient is then weighted by
        n_r / Σ n instead of 1/N, which equals the full-batch token mean. The step's count must be
        complete before its first gradient reduction: the last micro-batch's backward for stages
        0-1, the *first* backward for stage 2 (it reduces every micro-batch), so count all
        micro-batches of the step up front there. The count resets at ``step()``.
        """
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        self._tokens += float(n)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

        The norm covers every gradient of the model. Sharded stages hold disjoint shards, so the
        squared norms of the local shards are summed with one AllReduce (seed §9; DESIGN §2).
        Matches ``torch.nn.utils.clip_grad_norm_``: grads *= min(1, max_norm / (norm + 1e-6)).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: only the 2-norm is supported across shards")
        self._finish_grad_sync()
        grads = [g for g in self._master_grads() if g is not None]
        if grads:
            norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
            sq = torch.stack(norms).square().sum().reshape(1)
        else:
            sq = torch.zeros(1, device=self.device)
        if self.grads_sharded and self.world_size > 1:
            sq = self.comm.all_reduce_sum(sq, "grad_norm")
        norm = sq.sqrt()[0]
        coef = torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm

    def step(self) -> None:
        """Finish gradient sync, update the fp32 master values, publish the new parameters."""
        with self.recorder.span("step", COMPUTE):
            self._finish_grad_sync()
            if self.guard is not None and self.guard.should_skip(self):  # collective
                self._zero_grad()  # inf/NaN somewhere: apply nothing, on every rank
            else:
                self._optimizer_step()
        self._tokens = 0.0
        self._token_factor_value = None
        now = self.recorder.clock()
        if self._last_step_end is not None:
            self.last_step_time_s = now - self._last_step_end
        self._last_step_end = now
        self.recorder.next_step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 — flat buffers are reused
        """Reset gradients for the next step (flat buffers are zeroed in place, never freed)."""
        self._finish_grad_sync()
        self._zero_grad()

    def stats(self):
        """Measured bytes per rank by kind, the last step's collectives, exposed comm, step time."""
        from zerodp.engine.stats import collect_stats

        return collect_stats(self)

    def export_chrome_trace(self, path: str | os.PathLike, step: int | None = None) -> str | None:
        """Collective: rank 0 writes every rank's events as Chrome-trace JSON (Perfetto-loadable)."""
        events = self.recorder.chrome_events(step)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, events, group=self.group)
        if self.rank != 0:
            return None
        return write_chrome_trace(path, [e for rank_events in gathered for e in rank_events])

    # ---- checkpoint contract ------------------------------------------------------------
    def state_pieces(self) -> list[Piece]:
        """The master values and optimizer states this rank saves: disjoint across ranks, and
        together they cover every element of every parameter (padding excluded)."""
        self._finish_grad_sync()
        return self.master.pieces(ranges=self._owned_range)

    def load_state_pieces(self, read: Callable[[str, str, int, int], torch.Tensor]) -> None:
        """Fill master values and optimizer states from ``read(name, kind, start, stop)``, then
        publish the parameters (collective for sharded stages). Call ``load_scalar_state`` first."""
        self._finish_grad_sync()
        self._wait_params()
        self.master.load_pieces(read)
        self._publish_params()
        self._wait_params()

    def scalar_state(self) -> dict:
        return {"stage": self.stage, **self.master.scalar_state()}

    def load_scalar_state(self, scalars: dict) -> None:
        self.master.load_scalar_state(scalars)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets every parameter as an fp32 tensor (from the master)."""
        self._finish_grad_sync()
        return self._gather_full([t.tensor for t in self.master.targets])

    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank gets the averaged gradient the next ``step`` would apply, as
        fp32 tensors by parameter name (gathered from the shards; for inspection and tests)."""
        self._finish_grad_sync()
        grads = self._master_grads()
        return self._gather_full([torch.zeros_like(t.tensor) if g is None else g
                                  for t, g in zip(self.master.targets, grads)])

    def _gather_full(self, values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-target values (aligned with ``master.targets``) → full tensors by parameter name."""
        out: dict[str, torch.Tensor] = {}
        position = {id(t): i for i, t in enumerate(self.master.targets)}
        for layout, _, targets in self._layouts():
            lo = min(t.flat_start for t in targets)
            hi = max(t.flat_start + t.tensor.numel() for t in targets)
            local = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
            for t in targets:
                local[t.flat_start - lo:t.flat_start - lo + t.tensor.numel()].copy_(values[position[id(t)]])
            if hi - lo == layout.padded_numel:
                flat = local
            else:  # this rank holds shard r: gather the others' (ranks hold equal shards)
                flat = torch.empty(layout.padded_numel, dtype=torch.float32, device=self.device)
                self.comm.all_gather(flat, local, "gather_full", async_op=False)
            for slot in layout.slots:
                out[slot.name] = flat[slot.offset:slot.stop].view(slot.shape).clone()
        return out

    def layout(self) -> list[dict]:
        """The flat buffers as data: which parameter sits at which offset, padding, owners."""
        out = []
        for i, (layout, group, targets) in enumerate(self._layouts()):
            held = sum(t.tensor.numel() for t in targets)
            d = layout.to_dict()
            d.update(index=i, group=group, options=self.group_options[group],
                     sharded=held != layout.padded_numel,
                     owners=[list(layout.shard_range(r)) for r in range(self.world_size)])
            d.update(self._layout_extra(i, targets[0]))
            out.append(d)
        return out

    def _layouts(self) -> list[tuple[FlatLayout, int, list[Target]]]:
        """Distinct flat layouts in target order, each with its group and this rank's targets."""
        by_id: dict[int, tuple[FlatLayout, int, list[Target]]] = {}
        for t in self.master.targets:
            by_id.setdefault(id(t.layout), (t.layout, t.group, []))[2].append(t)
        return list(by_id.values())

    # ---- helpers for subclasses ---------------------------------------------------------
    def _build_master(self, targets: list[Target]) -> MasterOptimizer:
        return MasterOptimizer(self._factory, targets, self.group_options)

    def _optimizer_chunk(self) -> int | None:
        """Chunk size for :func:`split_target`: cache-sized on CPU, whole tensors elsewhere."""
        return CPU_OPTIMIZER_CHUNK if self.device.type == "cpu" else None

    def _check_consistency(self, description: dict) -> None:
        """Start-up check: every rank must describe the same model and the same flat layout.

        Gathers each rank's description (names, shapes, dtypes, buckets, stage, world) and
        compares it with rank 0's on every rank, so that all ranks raise the same clear error
        instead of hanging in a mismatched collective or silently mixing gradients.
        """
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, description, group=self.group)
        for r, other in enumerate(gathered):
            diff = describe_difference(gathered[0], other)
            if diff:
                raise RuntimeError(
                    f"ranks disagree on the model or its layout (rank 0 vs rank {r}): {diff}. Every "
                    "rank must build the same model (same parameter names, shapes, dtypes, "
                    "requires_grad) with the same engine options before parallelize()"
                )

    def _start_clock(self) -> None:
        """Align trace time zero across ranks (call right after a collective such as the check)."""
        self.recorder.t0 = self.recorder.clock()
        self._last_step_end = None

    @torch.no_grad()
    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """DDP's start: every replica begins with rank 0's values."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in tensors:
            dist.broadcast(t, src=src, group=self.group)

    def _backward_started(self) -> None:
        """Call from gradient hooks: arms ``_on_backward_end`` once per backward pass."""
        if not self._backward_armed:
            self._backward_armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _token_factor(self) -> float | None:
        """Seed §2.2: factor to pre-multiply local gradients with before a mean reduction, so that
        the mean over ranks becomes Σ_r n_r g_r / Σ_r n_r. None when averaging plainly."""
        if not self.config.average_by_tokens:
            return None
        if self._token_factor_value is None:
            if self._tokens <= 0:
                raise RuntimeError(
                    "average_by_tokens=True but this rank counted no tokens this step: call "
                    "engine.count_tokens(n) for every micro-batch before its backward"
                )
            total = self.comm.all_reduce_sum(torch.tensor([self._tokens], dtype=torch.float64,
                                                          device=self.device), "token_count")
            self._token_factor_value = self._tokens * self.world_size / float(total[0])
        return self._token_factor_value

    # ---- internal machinery ---------------------------------------------------------------
    def _on_output_grad(self, grad):
        if self._backward_event is None:
            self._backward_event = self.recorder.begin("backward", COMPUTE)
        return None

    def _backward_end(self) -> None:
        self._backward_armed = False
        if self._backward_event is not None:
            self.recorder.end(self._backward_event)
            self._backward_event = None
        self._on_backward_end()

    def _optimizer_step(self) -> None:
        """Attach fp32 gradients to the master targets, step the stock optimizer, detach, then
        ``_publish_params``. Override to interleave them (ZeRO: bucket by bucket, seed §9.1)."""
        targets = self.master.targets
        for target, grad in zip(targets, self._master_grads()):
            target.tensor.grad = None if grad is None else _as_fp32(grad)
        self.master.step()
        for target in targets:
            target.tensor.grad = None
        self._publish_params()

    def _owned_range(self, target: Target) -> tuple[int, int]:
        """Flat range of ``target.layout`` whose state this rank saves (default: all it holds)."""
        return target.flat_start, target.flat_start + target.tensor.numel()

    def _layout_extra(self, index: int, target: Target) -> dict:
        return {}

    # ---- defaults for optional hooks ----------------------------------------------------------
    def _before_forward(self) -> None:
        self._wait_params()

    def _after_forward(self, out: Any) -> None:
        pass

    def _on_backward_end(self) -> None:
        pass

    def _wait_params(self) -> None:
        pass

    # ---- required from subclasses ---------------------------------------------------------------
    def _finish_grad_sync(self) -> None:
        raise NotImplementedError

    def _master_grads(self) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def _publish_params(self) -> None:
        raise NotImplementedError

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def _memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        raise NotImplementedError


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    return None
