"""Per-tensor optimizers on the tensor-ownership path (guide §12.3): Muon and Adafactor at stages 0-3.

Each rank owns whole tensors (an owner-aligned layout, ``FlatLayout.owned``) and steps them with
the stock ``torch.optim`` optimizer and their real shapes, so the run equals one process stepping
the stock optimizer on the full batch. References are independent of the code under test: the
same model and the stock optimizer on the full batch (every rank's rows) in the same process.
A gradient here sums ``world × ROWS`` rows in another order than the reference, so parameters
after k steps may differ by ``trajectory_tolerance`` of their largest element (relative,
dtype-derived); the optimizers' second moments are squares of gradients, twice that.

One spawned group per world size (2; ``make fuzz``: 1, 3 and 4 too) runs every check; the
later groups also load the checkpoint that the world-2 group saved at another stage.

The differential matrix (tests/_matrix.py) crosses the same optimizers with every stage, world
size, mesh, compression, usage and model feature; this file checks what it does not: the owner
layout itself, the padding, the refusals, the torch-format state against the stock optimizer's
trajectory, and checkpoints written by ``zerodp.train.checkpoint``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from _engine_common import LARS, regression_batch, shard, spawn_once, trajectory_tolerance
from _train_common import cpu_context
from zerodp.check.core import Stepped  # the single-process reference of a list of optimizers

pytestmark = pytest.mark.dist
ROWS = 3  # rows per rank per micro-batch
STEPS = 3
STAGES = (0, 1, 2, 3)
#: make test: 2 ranks (the differential matrix crosses these optimizers with world sizes 1-4 and
#: reshards their checkpoints across world sizes there); make fuzz: ZERODP_OPTIMIZER_WORLDS=2,1,3,4
#: (2 first: it saves the checkpoint the others load)
WORLDS = tuple(int(w) for w in os.environ.get("ZERODP_OPTIMIZER_WORLDS", "2").split(","))
BUCKETS = dict(bucket_mb=0.0004, first_bucket_mb=0.0001)  # several buckets, some with several tensors


class Net(nn.Module):
    """Odd sizes; ``bias=False`` leaves only 2-D weights (Muon's case), ``bias=True`` adds
    vectors (biases, a LayerNorm): Adafactor keeps ``variance`` for them, row/column factors for
    the matrices."""

    def __init__(self, seed: int = 0, bias: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, 7, bias=bias)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(7, 9, bias=bias), nn.Tanh(), nn.Linear(9, 7, bias=bias))
                                     for _ in range(2)])
        self.norm = nn.LayerNorm(7) if bias else nn.Identity()
        self.out = nn.Linear(7, 3, bias=bias)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = h + b(h)
        return F.mse_loss(self.out(self.norm(h)), y)


def muon(params):
    return torch.optim.Muon(params, lr=0.05, weight_decay=0.01)


def adafactor(params):
    return torch.optim.Adafactor(params, lr=0.02)


def lars(params):
    return LARS(params, lr=0.05, momentum=0.9)


def muon_adamw(model):
    """Muon for the matrices, AdamW for the rest (biases, LayerNorm), built by the script over
    ``model.parameters()``, as Muon is used: the engine takes the list and steps both."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.05, weight_decay=0.01),
            torch.optim.AdamW([{"params": rest[:2], "weight_decay": 0.0}, {"params": rest[2:]}], lr=0.02, eps=1e-3)]


#: name -> (factory, or a function of the model giving the built optimizers; bias in the model;
#: parallelize options)
OPTIMIZERS = {"muon": (muon, False, {}), "adafactor": (adafactor, True, {}),
              "lars": (lars, True, {"optimizer_layout": "owner"}),
              "muon_adamw": (muon_adamw, True, {})}
BUILT = {"muon_adamw"}  # built over the model by the script, not a factory of param groups


def batch(step: int, world: int):
    return regression_batch(700 + 31 * world + step, world * ROWS)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return shard(t, rank, ROWS)


def build(name: str, stage: int, seed: int = 0):
    factory, bias, options = OPTIMIZERS[name]
    model = Net(seed, bias)
    units = list(model.blocks) if stage == 3 else None
    optimizer = factory(model) if name in BUILT else factory
    return zerodp.parallelize(model, optimizer=optimizer, stage=stage, units=units, **BUCKETS, **options)


def train(engine, rank, world, steps, first=0):
    for step in range(first, first + steps):
        x, y = batch(step, world)
        engine(mine(x, rank), mine(y, rank)).backward()
        engine.step()
        engine.zero_grad()


