"""Deferred initialization (guide §9.3): a model built on the meta device, materialized by the engine.

- the values do not depend on the world size or the stage: world 2 stage 3 equals world 3 stage 1
  and world 1 stage 0, bitwise (seeded per module, not per rank);
- the reference is independent of the engine: a plain model on the CPU whose modules run their own
  ``reset_parameters()`` (or the given ``init_fn``) under the seed the engine documents, module by
  module — built without zerodp;
- a meta model trains (one step changes the loss as the same step on the plain reference does);
- misuse: a partly-meta model, and a module with parameters but no way to initialize them, end
  with one line each.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from _engine_common import spawn_once, sum_tolerance, token_batch
from zerodp.engine.deferred import module_seed
from zerodp.spawn import RankFailure
from zerodp.train.model import GPT, PRESETS

pytestmark = pytest.mark.dist
NANO = dataclasses.replace(PRESETS["nano"], bias=False)


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(NANO)


def _reference(init_fn=None, seed: int = 0) -> GPT:
    """The documented rule, applied by hand on a plain CPU model: every module that owns
    parameters, in registration order, under manual_seed(module_seed(seed, name)): its
    reset_parameters(), then init_fn."""
    model = GPT(NANO)
    for name, m in model.named_modules():
        if not any(p is not None for p in m._parameters.values()):
            continue
        torch.manual_seed(module_seed(seed, name))
        with torch.no_grad():
            m.reset_parameters()
            if init_fn is not None:
                init_fn(m)
    return model


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2)


def _init_and_step(rank, world, stage, init_fn_name):
    init_fn = GPT._init if init_fn_name == "gpt" else None
    eng = zerodp.parallelize(_meta_gpt(), _adamw, stage=stage, init_fn=init_fn)
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    x, y = token_batch(0, 2 * world)
    xs, ys = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
    loss = F.cross_entropy(eng(xs).flatten(0, 1).float(), ys.flatten())
    loss.backward()
    eng.step()
    after = eng.full_state_dict()
    return {"before": before, "after": {k: v.clone() for k, v in after.items()}} if rank == 0 else None


def _both_inits(rank, world, stage):
    """Both initializers in one spawned group (a spawn costs seconds)."""
    return {init: _init_and_step(rank, world, stage, init) for init in ("reset", "gpt")}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world, stage in ((2, 3), (3, 1), (1, 0)):
        for init, r in spawn_once(_both_inits, world, stage)[0].items():
            out[(world, stage, init)] = r
    return out


@pytest.mark.parametrize("init", ["reset", "gpt"])
def test_meta_init_is_the_same_at_every_world_size_and_stage(runs, init):
    a, b, c = runs[(2, 3, init)]["before"], runs[(3, 1, init)]["before"], runs[(1, 0, init)]["before"]
    assert set(a) == set(b) == set(c)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: world 2 stage 3 vs world 3 stage 1 differ"
        assert torch.equal(a[name], c[name]), f"{name}: world 2 stage 3 vs world 1 stage 0 differ"


@pytest.mark.parametrize("init", ["reset", "gpt"])
def test_meta_init_follows_the_documented_seed_rule(runs, init):
    ref = _reference(GPT._init if init == "gpt" else None)
    got = runs[(1, 0, init)]["before"]
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p.float()), f"{name}: not what the module's initializer draws"
    if init == "gpt":  # GPT's own init: N(0, 0.02) embeddings, not nn.Embedding's N(0, 1)
        assert abs(got["tok_emb.weight"].std().item() - 0.02) < 0.002


def test_a_meta_model_trains_like_the_plain_model(runs):
    """One AdamW step from the materialized weights equals one step of the plain reference
    (full batch, single process), element by element within what fp32 allows.

    The gradients differ by the order of a sum of B·T = 256 token terms: at most
    2·256·ε of the largest gradient (``sum_tolerance``). Adam's first step moves an element by
    lr·g/(|g| + 1e-8): where |g| is above that noise the two updates agree to the rounding of the
    parameter, 4ε·(|θ| + lr); where the gradient is noise its sign can differ, by at most 2·lr."""
    lr = 1e-2
    ref = _reference()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    x, y = token_batch(0, 4)
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt.step()
    got = runs[(2, 3, "reset")]["after"]
    eps = torch.finfo(torch.float32).eps
    noise = sum_tolerance(x.numel()) * max(float(g.abs().max()) for g in grads.values())
    for name, p in ref.named_parameters():
        p = p.detach()
        allowed = torch.where(grads[name].abs() > noise, 4 * eps * (p.abs() + lr), torch.full_like(p, 2 * lr))
        err = (got[name] - p).abs()
        assert bool((err <= allowed).all()), f"{name}: off by {float((err - allowed).max()):.3e} over its bound"


def _misuse(rank, world, case):
    if case == "partial":
        model = GPT(NANO)
        with torch.device("meta"):
            model.head = nn.Linear(NANO.d_model, NANO.vocab_size, bias=False)
    else:
        class Scale(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(4))

            def forward(self, x):
                return x * self.w

        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), Scale())
    try:
        zerodp.parallelize(model, _adamw, stage=3)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,words", [("partial", "some of the model's parameters are on the meta device"),
                                        ("no_reset", "no reset_parameters() to initialize")])
def test_meta_misuse_ends_with_one_line(case, words):
    try:
        msg = spawn_once(_misuse, 1, case)[0]
    except RankFailure as e:  # pragma: no cover - shows the traceback if the engine raised otherwise
        raise AssertionError(str(e)) from None
    assert msg is not None and words in msg and "\n" not in msg


def _batched_step(rank, world, batch_bytes):
    import zerodp.engine.master as step_machine

    step_machine.STEP_BATCH_BYTES = batch_bytes
    torch.manual_seed(0)
    eng = zerodp.parallelize(GPT(NANO), _adamw, stage=3, mixed_precision="bf16")
    for step in range(2):
        x, y = token_batch(step, 2 * world)
        loss = F.cross_entropy(eng(x[2 * rank:2 * rank + 2]).flatten(0, 1).float(), y[2 * rank:2 * rank + 2].flatten())
        loss.backward()
        eng.step()
        eng.zero_grad()
    opt = eng.optimizer_state_dict()
    return {**eng.full_state_dict(), **{f"{n}/{k}": v for n, st in opt["state"].items() for k, v in st.items()}}


def test_the_optimizer_step_over_batches_of_targets_is_bitwise_one_step():
    """bf16 gradients are cast to fp32 for the optimizer a batch of targets at a time (so 4Ψ/N of
    fp32 gradients never coexist): with batches of 4 KiB the result is bitwise that of one step."""
    one = spawn_once(_batched_step, 2, 1 << 40)[0]
    many = spawn_once(_batched_step, 2, 4096)[0]
    assert set(one) == set(many)
    for k in one:
        assert torch.equal(one[k], many[k]), k
