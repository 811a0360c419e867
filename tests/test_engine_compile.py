"""torch.compile and the engine (docs/engine.md, "torch.compile").

One spawned group of 2 gloo ranks trains the same small model, 3 AdamW steps, eagerly and in the
three compiled forms: ``torch.compile(model)`` before ``parallelize``, ``model.compile()`` in
place before it, and ``torch.compile(engine)``, and per unit (each unit's ``forward`` compiled),
at stages 0 and 3 (``make fuzz`` sets ``ZERODP_COMPILE_ALL=1``: every stage 0-3, on 2 and on 3
ranks). Backend ``aot_eager`` (dynamo's capture and AOT
autograd's joint graph, without inductor's C++ code generation: on 2 shared cores the first
compiled stage-3 step took 23 s with aot_eager and 92 s with inductor).

Checked: each compiled run's parameters, and the eager engine's, equal the single-process
reference — the same model and stock AdamW on the full batch, in the rank's own process — within
``trajectory_tolerance`` of the gradient sums (eps = 1e-3 keeps AdamW's division from amplifying a
rounding difference of a gradient near zero); each compiled run also equals the eager engine
within that bound (they run the same kernels, so in practice bitwise); the graph breaks
dynamo records in a compiled stage-3 training step are all at the engine's ``host_only`` hooks
(none inside a unit's forward) and at most ``MAX_STAGE3_BREAKS`` (the number docs/engine.md
gives); a compiled run's ``state_dict()`` and ``optimizer.state_dict()`` carry the model's own
names (no ``_orig_mod.``) and load into an eager engine, and an eager engine's into a compiled one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _engine_common import max_rel, shard, spawn_once, trajectory_tolerance

pytestmark = pytest.mark.dist
STEPS = 3
ROWS = 3  # rows per rank
BACKEND = "aot_eager"
WAYS = ("torch.compile(model)", "model.compile()", "torch.compile(engine)", "unit.forward")
ALL = os.environ.get("ZERODP_COMPILE_ALL") == "1"
STAGES = (0, 1, 2, 3) if ALL else (0, 3)
WORLDS = (2, 3) if ALL else (2,)
ADAM_EPS = 1e-3


def n_terms(world: int) -> int:
    return world * ROWS * 4  # terms summed into one gradient element (rows x outputs)
#: Graph breaks dynamo records in the first compiled training step at stage 3 of the 3-unit model
#: below, per form (docs/engine.md): all are skips of the engine's host_only unit hooks (6 at a
#: unit's pre-forward, 3 at a post-forward, as dynamo resumes after each — one of each more since
#: the inner modules carry the first forward's shared-module check); torch.compile(engine) adds
#: its forward entry's. Compiling each unit's forward (docs/engine.md's advice,
#: ``unit.forward = torch.compile(unit.forward)``) leaves the hooks outside every graph: 0.
#: Measured 9, 9 (7, 7 before that check), at most 10, and 0 on torch 2.13.
MAX_STAGE3_BREAKS = {"torch.compile(model)": 9, "model.compile()": 9, "torch.compile(engine)": 10, "unit.forward": 0}


class Net(nn.Module):
    """Three units (stage 3: units=[inp, mid, out]) with a norm and a nonlinearity between."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.mid = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
        self.out = nn.Linear(16, 4)

    def forward(self, x, y):
        return F.mse_loss(self.out(self.mid(torch.tanh(self.inp(x)))), y)


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(world * ROWS, 6, generator=g), torch.randn(world * ROWS, 4, generator=g)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=ADAM_EPS)


