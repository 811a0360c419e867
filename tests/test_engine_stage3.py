"""Stage 3 (ZeRO-3 / FSDP, guide §9.3, §10): trajectories, collective counts, memory, prefetch.

Every multi-rank check of one world size runs in ONE spawned gloo group (``_scenarios``), which
returns plain numbers; the assertions here compare them with independent references:

- a single-process, full-batch run of the same model and data (plain ``torch.optim.AdamW``) —
  data parallelism with mean reduction is mathematically that run (guide §2.2);
- PyTorch's FSDP2 (``fully_shard`` per block + root) in the same spawned group, fp32 and bf16.

The trajectory model has ``bias=False``: with biases, the key projection's bias gets an
analytically zero gradient (softmax is invariant to adding the same value to every logit of a
row), so its computed gradient is rounding noise of order 1e-10 that Adam's g/√v normalisation
turns into ±lr steps — any change of summation order (one process vs N ranks) moves it by
O(lr). That is a property of the model, not of data parallelism; every other tensor matches
to ~1e-7. The tiny sizes (d_model = 22, vocab 37) make unit sizes not divisible by 3 or 4, so
padding is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _engine_common import ALL_WORLDS, adamw, decay_groups, no_decay_on_norms_and_biases, spawn_once
from zerodp.train.model import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=12, n_layer=3, n_head=2, d_model=22, bias=False)
STEPS = 20
PER_RANK = 2  # samples per rank per micro-batch
# The optimizer: _engine_common.adamw (lr 1e-3, the reason there): the inherent spread of this
# tiny model's trajectory is then ~2e-7, far below the 1e-5 acceptance.
# fp32 trajectory relative error: N ≤ 4 ranks' gradients summed in another order, 20 steps
# (_engine_common.trajectory_tolerance(4, 20) ≈ 1.9e-5).
TRAJ_RTOL = 20 * 2 * 4 * torch.finfo(torch.float32).eps
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7


def _data(step: int, n_samples: int, micro: int = 0):
    g = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    x = torch.randint(0, CFG.vocab_size, (n_samples, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (n_samples, CFG.seq_len), generator=g)
    return x, y


def _model(cfg: GPTConfig = CFG, frozen: tuple[str, ...] = (), seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(cfg)
    for name, p in m.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return m


# ---- the independent reference: one process, the whole batch ---------------------------------
def reference(world: int, steps: int = STEPS, cfg: GPTConfig = CFG, grad_acc: int = 1,
              frozen: tuple[str, ...] = (), groups: bool = False, clip: float | None = None,
              keep_state: dict | None = None):
    m = _model(cfg, frozen)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = adamw(decay_groups(params) if groups else params)
    losses, norms = [], []
    if keep_state is not None:
        keep_state.update(model=m, optimizer=opt)
    for s in range(steps):
        total = 0.0
        for micro in range(grad_acc):
            x, y = _data(s, world * PER_RANK, micro)
            loss = m(x, y) / grad_acc
            loss.backward()
            total += loss.item()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone().numpy() for n, p in m.named_parameters()}, norms


CKPT_STEPS = 3  # checkpoint after this many steps, then continue as many


def reference_checkpoint(world: int) -> dict:
    """The reference's full state after CKPT_STEPS steps, as (name, kind) -> flat array."""
    keep: dict = {}
    reference(world, steps=CKPT_STEPS, keep_state=keep)
    m, opt = keep["model"], keep["optimizer"]
    out = {}
    for n, p in m.named_parameters():
        out[(n, "param")] = p.detach().reshape(-1).numpy().copy()
        for kind in ("exp_avg", "exp_avg_sq"):
            out[(n, kind)] = opt.state[p][kind].reshape(-1).numpy().copy()
    return out


# ---- what runs on every rank -----------------------------------------------------------------
def _train(rank, world, engine, steps=STEPS, grad_acc=1, clip=None, start=0, set_to_none=True):
    import torch.distributed as dist

    losses, norms = [], []
    for s in range(start, start + steps):
        total = torch.zeros(1)
        for micro in range(grad_acc):
            x, y = _data(s, world * PER_RANK, micro)
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
            with engine.no_sync(micro < grad_acc - 1):
                loss = engine(x, y) / grad_acc
                loss.backward()
            total += loss.detach()
        if clip is not None:
            norms.append(float(engine.clip_grad_norm_(clip)))
        engine.step()
        engine.zero_grad(set_to_none=set_to_none)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, norms


