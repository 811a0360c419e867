"""Standard state dicts and DCP interop (zerodp.engine.state_dict, zerodp.engine.dcp).

References are independent of the code under test: a plain single-process copy of the model
(loads the engine's state dict; its logits), torch's own AdamW stepping the whole model on the
whole batch (optimizer states, and training continued after a load at another world size and
stage), PyTorch's DCP tools (``dcp_to_torch_save``) and an FSDP2 model (``fully_shard``) at
another world size. Two spawned groups (world 2, then world 3) run every multi-rank check; the
tests read what they returned. Values are compared with ``torch.testing.assert_close``: exactly
where the same numbers are moved around, with the dtype's default tolerances where a model ran,
and with the summation-order bound of ``_engine_common`` where a distributed gradient differs
from the single-process one.
"""

from __future__ import annotations

import pytest
import torch

import zerodp
from _engine_common import (NANO, PER_RANK, TRAJECTORY, decay_groups, gpt_batch, make_gpt, no_decay_on_norms_and_biases,
                            norm_rel, shard, spawn_once, trajectory_tolerance)

STAGES = (0, 1, 2, 3)
PRECISIONS = (None, "bf16")
LR, WD = 1e-2, 0.1
K, M = 3, 3  # optimizer steps before the checkpoint (world 2), after it (world 3)
FROZEN_NAME = "pos_emb.weight"


def adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WD)


def plain_model(seed: int, tied: bool = False, calib: float = 0.0, **overrides) -> torch.nn.Module:
    """The nano GPT with a frozen parameter and two persistent buffers (fp32 and int64)."""
    model = make_gpt(seed, tie_weights=tied, **overrides)
    model.get_parameter(FROZEN_NAME).requires_grad_(False)
    model.register_buffer("calib", torch.arange(4.0) + calib)
    model.register_buffer("seen", torch.tensor(int(calib)))
    return model


