"""``bucket_mb="auto"`` in the engine and in ``zerodp train`` (guide §4: the bucket-size sweet spot).

The size is chosen once, at engine construction, by :func:`zerodp.bench.auto.choose_bucket_mb`
from a calibration profile. Checked here: the layers the simulator sees for any ``nn.Module``, the
errors (no profile, no tokens, another world size, a bad value), and on two gloo ranks that the
engine uses exactly the size the planner computes and still trains exactly (gradients and one
step equal a single-process full-batch reference). Profiles are synthetic: α, W and compute are
given, not measured.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp
from _engine_common import (NANO, PER_RANK, gpt_batch, in_make_fuzz, make_gpt, max_rel, norm_rel, shard, spawn_once,
                            worst)
from zerodp.bench import auto
from zerodp.plan import calibrated
from zerodp.plan.calibrated import LayerShape, gpt_layer_shapes
from zerodp.cli import main
from zerodp.engine.config import EngineConfig, module_layer_shapes, resolve_auto_bucket
from zerodp.train.config import TrainConfig

from _profiles import synthetic_profile
from _regret import expected_choice_mib

# α small and W low against the compute: overlap pays, so the sweet spot holds several buckets of
# the test models (a fast network would put the whole model in one bucket).
ALPHA, BANDWIDTH, FLOPS = 1e-6, 3e7, 2e9
TOKENS = PER_RANK * NANO.seq_len  # tokens per rank per micro-batch in the distributed test
LR = 0.1


def _profile(path, world: int = 2, alpha: float = ALPHA, bandwidth: float = BANDWIDTH,
             flops: float = FLOPS) -> str:
    return synthetic_profile(path, alpha, bandwidth, flops, world, model="nano")


class EmbedMLP(nn.Module):
    """A model that is not a GPT: an embedding, a nested MLP with a norm, a frozen scale, a head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 128))
        self.out = nn.Linear(128, 64)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x, y):
        logits = self.out(torch.tanh(self.mlp(self.emb(x)))) * self.scale
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def embed_batch(step: int, world: int, per_rank: int = PER_RANK, seq: int = 16):
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randint(0, 64, (world * per_rank, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


# ---- the simulator's layers of any module ------------------------------------------------------
def test_generic_layer_shapes_one_layer_per_module_owning_trainable_params():
    shapes = module_layer_shapes(EmbedMLP())
    assert shapes == [
        LayerShape("emb", 64 * 32, 0),  # a lookup: no matmul FLOPs
        LayerShape("mlp.0", 32 * 128 + 128, 32 * 128 + 128),
        LayerShape("mlp.1", 2 * 128, 2 * 128),
        LayerShape("mlp.3", 128 * 128 + 128, 128 * 128 + 128),
        LayerShape("out", 128 * 64 + 64, 128 * 64 + 64),
    ]  # the root owns only the frozen `scale`: no layer; GELU owns nothing
    model = EmbedMLP()
    assert sum(s.params for s in shapes) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_generic_layer_shapes_count_a_tied_parameter_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    shapes = module_layer_shapes(Tied())
    # communicated once (at its first owner), multiplied by the head all the same
    assert shapes == [LayerShape("emb", 40, 0), LayerShape("head", 0, 40)]


def test_gpt_module_uses_the_gpt_shapes_and_the_same_choice_as_its_config(tmp_path):
    path = _profile(tmp_path / "p.json")
    model = make_gpt()
    assert auto.layer_shapes(model, TOKENS) == gpt_layer_shapes(NANO, NANO.seq_len)
    assert auto.choose_bucket_mb(path, model, TOKENS) == auto.choose_bucket_mb(path, NANO, TOKENS)
    # a GPT wrapped in another module is just a module
    wrapped = nn.Sequential(model)
    assert auto.layer_shapes(wrapped, TOKENS) == module_layer_shapes(wrapped)


def test_choice_for_a_generic_module_is_in_the_simulated_sweet_spot(tmp_path):
    path = _profile(tmp_path / "p.json")
    sweep = auto.bucket_sweep(path, EmbedMLP(), TOKENS)
    mb = auto.choose_bucket_mb(path, EmbedMLP(), TOKENS)
    assert mb == expected_choice_mib(sweep.points, 1.0, calibrated.ETA_UNCERTAINTY, calibrated.REGRET_TOLERANCE,
                                     calibrated.SWEET_SPOT_SLACK_S)
    total = sum(s.params for s in module_layer_shapes(EmbedMLP())) * 4 / calibrated.MIB
    assert mb < total  # this profile makes overlap pay: more than one bucket


# ---- errors, without a process group -----------------------------------------------------------
def test_auto_without_profile_or_tokens_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"needs a calibration profile: pass profile='profile.json'"):
        EngineConfig(bucket_mb="auto", tokens_per_rank=128)
    with pytest.raises(ValueError, match="needs tokens_per_rank"):
        EngineConfig(bucket_mb="auto", profile="p.json")
    with pytest.raises(ValueError, match="tokens_per_rank must be a positive integer"):
        EngineConfig(stage=2, bucket_mb="auto", profile="p.json", tokens_per_rank=0)
    with pytest.raises(ValueError, match="positive number of MiB, or 'auto'"):
        EngineConfig(bucket_mb="big")
    with pytest.raises(ValueError, match="bucket sizes must be positive"):
        EngineConfig(bucket_mb=0)
    # parallelize checks the options before it needs a process group
    with pytest.raises(ValueError, match="needs a calibration profile"):
        zerodp.parallelize(EmbedMLP(), lambda g: torch.optim.SGD(g, lr=LR), stage=1, bucket_mb="auto")
    # stage 3 has no gradient buckets: "auto" is accepted and ignored, nothing else needed
    assert EngineConfig(stage=3, bucket_mb="auto").bucket_mb == "auto"


def test_profile_of_another_world_size_is_refused(tmp_path):
    path = _profile(tmp_path / "p4.json", world=4)
    with pytest.raises(ValueError, match=r"measured on 4 ranks, but this process group has 2.*--nproc 2"):
        auto.choose_bucket_mb(path, EmbedMLP(), TOKENS, world_size=2)
    assert auto.choose_bucket_mb(path, EmbedMLP(), TOKENS, world_size=4) > 0


def test_resolution_converts_fp32_communication_of_bf16_params(tmp_path):
    path = _profile(tmp_path / "p.json")
    config = EngineConfig(stage=0, bucket_mb="auto", profile=path, tokens_per_rank=TOKENS)
    model = EmbedMLP()
    fp32 = resolve_auto_bucket(config, model, 2, torch.float32, torch.float32)
    assert fp32.bucket_mb == auto.choose_bucket_mb(path, model, TOKENS, grad_bytes_per_param=4)
    assert fp32.first_bucket_mb == min(config.first_bucket_mb, fp32.bucket_mb)
    bf16 = resolve_auto_bucket(config, model, 2, torch.bfloat16, torch.bfloat16)
    assert bf16.bucket_mb == auto.choose_bucket_mb(path, model, TOKENS, grad_bytes_per_param=2)
    # bf16 params, fp32 gradient collectives: the choice is in communicated bytes, the engine
    # counts parameter bytes, so the cap is half as many MiB
    mixed = resolve_auto_bucket(config, model, 2, torch.bfloat16, torch.float32)
    assert mixed.bucket_mb == fp32.bucket_mb / 2
    rs = resolve_auto_bucket(dataclasses.replace(config, stage=2), model, 2, torch.float32, torch.float32)
    assert rs.bucket_mb == auto.choose_bucket_mb(path, model, TOKENS, collective="reduce_scatter")
    numeric = EngineConfig(bucket_mb=3.0)
    assert resolve_auto_bucket(numeric, model, 2, torch.float32, torch.float32) is numeric
    with pytest.raises(ValueError, match="measured on 2 ranks"):
        resolve_auto_bucket(config, model, 3, torch.float32, torch.float32)


def test_train_config_auto_needs_a_profile():
    with pytest.raises(ValueError, match="--bucket-mb auto needs a calibration profile: pass --profile"):
        TrainConfig(bucket_mb="auto")
    with pytest.raises(ValueError, match="positive number of MiB or 'auto'"):
        TrainConfig(bucket_mb=-1.0)
    assert TrainConfig(bucket_mb="auto", profile="p.json").tokens_per_rank == 16 * 128
    TrainConfig(bucket_mb="auto", stage=3)  # ignored at stage 3


# ---- the command line ----------------------------------------------------------------------------
def _cli_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("zerodp train: error: "), err  # no traceback
    return lines[0]


def test_train_bucket_mb_auto_without_profile_is_one_clear_line(capsys, tmp_path):
    line = _cli_error(capsys, ["train", "--bucket-mb", "auto", "--out", str(tmp_path / "r")])
    assert "--bucket-mb auto needs a calibration profile: pass --profile FILE" in line
    assert not (tmp_path / "r").exists()  # refused before any rank started


def test_train_profile_of_another_world_size_is_refused_before_start(capsys, tmp_path):
    path = _profile(tmp_path / "p4.json", world=4)
    line = _cli_error(capsys, ["train", "--bucket-mb", "auto", "--profile", path, "--nproc", "2",
                               "--out", str(tmp_path / "r")])
    assert "measured on 4 ranks" in line and "zerodp calibrate --nproc 2" in line


def test_train_bucket_mb_must_be_a_number_or_auto(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--bucket-mb", "large"])
    assert e.value.code == 2
    assert "expected a number of MiB or 'auto'" in capsys.readouterr().err


# ---- two gloo ranks: the engine uses the planner's size and still trains exactly ------------------
def _sgd(groups):
    return torch.optim.SGD(groups, lr=LR)


def _auto_engines(rank, world, path, other_world_path):
    out = {}
    cases = (("gpt", make_gpt, gpt_batch), ("mlp", EmbedMLP, embed_batch))
    for stage, collective in ((0, "all_reduce"), (2, "reduce_scatter")):
        for kind, make, batch in cases:
            model, ref = make(), make()
            x, y = batch(0, world)
            tokens = PER_RANK * x.shape[1]
            want = auto.choose_bucket_mb(path, ref, tokens, grad_bytes_per_param=4, collective=collective)
            engine = zerodp.parallelize(model, _sgd, stage=stage, bucket_mb="auto", profile=path,
                                        tokens_per_rank=tokens)
            engine(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK)).backward()
            ref(x, y).backward()
            key = f"{kind}/{stage}"
            out[f"{key}/chosen"] = (engine.config.bucket_mb, want, engine.bucket_auto)
            out[f"{key}/buckets"] = len(engine.groups)
            out[f"{key}/first_mb"] = engine.config.first_bucket_mb
            if stage == 0:  # full replicated gradients: compare them directly
                refs = dict(ref.named_parameters())
                out[f"{key}/grad_err"] = worst({n: max_rel(p.grad, refs[n].grad)
                                                for n, p in model.named_parameters() if p.requires_grad})
            engine.step()
            _sgd([p for p in ref.parameters() if p.requires_grad]).step()
            full = engine.full_state_dict()
            out[f"{key}/step_err"] = worst({n: norm_rel(full[n], p) for n, p in ref.named_parameters()
                                            if p.requires_grad})
    # a profile of another world size: every rank refuses before any collective
    try:
        zerodp.parallelize(EmbedMLP(), _sgd, stage=0, bucket_mb="auto", profile=other_world_path,
                           tokens_per_rank=TOKENS)
        out["world_error"] = None
    except ValueError as e:
        out["world_error"] = str(e)
    # stage 3 accepts "auto" and ignores it (no buckets, no profile needed)
    fsdp = zerodp.parallelize(make_gpt(), _sgd, stage=3, bucket_mb="auto")
    out["stage3"] = (fsdp.config.bucket_mb, fsdp.bucket_auto)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    return spawn_once(_auto_engines, 2, _profile(tmp / "p2.json", world=2), _profile(tmp / "p4.json", world=4),
                      timeout=300)


@pytest.mark.dist
@pytest.mark.parametrize("key", ["gpt/0", "mlp/0", "gpt/2", "mlp/2"])
def test_engine_uses_the_planner_size_and_equals_the_full_batch(two_ranks, key):
    for r in two_ranks:
        got, want, flagged = r[f"{key}/chosen"]
        assert got == want and flagged, (got, want)
        assert r[f"{key}/buckets"] > 1  # the choice made a difference: more than one bucket
        assert r[f"{key}/first_mb"] <= got
        if f"{key}/grad_err" in r:
            name, err = r[f"{key}/grad_err"]
            assert err <= 1e-6, f"{name}: gradient off by {err:.2e}"
        name, err = r[f"{key}/step_err"]
        assert err <= 1e-6, f"{name}: ‖ours − full batch‖/‖full batch‖ = {err:.2e} after one step"


@pytest.mark.dist
def test_engine_refuses_a_profile_of_another_world_size_and_stage3_ignores_auto(two_ranks):
    for r in two_ranks:
        assert r["world_error"] and "measured on 4 ranks, but this process group has 2" in r["world_error"]
        assert r["stage3"] == ("auto", False)


# ---- end to end: zerodp train --bucket-mb auto --------------------------------------------------
@in_make_fuzz("the engine and the train config resolve auto (the tests above)")
@pytest.mark.dist
def test_train_with_bucket_mb_auto_shows_the_chosen_size(tmp_path):
    import subprocess
    import sys

    path = _profile(tmp_path / "p.json")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "zerodp.cli", "train", "--preset", "nano", "--seq-len", "32",
           "--global-batch-tokens", "256", "--micro-batch", "4", "--steps", "2", "--eval-every", "0",
           "--eval-batches", "1", "--stage", "0", "--bucket-mb", "auto", "--profile", path,
           "--no-progress", "--out", str(run)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    from zerodp.train.model import PRESETS

    mc = dataclasses.replace(PRESETS["nano"], seq_len=32)
    want = auto.choose_bucket_mb(path, mc, 4 * 32, world_size=2)
    assert f"bucket {want:.3g} MiB (auto)" in r.stdout
    report = json.loads((run / "report.json").read_text())
    assert report["bucket_mb"] == want and report["bucket_auto"] is True