def _step_comm(engine):
    """Counts and elements sent per rank by the unit collectives of the last completed step."""
    names = {u.label for u in engine.groups}
    out = {"all_gather": 0, "reduce_scatter": 0, "sent_elements": 0.0}
    for e in engine.recorder.step_events():
        kind = e.args.get("kind")
        if kind in ("all_gather", "reduce_scatter") and e.args.get("label") in names:
            out[kind] += 1
            itemsize = 2 if engine.dtypes.param == torch.bfloat16 else 4
            out["sent_elements"] += e.args["sent_bytes"] / itemsize
    return out


def _prefetch_overlaps(engine):
    """For each consecutive pair (i, i+1) of forward units in the last step: was unit i+1's
    AllGather issued before unit i's forward compute ended? (guide §9.3 预取)."""
    events = engine.recorder.step_events()
    order = [e.args["unit"] for e in events if e.name.startswith("forward ") and "unit" in e.args]
    first_ag = {}
    for e in events:
        if e.args.get("kind") == "all_gather":
            first_ag.setdefault(e.args["label"], e)
    fwd_end = {e.args["unit"]: e.end for e in events if e.name.startswith("forward ") and "unit" in e.args}
    return [(a, b, b in first_ag and first_ag[b].start < fwd_end[a]) for a, b in zip(order, order[1:])]


def _state(engine):
    return {k: v.numpy() for k, v in engine.full_state_dict().items()}


def _fsdp2(rank, world, mp_dtype=None, steps=STEPS):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = _model()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=mp_dtype)
    for block in m.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(m, mesh=mesh, mp_policy=policy)
    opt = adamw(m.parameters())

    class Wrap:  # the _train loop's interface
        def __call__(self, x, y):
            return m(x, y)

        def no_sync(self, flag):
            import contextlib
            return contextlib.nullcontext()

        def step(self):
            opt.step()

        def zero_grad(self, set_to_none=True):
            opt.zero_grad(set_to_none=set_to_none)

    losses, _ = _train(rank, world, Wrap(), steps)
    state = {n: p.full_tensor().detach().numpy() for n, p in m.named_parameters()}
    return losses, state


def _engine(model, units=None, groups=False, **options):
    from zerodp.engine.config import EngineConfig
    from zerodp.engine.fsdp import FSDPEngine

    if groups:
        options["param_groups"] = no_decay_on_norms_and_biases
    config = EngineConfig(stage=3, **options)
    return FSDPEngine(model, adamw, config, units=units)