class Scaled(torch.nn.Module):
    """A 0-d parameter (its optimizer states are 0-d too) and a layer no forward uses (the
    optimizer never steps it: it has no state, as in torch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(5, 3)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x):
        return (self.fc(x) * self.scale).square().mean()


SCALED_ROWS = 3  # rows per rank
SCALED_OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),  # state without scalars
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.1),
}


def scaled_batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(world * SCALED_ROWS, 5, generator=torch.Generator().manual_seed(300 + step))


def eval_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(77)
    return torch.randint(0, NANO.vocab_size, (2, NANO.seq_len), generator=g)


def _err(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        return f"{type(e).__name__}: {e}"
    return None


def _train(engine, rank, world, steps, first=0):
    engine.train()
    for step in range(first, first + steps):
        x, y = gpt_batch(step, world)
        engine(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK)).backward()
        engine.step()
        engine.zero_grad()


@torch.no_grad()
def _logits(engine) -> torch.Tensor:
    engine.eval()
    out = engine(eval_tokens())  # in the compute dtype: assert_close then takes that dtype's tolerances
    engine.train()
    return out


def _fsdp2_model(model, group=None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ---- world 2: every stage and precision; the stage-3 checkpoint; FSDP2 writes one ----------------------
def _world2(rank, world, tmp, group):
    """Ranks 0 and 1 of the spawned three, in their own process group ``group``."""
    import torch.distributed.checkpoint as dcp

    from zerodp.engine.dcp import save_dcp

    out = {}
    for stage in STAGES:
        for mp in PRECISIONS:
            engine = zerodp.parallelize(plain_model(0, calib=2.0), adamw, stage=stage, mixed_precision=mp, group=group,
                                        param_groups=no_decay_on_norms_and_biases, bucket_mb=0.06,
                                        first_bucket_mb=0.01)
            _train(engine, rank, world, 2)
            sd = engine.state_dict(cpu_offload=True)
            only = engine.state_dict(rank0_only=True)
            logits = _logits(engine)
            # a plain module's state dict (another seed, other buffers) into a fresh engine
            fresh = zerodp.parallelize(plain_model(1), adamw, stage=stage, mixed_precision=mp, group=group)
            keys = fresh.load_state_dict(plain_model(5, calib=7.0).state_dict())
            out[stage, mp] = dict(sd=sd, logits=logits, only=list(only), keys=tuple(keys),
                                  fresh_sd=fresh.state_dict(cpu_offload=True), fresh_logits=_logits(fresh),
                                  bf16=sorted(k for k, v in engine.state_dict(dtype=torch.bfloat16).items()
                                              if v.dtype == torch.bfloat16))
    for stage in (0, 3):  # tied weights: one parameter under two names
        engine = zerodp.parallelize(plain_model(0, tied=True), adamw, stage=stage, group=group)
        _train(engine, rank, world, 1)
        out["tied", stage] = dict(sd=engine.state_dict(), logits=_logits(engine))

    # other optimizers, a 0-d parameter, a parameter never stepped (stage 3: per-parameter state;
    # stage 0: per-group scalars)
    for opt in SCALED_OPTIMIZERS:
        for stage in (0, 3):
            engine = zerodp.parallelize(Scaled(), SCALED_OPTIMIZERS[opt], stage=stage, group=group,
                                        find_unused_parameters=True)
            for step in range(2):
                engine(shard(scaled_batch(step, world), rank, SCALED_ROWS)).backward()
                engine.step()
                engine.zero_grad()
            out["scaled", opt, stage] = engine.optimizer_state_dict()

    # bad input: every rank raises the same one-line error, nothing hangs
    engine = zerodp.parallelize(plain_model(0), adamw, stage=2, param_groups=no_decay_on_norms_and_biases,
                                group=group)
    good = plain_model(0).state_dict()
    odd = dict(good, extra=torch.zeros(1))
    del odd["ln_f.weight"]
    out["err/keys"] = _err(lambda: engine.load_state_dict(odd))
    out["keys/lenient"] = tuple(engine.load_state_dict(odd, strict=False))
    out["err/shape"] = _err(lambda: engine.load_state_dict(dict(good, **{"head.weight": torch.zeros(3, 3)})))
    _train(engine, rank, world, 1)
    osd = engine.optimizer_state_dict()
    out["err/groups"] = _err(lambda: engine.load_optimizer_state_dict(
        {"state": osd["state"], "param_groups": osd["param_groups"][:1]}))
    swapped = [dict(osd["param_groups"][0], params=osd["param_groups"][1]["params"]),
               dict(osd["param_groups"][1], params=osd["param_groups"][0]["params"])]
    out["err/names"] = _err(lambda: engine.load_optimizer_state_dict({"state": osd["state"], "param_groups": swapped}))
    torch_style = [dict(g, params=list(range(len(g["params"])))) for g in osd["param_groups"]]
    out["err/indices"] = _err(lambda: engine.load_optimizer_state_dict({"state": {}, "param_groups": torch_style}))

    # the checkpoint the world-3 group resumes from: stage 3, two param groups, K steps
    engine = zerodp.parallelize(make_gpt(0, **TRAJECTORY), adamw, stage=3, param_groups=no_decay_on_norms_and_biases,
                                group=group)
    _train(engine, rank, world, K)
    ck = dict(sd=engine.state_dict(cpu_offload=True), osd=engine.optimizer_state_dict(cpu_offload=True))
    out["osd_rank0_only"] = engine.optimizer_state_dict(rank0_only=True)
    if rank == 0:
        torch.save(ck, f"{tmp}/k.pt")
    save_dcp(engine, f"{tmp}/dcp_zerodp")
    out["ck"] = ck

    # FSDP2 trains one step and writes {"model": ..., "step": ...}, as training scripts do
    model = _fsdp2_model(make_gpt(11, **TRAJECTORY), group)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = gpt_batch(99, world)
    model(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK)).backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "step": torch.tensor(1)}, checkpoint_id=f"{tmp}/dcp_fsdp2",
             process_group=group)
    out["fsdp2_full"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank != 0:  # what rank_only left on this rank; rank 0 returns everything else
        return {"only": {k: v["only"] for k, v in out.items() if isinstance(v, dict) and "only" in v},
                "osd_rank0_only": out["osd_rank0_only"]}
    return out


# ---- world 3: resume the world-2 stage-3 checkpoint at stages 0 and 2; FSDP2 reads ours ------------------
def _world3(rank, world, tmp):
    import torch.distributed.checkpoint as dcp

    from zerodp.engine.dcp import load_dcp

    out = {}
    ck = torch.load(f"{tmp}/k.pt")
    for stage in (0, 2):
        engine = zerodp.parallelize(make_gpt(4, **TRAJECTORY), adamw, stage=stage,
                                    param_groups=no_decay_on_norms_and_biases, bucket_mb=0.06, first_bucket_mb=0.01)
        engine.load_state_dict(ck["sd"])
        engine.load_optimizer_state_dict(ck["osd"])
        out[stage, "sd_back"] = engine.state_dict(cpu_offload=True)
        out[stage, "osd_back"] = engine.optimizer_state_dict(cpu_offload=True)
        _train(engine, rank, world, M, first=K)
        out[stage, "sd_after"] = engine.state_dict(cpu_offload=True)
        out[stage, "osd_after"] = engine.optimizer_state_dict(cpu_offload=True)

    model = _fsdp2_model(make_gpt(13, **TRAJECTORY))
    msd = model.state_dict()
    dcp.load(msd, checkpoint_id=f"{tmp}/dcp_zerodp")
    out["fsdp2_loaded"] = {k: v.full_tensor() for k, v in msd.items()}

    for stage in (1, 3):
        engine = zerodp.parallelize(make_gpt(4, **TRAJECTORY), adamw, stage=stage)
        out[stage, "keys_dcp"] = tuple(load_dcp(engine, f"{tmp}/dcp_fsdp2"))
        out[stage, "from_fsdp2"] = engine.state_dict(cpu_offload=True)
    return out


def _both(rank, world, tmp):
    """One spawn (spawning is the expensive part): ranks 0-1 run the world-2 part in a group of
    their own while rank 2 waits, then all three resume from what they wrote."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    w2 = _world2(rank, 2, tmp, pair) if rank < 2 else None
    dist.barrier()
    w3 = _world3(rank, world, tmp)
    return w2, w3 if rank == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(world 2's results, world 3's results, the folder holding the checkpoints they wrote,
    rank 1's results of world 2)."""
    tmp = tmp_path_factory.mktemp("state_dict")
    ranks = spawn_once(_both, 3, str(tmp), timeout=300)
    return ranks[0][0], ranks[0][1], tmp, ranks[1][0]


# ---- single-process references --------------------------------------------------------------------------
def _reference(steps_w2: int, steps_w3: int):
    """torch AdamW on the whole model and the whole batch of every step (no data parallelism)."""
    model = make_gpt(0, **TRAJECTORY)
    opt = torch.optim.AdamW(decay_groups(model), lr=LR, weight_decay=WD)
    schedule = [(s, 2) for s in range(steps_w2)] + [(s, 3) for s in range(steps_w2, steps_w2 + steps_w3)]
    for step, world in schedule:
        x, y = gpt_batch(step, world)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: s for p, s in opt.state.items()}
    return model, opt, state


