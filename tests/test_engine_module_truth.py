"""The module is the truth: what a script does to the wrapped module itself, at every stage (guide §12.9).

Real scripts and libraries touch the module, not only the engine: torch's clip over
``model.parameters()``, ``model.zero_grad()``, ``p.grad = None``, in-place writes, ``model.apply``,
``model.load_state_dict``, ``p.data = t``, an fp64 or a pure-bf16 model, structured outputs, sparse
embeddings, ``copy.deepcopy``, ``del engine``, an optimizer built after the wrap, ``raw_model =
model.module`` and its ``state_dict()``. Each check below is one such habit, named after it; each
runs at stages 0-3 on 2 gloo ranks (one spawned group runs them all) against a single-process
reference — the same model and stock optimizer on the full batch, put through the same calls.
Tolerances: a gradient sums ``WORLD × ROWS`` rows in another order than the reference, so after k
steps parameters may differ by ``trajectory_tolerance`` of the largest reference value (in the
dtype the model trains in); bf16 compute against an fp32 reference by a few bf16 ε.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from _engine_common import Residual, regression_batch, run_checks, shard, spawn_once, trajectory_tolerance

pytestmark = pytest.mark.dist
WORLD = 2
ROWS = 3
STAGES = (0, 1, 2, 3)
STEPS = 3


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    hidden: torch.Tensor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(7, 7)

    def forward(self, h):
        return Output(loss=torch.zeros(()), hidden=h + torch.tanh(self.fc(h)))


class Structured(nn.Module):
    """Units and the model return plain dataclasses (stage 3 must walk them to find the outputs)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(7, 3)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h).hidden
        return Output(loss=F.mse_loss(self.out(h), y), hidden=h)


class SparseBag(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(11, 5, sparse=True)
        self.out = nn.Linear(5, 3)

    def forward(self, i, y):
        return F.mse_loss(self.out(self.emb(i).mean(1)), y)


def batch(step: int, dtype=torch.float32):
    return regression_batch(700 + step, WORLD * ROWS, dtype)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return shard(t, rank, ROWS)


def compare(got: dict, ref: nn.Module, steps: int, dtype: torch.dtype = torch.float32) -> str | None:
    """None when every parameter in ``got`` (full tensors by name) equals the reference's within the
    trajectory bound of ``dtype``, and has the reference's dtype; else the worst."""
    tol = trajectory_tolerance(WORLD * ROWS, max(steps, 1), dtype)
    for name, p in ref.named_parameters():
        if got[name].dtype != p.dtype:
            return f"{name}: dtype {got[name].dtype}, the reference's {p.dtype}"
        scale = p.detach().abs().max().item()
        err = (got[name].double() - p.detach().double()).abs().max().item()
        if err > tol * max(scale, 1e-30):
            return f"{name} differs by {err:.3g} (bound {tol * scale:.3g})"
    return None


def one_line(e: BaseException, *words: str) -> str | None:
    text = str(e)
    if "\n" in text or not all(w in text for w in words):
        return f"unclear message: {text}"
    return None


def train(model, engine, ref, rank, steps=STEPS, lr=0.1, between=None, dtype=torch.float32, opt=None,
          zero_grad=True):
    """``steps`` steps of the engine and of the reference (SGD with momentum, unless ``opt`` is a
    stock optimizer over the reference), calling ``between(step, target)`` on both after each;
    ``zero_grad=False``: neither optimizer's zero_grad is called (``between`` does what it does)."""
    ref_opt = opt or torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, dtype)
        ref(x, y).backward()
        ref_opt.step()
        if zero_grad:
            ref_opt.zero_grad()
        engine(mine(x, rank), mine(y, rank)).backward()
        engine.step()
        if zero_grad:
            engine.zero_grad()
        if between is not None:
            between(step, ref)
            between(step, model)


def sgd(groups):
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