def reference(name: str, plan: list[tuple[int, int]]):
    """The stock optimizer on the full batch: ``plan`` lists (step, world) of each batch."""
    factory, bias, _ = OPTIMIZERS[name]
    model = Net(0, bias)
    opt = Stepped(factory(model)) if name in BUILT else factory(model.parameters())
    for step, world in plan:
        model(*batch(step, world)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def param_error(full: dict, ref: nn.Module) -> float:
    """The worst parameter's max |engine − reference| over the reference's largest element."""
    return max((full[n] - p.detach()).abs().max().item() / max(p.detach().abs().max().item(), 1e-30)
               for n, p in ref.named_parameters())


def state_error(got: dict, want: dict) -> float | str:
    """Worst relative error between two torch-format optimizer states (index-keyed), or what differs."""
    if sorted(got["state"]) != sorted(want["state"]):
        return f"state for parameters {sorted(got['state'])}, the reference has {sorted(want['state'])}"
    worst = 0.0
    for i, entry in want["state"].items():
        mine_ = got["state"][i]
        if sorted(mine_) != sorted(entry):
            return f"parameter {i} has states {sorted(mine_)}, the reference {sorted(entry)}"
        for k, v in entry.items():
            if tuple(mine_[k].shape) != tuple(v.shape):
                return f"state[{i}][{k}] has shape {tuple(mine_[k].shape)}, the reference {tuple(v.shape)}"
            scale = max(v.double().abs().max().item(), 1e-30)
            worst = max(worst, (mine_[k].double().cpu() - v.double()).abs().max().item() / scale)
    return worst


def layout_problems(engine, rank, stage: int, name: str) -> str | None:
    """None when every tensor of the per-tensor optimizer lies whole in its owner's slice and
    this rank's master targets are exactly its owned tensors, with their shapes (stages 1-2; the
    tensors of AdamW beside Muon lie in flat buckets instead, cut evenly); at stage 3 when every
    unit is flat and each such tensor is stepped whole, as a proxy, by exactly its owner."""
    owned, flat = set(), set()
    if stage == 3:  # flat units with no padding but the even shard's; whole tensors on their owners
        for d in engine.layout():
            if d["placement"] != "flat" or d["padded_numel"] - d["numel"] >= d["world_size"]:
                return f"{d['label']}: placement {d['placement']}, padding {d['padded_numel'] - d['numel']}"
        whole = {n for n, p in engine.named_params if name != "muon_adamw" or p.dim() == 2}
        entries = engine.master.exchange.entries
        if {e.name for e in entries} != whole or len(entries) != len(whole):
            return f"exchanged {sorted(e.name for e in entries)}, the per-tensor optimizer's {sorted(whole)}"
        mine = {(e.name, tuple(e.shape)) for e in entries if e.owner == rank}
        proxies = {(t.name, tuple(t.tensor.shape)) for t in engine.master.proxies}
        return None if proxies == mine else f"proxies {sorted(proxies)} != owned {sorted(mine)}"
    for d in engine.layout():
        if not d["sharded"]:
            return f"{d['label']}: not sharded"
        if d["placement"] != "owner":
            if stage == 3 or name != "muon_adamw" or any(len(s["shape"]) == 2 for s in d["slots"]):
                return f"{d['label']}: placement {d['placement']}, slots {[s['name'] for s in d['slots']]}"
            flat.update(s["name"] for s in d["slots"])
            continue
        if name == "muon_adamw" and stage < 3 and any(len(s["shape"]) != 2 for s in d["slots"]):
            return f"{d['label']}: AdamW's tensors in an owner-aligned bucket"
        for s in d["slots"]:
            lo, hi = d["owners"][s["owner"]]
            numel = 1
            for n in s["shape"]:
                numel *= n
            if not lo <= s["offset"] <= s["offset"] + numel <= hi:
                return f"{s['name']} at {s['offset']} (+{numel}) outside its owner's slice [{lo}, {hi})"
            if s["owner"] == rank:
                owned.add((s["name"], tuple(s["shape"])))
    targets = {(t.name, tuple(t.tensor.shape)) for t in engine.master.targets if t.name not in flat}
    if any(t.tensor.dim() != 1 for t in engine.master.targets if t.name in flat):
        return "a target of a flat bucket is not a 1-D piece"
    return None if targets == owned else f"targets {sorted(targets)} != owned {sorted(owned)}"


def _trajectories(rank, world, out):
    names = ("muon", "adafactor", "muon_adamw") + (("lars",) if world == 2 else ())
    for name in names:
        for stage in STAGES:
            key = f"{name}/{stage}"
            engine = build(name, stage)
            train(engine, rank, world, STEPS)
            ref, ref_opt = reference(name, [(s, world) for s in range(STEPS)])
            out[f"{key}/param"] = (param_error(engine.full_state_dict(), ref),
                                   trajectory_tolerance(world * ROWS, STEPS))
            out[f"{key}/placement"] = engine.optimizer_plan.placement
            if stage > 0:
                out[f"{key}/layout"] = layout_problems(engine, rank, stage, name)
            out[f"{key}/cost"] = engine.stats().layout
            # torch's format, full tensors, index-keyed: equal to the stock optimizer's state
            saved = engine.optimizer.state_dict()
            out[f"{key}/state"] = (state_error(saved, ref_opt.state_dict()),
                                   2 * trajectory_tolerance(world * ROWS, STEPS))
            # ... and it loads into another stage's engine, which then continues as the reference
            # (every stage's state on 2 ranks; on 3, stages 1 and 3's, to keep the group short)
            if world == 3 and stage % 2 == 0:
                continue
            other = build(name, (stage + 1) % 4, seed=9)
            other.load_state_dict(engine.state_dict())
            other.optimizer.load_state_dict(saved)
            train(other, rank, world, 1, first=STEPS)
            ref2, _ = reference(name, [(s, world) for s in range(STEPS + 1)])
            out[f"{key}/reloaded"] = (param_error(other.full_state_dict(), ref2),
                                      trajectory_tolerance(world * ROWS, STEPS + 1))


def _padding_stays_zero(rank, world, out):
    """Padding between the slices receives no gradient: after steps whose gradient storages were
    recycled (the pool hands a unit the storage another unit's gradients used), the reduced
    gradient is still zero on every padding element of this rank's slice."""
    for stage in (1, 2, 3):
        engine = build("adafactor", stage)
        train(engine, rank, world, 2)
        x, y = batch(5, world)
        engine(mine(x, rank), mine(y, rank)).backward()
        engine.machine.finish_grad_sync()
        worst = 0.0
        for g in engine.groups:
            shard, (lo, hi) = g.grads.read(), g.shard_range
            for a, b in g.layout.padding_ranges():
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    worst = max(worst, shard[a - lo:b - lo].abs().max().item())
        out[f"padding/{stage}"] = worst


def _refusals(rank, world, out):
    for name, factory in (("LBFGS", lambda g: torch.optim.LBFGS(g)),
                          ("SparseAdam", lambda g: torch.optim.SparseAdam(g))):
        try:
            zerodp.parallelize(Net(), factory, stage=2)
            out[f"refuse/{name}"] = None
        except ValueError as e:
            out[f"refuse/{name}"] = str(e)
    try:  # Muon over a model with biases: torch refuses 1-D parameters; the message names one
        zerodp.parallelize(Net(bias=True), muon, stage=1)
        out["refuse/muon-1d"] = None
    except ValueError as e:
        out["refuse/muon-1d"] = str(e)
    net = Net(bias=True)  # a list whose optimizers share a parameter: torch would step it twice
    try:
        zerodp.parallelize(net, [torch.optim.Muon([p for p in net.parameters() if p.ndim == 2]),
                                 torch.optim.AdamW(net.parameters())], stage=1)
        out["refuse/twice"] = None
    except ValueError as e:
        out["refuse/twice"] = str(e)
    try:  # an unknown optimizer is not guessed at: it says what to declare
        zerodp.parallelize(Net(), lars, stage=1)
        out["refuse/lars"] = None
    except ValueError as e:
        out["refuse/lars"] = str(e)
    # an elementwise optimizer keeps the flat path; asked for, the owner path is exact for it too
    flat = zerodp.parallelize(Net(), lambda g: torch.optim.AdamW(g, lr=1e-2), stage=2, **BUCKETS)
    owner = zerodp.parallelize(Net(), lambda g: torch.optim.AdamW(g, lr=1e-2), stage=2, optimizer_layout="owner",
                               **BUCKETS)
    train(flat, rank, world, 2)
    train(owner, rank, world, 2)
    a, b = flat.full_state_dict(), owner.full_state_dict()
    out["adamw/placements"] = (flat.optimizer_plan.placement, owner.optimizer_plan.placement)
    out["adamw/owner_vs_flat"] = max((a[n] - b[n]).abs().max().item() / b[n].abs().max().item() for n in a)


def _checkpoint(rank, world, out, root):
    """World 2 saves Adafactor, and Muon + AdamW, at stage 2 (pieces, zerodp.train.checkpoint);
    world 3 loads each at stage 1 and world 2 at stage 3, and both continue as the reference."""
    from zerodp.train import checkpoint as ckpt
    from zerodp.train.loop import load_into

    for name in ("adafactor", "muon_adamw"):
        where = root / f"checkpoints-{name}"
        path = where / ckpt.step_dir_name(STEPS)
        if world == 2:
            src = build(name, 2)
            train(src, rank, world, STEPS)
            ckpt.save(src.checkpoint.state_pieces(), where, STEPS, {"scalars": src.checkpoint.scalar_state()})
        stage = 3 if world == 2 else 1
        dst = build(name, stage, seed=5)
        ck = ckpt.Checkpoint.open(path)
        out[f"ckpt/{name}/whole_pieces"] = sorted({p["name"] for p in ck.manifest["pieces"] if "::" in p["name"]})
        load_into(dst, ck, cpu_context(rank, world))
        ref, _ = reference(name, [(s, 2) for s in range(STEPS)])
        out[f"ckpt/{name}/loaded"] = (param_error(dst.full_state_dict(), ref), trajectory_tolerance(2 * ROWS, STEPS))
        train(dst, rank, world, 1, first=STEPS)
        ref, _ = reference(name, [(s, 2) for s in range(STEPS)] + [(STEPS, world)])
        out[f"ckpt/{name}/continued"] = (param_error(dst.full_state_dict(), ref),
                                         trajectory_tolerance(max(2, world) * ROWS, STEPS + 1))


def _all_checks(rank, world, root):
    torch.use_deterministic_algorithms(True)
    out: dict = {}
    _trajectories(rank, world, out)
    _padding_stays_zero(rank, world, out)
    if world == 2:
        _refusals(rank, world, out)
    _checkpoint(rank, world, out, root)
    return out


def _results(world: int, root) -> list[dict]:
    return spawn_once(_all_checks, world, root, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizers")
    return {world: _results(world, root) for world in WORLDS}


CASES = [(w, n, s) for w in WORLDS for n in ("muon", "adafactor", "muon_adamw", "lars") for s in STAGES
         if not (n == "lars" and w != 2)]


@pytest.mark.parametrize("world,name,stage", CASES)
def test_per_tensor_optimizer_equals_the_stock_one(results, world, name, stage):
    for rank, r in enumerate(results[world]):
        key = f"{name}/{stage}"
        assert r[f"{key}/placement"] == "owner"
        err, tol = r[f"{key}/param"]
        assert err <= tol, f"rank {rank}: parameters differ by {err:.3g} (bound {tol:.3g})"
        if stage > 0:
            assert r[f"{key}/layout"] is None, r[f"{key}/layout"]
        err, tol = r[f"{key}/state"]
        assert not isinstance(err, str), err
        assert err <= tol, f"rank {rank}: optimizer state differs by {err:.3g} (bound {tol:.3g})"
        if f"{key}/reloaded" not in r:
            continue
        err, tol = r[f"{key}/reloaded"]
        assert err <= tol, f"rank {rank}: after a reload at stage {(stage + 1) % 4}, {err:.3g} (bound {tol:.3g})"


@pytest.mark.parametrize("world", WORLDS)
def test_the_padding_is_priced(results, world):
    for r in results[world]:
        for stage in (1, 2, 3):
            cost = r[f"adafactor/{stage}/cost"]
            assert cost["placement"] == "owner" and len(cost["owned_numel"]) == world
            assert cost["padding"] >= 0 and cost["padding_bytes"] == 4 * cost["padding"]
            assert cost["max_owned_numel"] == max(cost["owned_numel"])
            mean = sum(cost["owned_numel"]) / world
            assert cost["imbalance_bytes"] == pytest.approx(4 * (cost["max_owned_numel"] - mean), abs=1e-3)


@pytest.mark.parametrize("world", WORLDS)
def test_no_gradient_lands_in_the_padding_between_slices(results, world):
    for r in results[world]:
        assert [r[f"padding/{stage}"] for stage in (1, 2, 3)] == [0.0, 0.0, 0.0]


def test_refusals_are_one_line(results):
    r = results[2][0]
    assert "LBFGS is refused" in r["refuse/LBFGS"] and "closure" in r["refuse/LBFGS"]
    assert "\n" not in r["refuse/LBFGS"]
    assert "SparseAdam is refused" in r["refuse/SparseAdam"]
    msg = r["refuse/muon-1d"]
    assert msg and "inp.bias" in msg and "2D" in msg, msg
    msg = r["refuse/twice"]
    assert msg and "two of the given optimizers" in msg and "\n" not in msg, msg
    msg = r["refuse/lars"]
    assert msg and "optimizer_layout='owner'" in msg and "elementwise_optimizer=True" in msg, msg


def test_elementwise_optimizer_keeps_the_flat_path(results):
    r = results[2][0]
    assert r["adamw/placements"] == ("flat", "owner")
    assert r["adamw/owner_vs_flat"] <= trajectory_tolerance(2 * ROWS, 2)


@pytest.mark.parametrize("name", ["adafactor", "muon_adamw"])
def test_checkpoint_loads_at_another_world_and_stage(results, name):
    for world in WORLDS:
        for rank, r in enumerate(results[world]):
            if name == "adafactor":  # states shaped unlike their parameter are saved whole
                assert "out.weight::row_var" in r[f"ckpt/{name}/whole_pieces"]
            for what in ("loaded", "continued"):
                err, tol = r[f"ckpt/{name}/{what}"]
                assert err <= tol, f"{name}, world {world} rank {rank}, {what}: {err:.3g} (bound {tol:.3g})"