def _trajectory_tol(world: int, steps: int) -> float:
    # every token's gradient summed in another order (ranks, rows) at each step
    return trajectory_tolerance(world * PER_RANK * NANO.seq_len, steps)


def _assert_state_close(got: dict, ref: dict, tol: float):
    assert sorted(got) == sorted(ref)
    for name, entry in ref.items():
        assert sorted(got[name]) == sorted(entry), name
        torch.testing.assert_close(got[name]["step"], entry["step"], rtol=0, atol=0)
        for kind in ("exp_avg", "exp_avg_sq"):
            assert got[name][kind].shape == entry[kind].shape
            assert norm_rel(got[name][kind], entry[kind]) <= tol, (name, kind, norm_rel(got[name][kind], entry[kind]))


def _assert_equal(got: dict, ref: dict):
    assert list(got) == list(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)


# ---- model state dicts ------------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mp", PRECISIONS)
def test_state_dict_loads_into_a_plain_model_with_the_same_logits(results, stage, mp):
    r = results[0][stage, mp]
    sd = r["sd"]
    plain = plain_model(3)
    assert list(sd) == list(plain.state_dict())  # the model's own names and order, buffers included
    plain.load_state_dict(sd, strict=True)
    assert all(sd[n].dtype == torch.float32 for n, _ in plain.named_parameters())  # fp32 master values
    assert sd["seen"].dtype == torch.int64 and int(sd["seen"]) == 2
    with torch.no_grad():
        ref = plain.to(torch.bfloat16 if mp else torch.float32).eval()(eval_tokens())
    # the same weights in the same compute dtype: assert_close's default tolerances of that dtype
    torch.testing.assert_close(r["logits"], ref)
    assert r["only"] == list(sd) and results[3]["only"][stage, mp] == []  # rank0_only: rank 1 gets {}
    assert r["bf16"] == sorted(k for k, v in sd.items() if v.is_floating_point())