def _scenarios(rank, world, ckpt):
    from zerodp.engine.config import MixedPrecision
    from zerodp.engine.stats import formula_by_kind

    out = {}
    # K: checkpoint pieces. Save ours after CKPT_STEPS; load the *reference's* state into a
    # differently initialised engine and continue (world-size independent pieces).
    eng = _engine(_model())
    _train(rank, world, eng, steps=CKPT_STEPS)
    saved = [(p.name, p.kind, p.start, p.stop, p.tensor.clone().numpy()) for p in eng.checkpoint.state_pieces()]
    fresh = _engine(_model(seed=1))
    fresh.checkpoint.load_scalar_state({"kinds": ["exp_avg", "exp_avg_sq"], "groups": [{"step": float(CKPT_STEPS)}]})
    fresh.checkpoint.load_state_pieces(lambda name, kind, a, b: torch.from_numpy(ckpt[(name, kind)][a:b]))
    losses, _ = _train(rank, world, fresh, steps=CKPT_STEPS, start=CKPT_STEPS)
    out["ckpt"] = dict(saved=saved, scalars=eng.checkpoint.scalar_state(), losses=losses, state=_state(fresh))
    # A/B: fp32 trajectory, counts, peak, trace — prefetch on and off.
    for prefetch in (True, False):
        eng = _engine(_model(), prefetch=prefetch)
        losses, _ = _train(rank, world, eng)
        st = eng.stats()
        with torch.no_grad():  # after step(): the module still runs, gathering unit by unit
            logits = eng.module(_data(99, 2)[0]).numpy()
        still_gathered = sum(u.gathered for u in eng.groups)
        out[f"fp32_prefetch_{prefetch}"] = dict(
            logits=logits, still_gathered=still_gathered,
            losses=losses, state=_state(eng), comm=_step_comm(eng), overlaps=_prefetch_overlaps(eng),
            peak_units=st.peak_gathered_units, units=[(u.name, u.padded_numel) for u in st.units],
            kept=[u.label for u in eng.groups][0], memory=st.memory,
            peak_bytes=st.memory["gathered"], unit_bytes={u.name: u.gathered_bytes for u in st.units},
        )
    # C: FSDP2 fp32 and bf16; D: ours bf16 with the same policy.
    out["fsdp2_fp32"] = _fsdp2(rank, world)
    out["fsdp2_bf16"] = _fsdp2(rank, world, torch.bfloat16)
    eng = _engine(_model(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    out["ours_bf16"] = (_train(rank, world, eng)[0], _state(eng))
    eng = _engine(_model(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32))
    out["ours_bf16_reduce_fp32"] = (_train(rank, world, eng)[0], _state(eng), eng.groups[0].grads.grad_shard.dtype)
    # E: gradient accumulation, both options (guide §5, §9.2).
    for every in (True, False):
        eng = _engine(_model(), reduce_every_microbatch=every)
        losses, _ = _train(rank, world, eng, steps=6, grad_acc=3)
        out[f"acc_every_{every}"] = dict(losses=losses, state=_state(eng), comm=_step_comm(eng))
    # F: one unit = the whole model degenerates to ZeRO-1/2 (guide §10.3).
    m = _model()
    eng = _engine(m, units=[m])
    losses, _ = _train(rank, world, eng, steps=8)
    out["whole"] = dict(losses=losses, state=_state(eng), comm=_step_comm(eng), units=len(eng.groups))
    # G: tied embedding/head in the root unit works; tied across units is refused.
    tied = GPTConfig(**{**CFG.to_dict(), "tie_weights": True})
    eng = _engine(_model(tied))
    out["tied"] = dict(zip(("losses", "state"), (_train(rank, world, eng, steps=8)[0], _state(eng))))
    m = _model(tied)
    try:
        _engine(m, units=[m.tok_emb, *m.blocks])
        out["tied_across_units"] = None
    except ValueError as e:
        out["tied_across_units"] = str(e)
    # H: frozen parameters are gathered but never updated.
    frozen = ("pos_emb.weight", "blocks.0.ln1.weight", "blocks.1.attn.qkv.weight")
    eng = _engine(_model(frozen=frozen))
    out["frozen"] = dict(zip(("losses", "state"), (_train(rank, world, eng, steps=8)[0], _state(eng))))
    # I: param groups (no decay on 1-D) + clipping: a unit mixes groups, the norm spans shards.
    eng = _engine(_model(), groups=True)
    losses, norms = _train(rank, world, eng, steps=8, clip=0.05)
    out["groups_clip"] = dict(losses=losses, norms=norms, state=_state(eng))
    # J: model-state bytes per rank vs the guide's (4+k)Ψ/N, bf16 + AdamW (k = 12).
    for accum in (False, True):
        eng = _engine(_model(GPTConfig(**{**CFG.to_dict(), "bias": True})),
                      mixed_precision=MixedPrecision(fp32_grad_accum=accum))
        _train(rank, world, eng, steps=1, set_to_none=False)  # the gradient shards stay at rest
        st = eng.stats()
        out[f"memory_accum_{accum}"] = dict(
            memory=st.memory, psi=st.num_params, shard=sum(u.shard_numel for u in st.units),
            formula=formula_by_kind(3, st.num_params, world, accum), table=st.table(),
            peak_units=st.peak_gathered_units, unit_bytes={u.name: u.gathered_bytes for u in st.units})
    return out


# ---- assertions -----------------------------------------------------------------------------
def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _assert_traj(got, want, rtol, what):
    (gl, gs), (wl, ws) = got, want
    assert len(gl) == len(wl)
    err = max(abs(a - b) / abs(b) for a, b in zip(gl, wl))
    assert err <= rtol, f"{what}: loss relative error {err:.3g} > {rtol}"
    assert set(gs) == set(ws), f"{what}: parameter names differ: {set(gs) ^ set(ws)}"
    worst = max(ws, key=lambda n: _rel(gs[n], ws[n]))
    assert _rel(gs[worst], ws[worst]) <= rtol, f"{what}: {worst} relative error {_rel(gs[worst], ws[worst]):.3g}"


#: make test: 2 ranks; make fuzz (ZERODP_ALL_WORLDS=1): 2, 3 and 4 (the differential matrix covers
#: stage 3 at every world size 1-4 in make test)
STAGE3_WORLDS = [2, 3, 4] if ALL_WORLDS else [2]


@pytest.fixture(scope="module", params=STAGE3_WORLDS, ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, spawn_once(_scenarios, world, reference_checkpoint(world), timeout=400)


@pytest.mark.dist
def test_fp32_trajectory_equals_single_process_reference(world_results):
    world, res = world_results
    want = reference(world)[:2]
    for prefetch in (True, False):
        r = res[0][f"fp32_prefetch_{prefetch}"]
        _assert_traj((r["losses"], r["state"]), want, TRAJ_RTOL, f"prefetch={prefetch}")
    # The trained module still runs forward through the engine, and frees what it gathered.
    ref = _model()
    ref.load_state_dict({n: torch.from_numpy(v) for n, v in want[1].items()})
    with torch.no_grad():
        want_logits = ref(_data(99, 2)[0]).numpy()
    for prefetch in (True, False):
        r = res[0][f"fp32_prefetch_{prefetch}"]
        assert _rel(r["logits"], want_logits) <= TRAJ_RTOL
        assert r["still_gathered"] == 0
    # Every rank ends with the same parameters.
    for other in res[1:]:
        for n, v in other["fp32_prefetch_True"]["state"].items():
            assert np.array_equal(v, res[0]["fp32_prefetch_True"]["state"][n])


@pytest.mark.dist
def test_fp32_trajectory_equals_fsdp2(world_results):
    world, res = world_results
    ours = res[0]["fp32_prefetch_True"]
    _assert_traj((ours["losses"], ours["state"]), res[0]["fsdp2_fp32"], TRAJ_RTOL, "vs FSDP2 fp32")
    # FSDP2 itself follows the reference (so the comparison above is between two correct runs).
    _assert_traj(res[0]["fsdp2_fp32"], reference(world)[:2], TRAJ_RTOL, "FSDP2 vs reference")


@pytest.mark.dist
def test_bf16_trajectory_matches_fsdp2_within_bf16_rounding(world_results):
    """Same policy (bf16 params and reduction, fp32 master/optimizer). Both runs round every
    matmul and the reduction to bf16 (unit roundoff 2^-9 ≈ 2e-3) but in different places (FSDP2
    casts the fp32 shard before each AllGather, we cast once after the step; reduction
    pre/post-division orders differ), so they cannot agree bit for bit. Tolerance, justified:
    (1) the loss of ours and FSDP2 agree within 1e-2 relative (a few bf16 ulps after 20 steps);
    (2) ours is not further from the fp32 reference than FSDP2 is, up to a factor 2 — i.e. our
    bf16 error is of bf16's size, not a bug's."""
    world, res = world_results
    fp32_l, fp32_s = reference(world)[:2]
    (ol, os_), (fl, fs) = res[0]["ours_bf16"], res[0]["fsdp2_bf16"]
    err_of = lambda l: max(abs(a - b) / abs(b) for a, b in zip(l, fp32_l))  # noqa: E731
    assert max(abs(a - b) / abs(b) for a, b in zip(ol, fl)) <= 2 * BF16_EPS
    assert err_of(ol) <= 2 * err_of(fl) + BF16_EPS / 8, (err_of(ol), err_of(fl))
    ours_p = max(_rel(os_[n], fp32_s[n]) for n in fp32_s)
    theirs_p = max(_rel(fs[n], fp32_s[n]) for n in fp32_s)
    assert ours_p <= 2 * theirs_p + BF16_EPS / 8, (ours_p, theirs_p)
    # Reducing in fp32 (reduce_dtype) keeps an fp32 gradient shard and stays as close.
    rl, rs, grad_dtype = res[0]["ours_bf16_reduce_fp32"]
    assert grad_dtype == torch.float32
    assert err_of(rl) <= 2 * err_of(fl) + BF16_EPS / 8
    assert max(_rel(rs[n], fp32_s[n]) for n in fp32_s) <= 2 * theirs_p + BF16_EPS / 8


@pytest.mark.dist
def test_allgathers_are_2L_minus_1_and_communication_is_3psi(world_results):
    world, res = world_results
    psi = sum(p.numel() for p in _model().parameters())
    for prefetch in (True, False):
        r = res[0][f"fp32_prefetch_{prefetch}"]
        units = dict(r["units"])
        L = len(units)
        assert L == CFG.n_layer + 1  # one unit per block + the root unit
        assert r["comm"]["all_gather"] == 2 * L - 1
        assert r["comm"]["reduce_scatter"] == L
        # Elements sent per rank: forward AG of every unit + backward AG of all but the kept one
        # + RS of every unit, each (N−1)/N of the padded unit (guide §9.3: "合计 3Ψ").
        padded = sum(units.values())
        frac = (world - 1) / world
        exact = (3 * padded - units[r["kept"]]) * frac
        assert r["comm"]["sent_elements"] == pytest.approx(exact, rel=1e-12)
        assert 3 * psi * frac - units[r["kept"]] * frac <= r["comm"]["sent_elements"] <= 3 * padded * frac
        assert padded - psi < world * L  # padding: fewer than N elements per unit


@pytest.mark.dist
def test_peak_gathered_units_and_prefetch_in_trace(world_results):
    world, res = world_results
    on, off = res[0]["fp32_prefetch_True"], res[0]["fp32_prefetch_False"]
    assert on["peak_units"] <= 2 + 1  # in use + prefetched, plus the kept last unit
    assert on["peak_units"] == 3  # prefetch really holds a second unit while the first computes
    assert off["peak_units"] <= 1 + 1
    # Peak bytes are the storages of the units that were gathered together.
    assert on["peak_bytes"] <= sum(sorted(on["unit_bytes"].values())[-3:])
    assert on["peak_bytes"] >= max(on["unit_bytes"].values())
    # Prefetch on: unit i+1's AllGather was issued before unit i's forward compute ended.
    assert on["overlaps"] and all(ok for _, _, ok in on["overlaps"]), on["overlaps"]
    # Prefetch off: between blocks it is not (the check can fail).
    blocks = [ok for a, b, ok in off["overlaps"] if a != "root"]
    assert blocks and not any(blocks), off["overlaps"]


@pytest.mark.dist
def test_gradient_accumulation_both_options(world_results):
    world, res = world_results
    want = reference(world, steps=6, grad_acc=3)[:2]
    L = CFG.n_layer + 1
    for every, rs_per_step in ((True, 3 * L), (False, L)):
        r = res[0][f"acc_every_{every}"]
        _assert_traj((r["losses"], r["state"]), want, TRAJ_RTOL, f"reduce_every_microbatch={every}")
        assert r["comm"]["reduce_scatter"] == rs_per_step
        assert r["comm"]["all_gather"] == 3 * (2 * L - 1)  # ZeRO-3 regathers every micro-batch


@pytest.mark.dist
def test_whole_model_unit_is_zero12(world_results):
    world, res = world_results
    r = res[0]["whole"]
    _assert_traj((r["losses"], r["state"]), reference(world, steps=8)[:2], TRAJ_RTOL, "units=[model]")
    assert r["units"] == 1
    assert r["comm"]["all_gather"] == 1 and r["comm"]["reduce_scatter"] == 1  # guide §10.3


@pytest.mark.dist
def test_tied_and_frozen_parameters(world_results):
    world, res = world_results
    tied = GPTConfig(**{**CFG.to_dict(), "tie_weights": True})
    r = res[0]["tied"]
    want = reference(world, steps=8, cfg=tied)[:2]
    assert "head.weight" not in r["state"]  # one parameter, one slot
    _assert_traj((r["losses"], r["state"]), want, TRAJ_RTOL, "tied")
    msg = res[0]["tied_across_units"]
    assert msg is not None and "tok_emb.weight" in msg and "head.weight" in msg and "same unit" in msg
    frozen = ("pos_emb.weight", "blocks.0.ln1.weight", "blocks.1.attn.qkv.weight")
    r = res[0]["frozen"]
    _assert_traj((r["losses"], r["state"]), reference(world, steps=8, frozen=frozen)[:2], TRAJ_RTOL, "frozen")
    init = {n: p.detach().numpy() for n, p in _model().named_parameters()}
    for n in frozen:
        assert np.array_equal(r["state"][n], init[n])


@pytest.mark.dist
def test_param_groups_and_clipping(world_results):
    world, res = world_results
    losses, state, norms = reference(world, steps=8, groups=True, clip=0.05)
    r = res[0]["groups_clip"]
    _assert_traj((r["losses"], r["state"]), (losses, state), TRAJ_RTOL, "groups + clip")
    assert max(abs(a - b) / b for a, b in zip(r["norms"], norms)) <= TRAJ_RTOL
    assert min(norms) > 0.05  # clipping was active in every step


@pytest.mark.dist
def test_model_state_bytes_match_seed_formula(world_results):
    """(2 + 2 + 12)Ψ/N for bf16 + AdamW, measured from the storages, equal up to padding; the
    gathered units come on top. With fp32 gradient accumulation the guide adds 4Ψ/N to a 2Ψ/N
    bf16 gradient shard; we keep only the fp32 shard (the bf16 ReduceScatter result is an
    in-flight buffer), so grads are 4Ψ/N, 2Ψ/N under the formula."""
    world, res = world_results
    for accum in (False, True):
        r = res[0][f"memory_accum_{accum}"]
        mem, shard, psi = r["memory"], r["shard"], r["psi"]
        print(r["table"])
        assert mem["params"] == 2 * shard
        assert mem["grads"] == (4 if accum else 2) * shard
        assert mem["master"] == 4 * shard
        # Adam m and v for every element this rank updates (padding has none), plus one scalar
        # step count (a 0-dim tensor of 4 or 8 bytes) per optimizer target (one per parameter run;
        # this model has fewer than 64).
        padding = shard * world - psi  # elements; each rank holds at most all of it
        assert 8 * (shard - padding) <= mem["optimizer_states"] <= 8 * shard + 8 * 64
        states = sum(mem[k] for k in ("params", "grads", "master", "optimizer_states"))
        want = r["formula"]["total"] - (2 * psi / world if accum else 0)
        assert abs(states - want) <= 18 * padding + 8 * 64
        assert abs(r["formula"]["total"] - (20 if accum else 16) * psi / world) < 1e-6
        assert mem["gathered"] <= sum(sorted(r["unit_bytes"].values())[-3:])
        assert mem["gathered"] > 0 and r["peak_units"] == 3


@pytest.mark.dist
def test_checkpoint_pieces_save_and_load_at_any_world_size(world_results):
    """state_pieces() of all ranks cover every element of every (parameter, state) exactly once
    and equal the reference's AdamW state; loading the reference's state (world-independent
    pieces) into a differently initialised engine continues the reference trajectory."""
    world, res = world_results
    want = reference_checkpoint(world)
    got = {key: np.full(v.shape, np.nan, dtype=np.float64) for key, v in want.items()}
    for r in res:
        for name, kind, a, b, values in r["ckpt"]["saved"]:
            assert np.isnan(got[(name, kind)][a:b]).all(), f"{name}/{kind}[{a}:{b}] saved twice"
            got[(name, kind)][a:b] = values
    for key, v in want.items():
        assert not np.isnan(got[key]).any(), f"{key} not fully saved"
        assert _rel(got[key], v) <= TRAJ_RTOL, key
    assert res[0]["ckpt"]["scalars"]["groups"][0]["step"] == CKPT_STEPS
    losses, state, _ = reference(world, steps=2 * CKPT_STEPS)
    _assert_traj((res[0]["ckpt"]["losses"], res[0]["ckpt"]["state"]), (losses[CKPT_STEPS:], state),
                 TRAJ_RTOL, "resumed from reference checkpoint")