def _reference(world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The single-process run: the same model, stock AdamW, every rank's rows in one batch (the
    mean of equal shards' mean losses is the full batch's mean loss)."""
    torch.manual_seed(0)
    net = Net()
    opt = _optimizer(net.parameters())
    for s in range(steps):
        net(*_batch(s, world)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _build(stage: int, way: str | None):
    import zerodp

    torch.manual_seed(0)
    net = Net()
    model = net
    if way == "torch.compile(model)":
        model = torch.compile(net, backend=BACKEND)
    elif way == "model.compile()":
        net.compile(backend=BACKEND)
    if way == "unit.forward":  # per unit (at stages 0-2 too: the same three modules)
        for u in (net.inp, net.mid, net.out):
            u.forward = torch.compile(u.forward, backend=BACKEND)
    units = [net.inp, net.mid, net.out] if stage == 3 else None
    engine = zerodp.parallelize(model, optimizer=_optimizer, stage=stage, units=units)
    call = torch.compile(engine, backend=BACKEND) if way == "torch.compile(engine)" else engine
    return engine, call


def _step(engine, call, rank: int, step: int) -> None:
    world = engine.world_size
    x, y = _batch(step, world)
    call(shard(x, rank, ROWS), shard(y, rank, ROWS)).backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad()


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.state_dict().items()}


def _breaks() -> dict[str, int]:
    import torch._dynamo.utils

    return dict(torch._dynamo.utils.counters["graph_break"])


def _all(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    import torch._dynamo

    out: dict = {}
    single = _reference(world)
    for stage in stages:
        torch._dynamo.reset()
        engine, call = _build(stage, None)
        for s in range(STEPS):
            _step(engine, call, rank, s)
        ref = _params(engine)
        out[stage, "eager"] = {"vs_single": max(max_rel(ref[k], single[k]) for k in single)}
        for way in WAYS:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            engine, call = _build(stage, way)
            _step(engine, call, rank, 0)
            breaks = _breaks()
            for s in range(1, STEPS):
                _step(engine, call, rank, s)
            got = _params(engine)
            out[stage, way] = {
                "names": sorted(got) == sorted(ref),
                "err": max(max_rel(got[k], ref[k]) for k in ref) if sorted(got) == sorted(ref) else float("inf"),
                "vs_single": max(max_rel(got[k], single[k]) for k in single) if sorted(got) == sorted(ref)
                else float("inf"),
                "breaks": breaks,
            }
            if way == "torch.compile(model)":  # names stored plain; compiled <-> eager resume
                out[stage, "resume"] = _resume(rank, stage, engine, call)
    return out


def _resume(rank: int, stage: int, compiled, compiled_call) -> dict:
    model_sd = compiled.state_dict()
    optim_sd = compiled.optimizer.state_dict()
    names = list(model_sd) + list(compiled.optimizer.index_names()) + list(
        compiled.optimizer_state_dict()["state"])
    eager, _ = _build(stage, None)
    eager.load_state_dict(model_sd)
    eager.optimizer.load_state_dict(optim_sd)
    _step(eager, eager, rank, STEPS)
    _step(compiled, compiled_call, rank, STEPS)  # both continue one step from the same state
    a, b = _params(eager), _params(compiled)
    after_eager = max(max_rel(a[k], b[k]) for k in b)
    back, back_call = _build(stage, "torch.compile(model)")  # and an eager run's state into a compiled one
    back.load_state_dict(eager.state_dict())
    back.optimizer.load_state_dict(eager.optimizer.state_dict())
    c = _params(back)
    return {"prefixed": sorted({n for n in names if "_orig_mod" in n or n.startswith("module.")}),
            "eager_from_compiled": after_eager,
            "compiled_from_eager": max(max_rel(c[k], a[k]) for k in a)}


def results(world: int = 2, stages: tuple[int, ...] = STAGES) -> dict:
    return spawn_once(_all, world, stages, timeout=900)[0]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("way", ("eager",) + WAYS)
def test_compiled_equals_eager_and_the_single_process_run(world, stage, way):
    r = results(world)[stage, way]
    tol = trajectory_tolerance(n_terms(world), STEPS)
    assert r["vs_single"] <= tol, (
        f"{way} at stage {stage} on {world} ranks: parameters {r['vs_single']:.3g} from the single-process "
        f"run's (bound {tol:.3g})")
    if way == "eager":
        return
    assert r["names"], f"{way} at stage {stage}: parameter names differ from the eager engine's"
    assert r["err"] <= tol, f"{way} at stage {stage}: parameters {r['err']:.3g} from eager's (bound {tol:.3g})"


@pytest.mark.parametrize("way", WAYS)
def test_stage3_graph_breaks_only_at_hooks_and_bounded(way):
    breaks = results()[3, way]["breaks"]
    total = sum(breaks.values())
    inside = {reason.splitlines()[0]: n for reason, n in breaks.items()
              if "zerodp.engine.compiled" not in reason}  # not a host_only hook's own skip
    assert not inside, f"{way}: graph breaks inside the engine's or the model's code: {inside}"
    assert total <= MAX_STAGE3_BREAKS[way], (
        f"{way}: {total} graph breaks in a compiled stage-3 step, docs/engine.md allows {MAX_STAGE3_BREAKS[way]}")


@pytest.mark.parametrize("stage", STAGES)
def test_compiled_names_plain_and_resume_both_ways(stage):
    r = results()[stage, "resume"]
    assert r["prefixed"] == [], f"stage {stage}: stored names carry wrapper prefixes: {r['prefixed'][:4]}"
    tol = trajectory_tolerance(n_terms(2), 1)
    assert r["eager_from_compiled"] <= tol, f"stage {stage}: eager resumed from a compiled run: {r}"
    assert r["compiled_from_eager"] == 0.0, f"stage {stage}: compiled loaded an eager run's state: {r}"