# ---- the rows: each returns None (as the reference) or what differed --------------------------------
def torch_clip_grad_norm_on_module_parameters(rank, stage, **options):
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` right after backward, no engine call
    first: the norm is the averaged gradient's and the clip applies (before: .grad None at stages 2-3,
    norm 0.0, nothing clipped)."""
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage, **options)
    ref_opt = sgd(ref.parameters())
    dtype = torch.bfloat16 if options.get("reduce_dtype") == "bf16" else torch.float32
    for step in range(STEPS):
        x, y = batch(step)
        ref(x, y).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        engine(mine(x, rank), mine(y, rank)).backward()
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if abs(got.item() - want.item()) > trajectory_tolerance(WORLD * ROWS, 1, dtype) * want.item():
            return f"step {step}: torch's clip on model.parameters() read norm {got.item():.6g}, the reference's " \
                   f"{want.item():.6g}"
        engine.step()
        engine.zero_grad()
    return compare(engine.full_state_dict(), ref, STEPS, dtype)


def torch_clip_on_module_with_bf16_reduction(rank, stage):
    """The same with gradients reduced in bf16 (stage 1 keeps a shard apart from local sums, which
    torch's clip read before: norm 23.2 vs 14.5)."""
    return torch_clip_grad_norm_on_module_parameters(rank, stage, reduce_dtype="bf16")


def model_zero_grad_and_grad_none(rank, stage):
    """``model.zero_grad()`` (and ``p.grad = None``) instead of the engine's zero_grad: gradients do not
    pile up across steps (before: 0.29 off after 4 SGD steps at stages 2-3)."""
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)

    def zero(step, m):
        if step % 2:
            m.zero_grad()
        else:
            for p in m.parameters():
                p.grad = None
    train(model, engine, ref, rank, steps=4, between=zero, zero_grad=False)
    return compare(engine.full_state_dict(), ref, 4)


def model_zero_grad_keeps_zeros(rank, stage):
    """``model.zero_grad(set_to_none=False)``: zeros the optimizer still applies (momentum)."""
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    ref_opt = sgd(ref.parameters())

    def zeros_then_step(step, m):  # a step on zero gradients: momentum alone moves the parameters
        m.zero_grad(set_to_none=False)
        (ref_opt if m is ref else engine).step()
    train(model, engine, ref, rank, steps=3, between=zeros_then_step, opt=ref_opt, zero_grad=False)
    return compare(engine.full_state_dict(), ref, 3)


def _write_check(rank, stage, write):
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    try:
        train(model, engine, ref, rank, between=lambda step, m: write(m) if step == 1 else None)
    except RuntimeError as e:
        if stage == 3:  # refused in one line: by torch at the write (a parameter at rest keeps its
            # shape over one element), or by the engine at the next forward, naming the way to do it
            return None if "single memory location" in str(e) else one_line(e, "engine.gathered(writeback=True)")
        raise
    if stage == 3 and write is not load_half:
        return "stage 3: the write was neither refused nor honoured"
    return compare(engine.full_state_dict(), ref, STEPS)


def _bf16_write_check(rank, stage, write, want):
    """bf16 compute with an fp32 master: right after ``write`` the master holds ``want(before)`` —
    what the write means for the values held before it — within bf16's rounding of each element
    (the write went through bf16 parameters): |got − want| ≤ 2⁻⁸·|want|."""
    model = Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage, mixed_precision="bf16")
    for step in range(2):
        x, y = batch(step)
        engine(mine(x, rank), mine(y, rank)).backward()
        engine.step()
        engine.zero_grad()
    before = engine.full_state_dict()
    if stage == 3 and write is not load_half:
        with engine.gathered(writeback=True):
            write(model)
    else:
        write(model)
    after = engine.full_state_dict()
    for name, value in want(before).items():
        err = (after[name] - value).abs() - 2 ** -8 * value.abs()
        if err.max().item() > 1e-12:
            return f"{name}: the master is {(after[name] - value).abs().max().item():.3g} from the written values"
    return None


@torch.no_grad()
def halve(m):
    m.inp.weight.mul_(0.5)


def init_constant(m):
    m.apply(lambda sub: nn.init.constant_(sub.weight, 0.01) if isinstance(sub, nn.Linear) else None)


def load_half(m):
    m.load_state_dict({k: v * 0.5 for k, v in Residual().state_dict().items()})


def in_place_write_between_steps(rank, stage):
    """``with torch.no_grad(): p.mul_(0.5)`` between steps: honoured (stages 0-2), refused in one line
    naming engine.gathered(writeback=True) (stage 3; before: lost, 0.18 off)."""
    return _write_check(rank, stage, halve)


def model_apply_between_steps(rank, stage):
    """``model.apply(init_fn)`` between steps (before at stage 3: lost, 1.16 off)."""
    return _write_check(rank, stage, init_constant)


def model_load_state_dict_between_steps(rank, stage):
    """``model.load_state_dict(sd)`` between steps: honoured at every stage."""
    return _write_check(rank, stage, load_half)


def writes_under_bf16_are_kept(rank, stage):
    """bf16 mixed precision: an in-place write reaches the fp32 master (before: overwritten from the
    master at the next step at stages 0-2; at stage 3 through engine.gathered(writeback=True))."""
    return _bf16_write_check(rank, stage, halve, lambda before: {"inp.weight": before["inp.weight"] * 0.5})


def load_state_dict_under_bf16_is_kept(rank, stage):
    """bf16 mixed precision: ``model.load_state_dict`` reaches the fp32 master at every stage."""
    fresh = Residual().state_dict()
    return _bf16_write_check(rank, stage, load_half, lambda before: {k: v * 0.5 for k, v in fresh.items()})


def writes_inside_gathered_writeback(rank, stage):
    """``with engine.gathered(writeback=True):`` then write: honoured at every stage."""
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)

    def between(step, m):
        if step != 1:
            return
        if m is ref:
            halve(m)
        else:
            with engine.gathered(writeback=True):
                halve(m)
    train(model, engine, ref, rank, between=between)
    return compare(engine.full_state_dict(), ref, STEPS)


def rebinding_p_data(rank, stage):
    """``p.data = new_tensor`` between steps: the engine takes the value (before: the parameter
    detached from the engine silently, at every stage)."""
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)

    def between(step, m):
        if step == 1:
            m.out.weight.data = torch.full((3, 7), 0.02)
    train(model, engine, ref, rank, between=between)
    if model.out.weight.numel() and model.out.weight.data_ptr() == 0:
        return "the rebound parameter is not viewing the engine's storage"
    return compare(engine.full_state_dict(), ref, STEPS)


def fp64_model_trains_in_fp64(rank, stage):
    """``model.double()``: master, state dict and the update in fp64 (before: an fp32 master,
    starting weights rounded, a float32 state dict), equal to torch's fp64 run."""
    model, ref = Residual().double(), Residual().double()
    engine = zerodp.parallelize(model, lambda g: torch.optim.AdamW(g, lr=1e-2), stage=stage)
    train(model, engine, ref, rank, dtype=torch.float64, opt=torch.optim.AdamW(ref.parameters(), lr=1e-2))
    return compare(engine.state_dict(), ref, STEPS, torch.float64)


def pure_bf16_model_steps_as_torch(rank, stage):
    """A model cast wholly to bf16, no mixed precision: it steps in bf16 as torch's optimizer does
    (before: an undocumented fp32 master, +4 B/param, and another result); ``master_dtype="fp32"``
    asks for the fp32 master."""
    model, ref = Residual().bfloat16(), Residual().bfloat16()
    engine = zerodp.parallelize(model, lambda g: torch.optim.SGD(g, lr=0.1), stage=stage)
    train(model, engine, ref, rank, dtype=torch.bfloat16, opt=torch.optim.SGD(ref.parameters(), lr=0.1))
    if engine.dtypes.master != torch.bfloat16:
        return f"master dtype {engine.dtypes.master}"
    problem = compare(engine.state_dict(), ref, STEPS, torch.bfloat16)
    if problem:
        return problem
    kept = zerodp.parallelize(Residual().bfloat16(), lambda g: torch.optim.SGD(g, lr=0.1), stage=stage,
                              master_dtype="fp32")
    return None if kept.dtypes.master == torch.float32 else f"master_dtype='fp32' gave {kept.dtypes.master}"


def dataclass_outputs(rank, stage):
    """Units and the model return a plain ``@dataclass`` (before at stage 3: backward crashed on a
    freed unit, `setStorage ... storage of size 0`)."""
    model, ref = Structured(), Structured()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    ref_opt = sgd(ref.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        ref(x, y).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine(mine(x, rank), mine(y, rank)).loss.backward()
        engine.step()
        engine.zero_grad()
    return compare(engine.full_state_dict(), ref, STEPS)


def sparse_embedding(rank, stage):
    """``nn.Embedding(sparse=True)`` with SGD: stage 0 trains it as DDP does; stages 1-3 refuse at
    parallelize in one line naming the module (before: a crash at the first backward)."""
    model, ref = SparseBag(), SparseBag()
    try:
        engine = zerodp.parallelize(model, lambda g: torch.optim.SGD(g, lr=0.1), stage=stage)
    except ValueError as e:
        return one_line(e, "emb", "sparse=True") if stage > 0 else f"stage 0 refused: {e}"
    if stage > 0:
        return "accepted a sparse embedding it cannot shard"
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        i, y = torch.randint(0, 11, (WORLD * ROWS, 4), generator=g), torch.randn(WORLD * ROWS, 3, generator=g)
        ref(i, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine(mine(i, rank), mine(y, rank)).backward()
        engine.step()
        engine.zero_grad()
    return compare(engine.full_state_dict(), ref, STEPS)


def deepcopy_and_averaged_model(rank, stage):
    """``copy.deepcopy(model)`` / ``AveragedModel(model)`` (EMA): at stages 0-2 the copy holds the
    values; at stage 3 refused at the copy, in one line naming engine.state_dict() (before: a copy
    of empty parameters, an EMA averaging nothing)."""
    model = Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    try:
        ema = torch.optim.swa_utils.AveragedModel(model)
    except RuntimeError as e:
        return one_line(e, "engine.state_dict()") if stage == 3 else f"refused: {e}"
    if stage == 3:
        return "the stage-3 module was copied"
    full = engine.full_state_dict()
    return compare({k.removeprefix("module."): v for k, v in ema.state_dict().items()}, _as_module(full), 0)


def _as_module(values: dict) -> nn.Module:
    m = Residual()
    m.load_state_dict(values)
    return m


def del_engine_frees_it(rank, stage):
    """``del engine`` while the script keeps ``model``: the engine and its buffers are freed (before
    at stage 3: the module's hooks held it)."""
    model = Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    x, y = batch(0)
    engine(mine(x, rank), mine(y, rank)).backward()
    engine.step()
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    return None if ref() is None else "the engine is still alive after del and gc.collect()"


def optimizer_built_after_the_wrap(rank, stage):
    """pytorch/examples' order: wrap, then ``torch.optim.X(model.parameters())``, its LR scheduler,
    ``optimizer.zero_grad()`` and ``optimizer.state_dict()``: adopted, it trains as the reference
    (before at stages 2-3: it stepped nothing, silently)."""
    model, ref = Residual(), Residual()
    model = zerodp.parallelize(model, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(step)
        ref(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        model(mine(x, rank), mine(y, rank)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
    problem = compare(model.full_state_dict(), ref, STEPS)
    if problem:
        return problem
    got, want = opt.state_dict(), ref_opt.state_dict()
    if got["param_groups"][0]["lr"] != want["param_groups"][0]["lr"]:
        return f"state_dict lr {got['param_groups'][0]['lr']} vs {want['param_groups'][0]['lr']}"
    for i, s in want["state"].items():
        err = (got["state"][i]["exp_avg"] - s["exp_avg"]).abs().max().item()
        if err > trajectory_tolerance(WORLD * ROWS, STEPS) * s["exp_avg"].abs().max().item():
            return f"exp_avg of parameter {i} differs by {err:.3g}"
    return None


def second_optimizer_after_the_wrap_is_refused(rank, stage):
    """An engine given an optimizer, and another built over model.parameters(): refused at its step."""
    model = Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0)
    engine(mine(x, rank), mine(y, rank)).backward()
    try:
        other.step()
    except RuntimeError as e:
        return one_line(e, "engine.optimizer")
    return "the second optimizer stepped silently"


def raw_model_state_dict(rank, stage):
    """``raw_model = model.module; raw_model.state_dict()`` on every rank (nanoGPT's checkpoint) holds
    the full values and loads back into a fresh model and into the engine (before at stage 3: 29
    tensors of shape (0,), saved without a word)."""
    model, ref = Residual(), Residual()
    engine = zerodp.parallelize(model, sgd, stage=stage)
    train(model, engine, ref, rank)
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    problem = compare(saved, ref, STEPS)
    if problem:
        return problem
    fresh = Residual(seed=1)
    fresh.load_state_dict(saved)
    model.load_state_dict({k: torch.zeros_like(v) for k, v in saved.items()})
    model.load_state_dict(saved)
    return compare(engine.full_state_dict(), fresh, 0)


CHECKS = [torch_clip_grad_norm_on_module_parameters, torch_clip_on_module_with_bf16_reduction,
          model_zero_grad_and_grad_none, model_zero_grad_keeps_zeros, in_place_write_between_steps,
          model_apply_between_steps, model_load_state_dict_between_steps, writes_under_bf16_are_kept,
          load_state_dict_under_bf16_is_kept, writes_inside_gathered_writeback, rebinding_p_data,
          fp64_model_trains_in_fp64, pure_bf16_model_steps_as_torch, dataclass_outputs, sparse_embedding,
          deepcopy_and_averaged_model, del_engine_frees_it, optimizer_built_after_the_wrap,
          second_optimizer_after_the_wrap_is_refused, raw_model_state_dict]


def _all_checks(rank, world):
    return run_checks(rank, CHECKS, STAGES)


@pytest.mark.parametrize("check,stage", [(c.__name__, s) for c in CHECKS for s in STAGES])
def test_module_habit(check, stage):
    for rank, r in enumerate(spawn_once(_all_checks, WORLD, timeout=400)):
        assert r[(check, stage)] is None, f"rank {rank}, stage {stage}, {check}: {r[(check, stage)]}"