@pytest.mark.dist
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mp", PRECISIONS)
def test_load_state_dict_of_a_plain_model_round_trips(results, stage, mp):
    r = results[0][stage, mp]
    assert r["keys"] == ([], [])
    plain = plain_model(5, calib=7.0)
    expected = plain.state_dict()
    got = r["fresh_sd"]
    assert list(got) == list(expected)
    for k, v in expected.items():
        if mp and k == FROZEN_NAME and stage < 3:  # stages 0-2 keep frozen parameters in bf16 only
            torch.testing.assert_close(got[k].to(torch.bfloat16), v.to(torch.bfloat16), rtol=0, atol=0)
        else:
            torch.testing.assert_close(got[k], v.to(got[k].dtype), rtol=0, atol=0, msg=k)
    with torch.no_grad():
        ref = plain.to(torch.bfloat16 if mp else torch.float32).eval()(eval_tokens())
    torch.testing.assert_close(r["fresh_logits"], ref)


@pytest.mark.dist
@pytest.mark.parametrize("stage", (0, 3))
def test_tied_weights_are_listed_under_both_names_as_module_state_dict_does(results, stage):
    r = results[0]["tied", stage]
    sd = r["sd"]
    assert sd["head.weight"] is sd["tok_emb.weight"]
    plain = plain_model(3, tied=True)
    assert list(sd) == list(plain.state_dict())
    plain.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ref = plain.eval()(eval_tokens())
    torch.testing.assert_close(r["logits"], ref)


@pytest.mark.dist
def test_bad_state_dicts_get_one_line_errors(results):
    r = results[0]
    for key in ("err/keys", "err/shape", "err/groups", "err/names", "err/indices"):
        assert r[key] is not None and "\n" not in r[key], (key, r[key])
    assert "'extra'" in r["err/keys"] and "'ln_f.weight'" in r["err/keys"] and "strict=False" in r["err/keys"]
    assert r["keys/lenient"] == (["ln_f.weight"], ["extra"])
    assert "'head.weight'" in r["err/shape"] and "(3, 3)" in r["err/shape"]
    assert "2 param groups" in r["err/groups"] or "1 param groups" in r["err/groups"]
    assert "param group 0" in r["err/names"]
    assert "optimizer_state_dict()" in r["err/indices"]


# ---- optimizer state dicts ----------------------------------------------------------------------------
@pytest.mark.dist
def test_optimizer_state_dict_equals_torch_adamw_on_one_process(results):
    osd = results[0]["ck"]["osd"]
    model, opt, state = _reference(K, 0)
    _assert_state_close(osd["state"], state, _trajectory_tol(2, K))
    ref_groups = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(osd["param_groups"]) == len(ref_groups)
    for got, ref in zip(osd["param_groups"], ref_groups):
        assert got["params"] == [names[id(p)] for p in ref["params"]]
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in ref.items() if k != "params"}
    assert sorted(results[0]["osd_rank0_only"]["state"]) == sorted(osd["state"])
    assert results[3]["osd_rank0_only"] == {}


@pytest.mark.dist
@pytest.mark.parametrize("stage", (0, 2))
def test_optimizer_state_saved_at_world_2_stage_3_resumes_at_world_3(results, stage):
    ck, r = results[0]["ck"], results[1]
    _assert_equal(r[stage, "sd_back"], ck["sd"])
    back = r[stage, "osd_back"]
    assert back["param_groups"] == ck["osd"]["param_groups"]
    assert sorted(back["state"]) == sorted(ck["osd"]["state"])
    for name, entry in ck["osd"]["state"].items():
        _assert_equal(back["state"][name], entry)
    # continued training equals torch AdamW run without interruption on the same batches
    model, _, state = _reference(K, M)
    tol = _trajectory_tol(3, K + M)
    for name, p in model.named_parameters():
        assert norm_rel(r[stage, "sd_after"][name], p) <= tol, (name, norm_rel(r[stage, "sd_after"][name], p))
    _assert_state_close(r[stage, "osd_after"]["state"], state, tol)


@pytest.mark.dist
@pytest.mark.parametrize("opt", sorted(SCALED_OPTIMIZERS))
@pytest.mark.parametrize("stage", (0, 3))
def test_optimizer_state_dict_of_other_optimizers_and_a_0d_parameter(results, opt, stage):
    model = Scaled()
    torch_opt = SCALED_OPTIMIZERS[opt](model.parameters())
    for step in range(2):
        model(scaled_batch(step, 2)).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    ref = {names[id(p)]: s for p, s in torch_opt.state.items()}
    got = results[0]["scaled", opt, stage]["state"]
    assert sorted(got) == sorted(ref) == ["fc.bias", "fc.weight", "scale"]  # "unused" never stepped
    tol = trajectory_tolerance(2 * SCALED_ROWS, 2)
    for name, entry in ref.items():
        assert sorted(got[name]) == sorted(entry), name
        for kind, value in entry.items():
            assert got[name][kind].shape == value.shape, (name, kind)
            assert norm_rel(got[name][kind], value) <= tol, (name, kind, norm_rel(got[name][kind], value))


# ---- DCP ------------------------------------------------------------------------------------------------
@pytest.mark.dist
def test_save_dcp_converts_to_the_engine_state_dict(results):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = results[2]
    dcp_to_torch_save(tmp / "dcp_zerodp", tmp / "converted.pt")
    plain = torch.load(tmp / "converted.pt")
    sd = results[0]["ck"]["sd"]
    assert sorted(plain) == sorted(sd)
    _assert_equal({k: plain[k] for k in sd}, sd)


@pytest.mark.dist
def test_fsdp2_at_world_3_loads_the_dcp_checkpoint_of_world_2(results):
    _assert_equal(results[1]["fsdp2_loaded"], results[0]["ck"]["sd"])


@pytest.mark.dist
@pytest.mark.parametrize("stage", (1, 3))
def test_load_dcp_reads_what_fsdp2_wrote(results, stage):
    assert results[1][stage, "keys_dcp"] == ([], [])
    _assert_equal(results[1][stage, "from_fsdp2"], results[0]["fsdp2_full"])


def test_export_dcp_without_a_process_group(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from zerodp.engine.dcp import export_dcp, read_keys

    model = plain_model(8, tied=True, calib=1.0)
    export_dcp(model.state_dict(), tmp_path / "ck")
    assert sorted(read_keys(tmp_path / "ck")) == sorted(model.state_dict())
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "plain.pt")
    loaded = torch.load(tmp_path / "plain.pt")
    other = plain_model(9, tied=True)
    other.load_state_dict(loaded, strict=True)
    _assert_equal(other.state_dict(), model.state_dict())


def test_export_dcp_refuses_what_it_cannot_write(tmp_path):
    from zerodp.engine.dcp import export_dcp, load_dcp

    with pytest.raises(TypeError, match="a dict of tensors"):
        export_dcp([torch.zeros(1)], tmp_path / "a")
    with pytest.raises(TypeError, match="every value a tensor"):
        export_dcp({"w": 1.0}, tmp_path / "b")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        export_dcp({"w": torch.zeros(1)}, tmp_path / "file")
    with pytest.raises(TypeError, match="expects an engine"):
        load_dcp({}, tmp_path / "a")
