"""Hugging Face models (issue #15): the example at 2 ranks against one process, HF export read back
by ``transformers``, sliced HF import at stage 3, and ``zerodp export --format hf / dcp``.

Every multi-rank check runs in ONE spawned gloo group (``_ranks``) that returns plain values; the
assertions here compare them with independent references:

- the example's training (stage 3, one unit per decoder layer, activation checkpointing, fp32 for
  this comparison) against the same model trained in one process on the whole batch with plain
  ``torch.optim.AdamW`` — data parallelism with mean reduction is mathematically that run (guide
  §2.2), so losses and weights differ only by the order in which the ranks' gradients are summed;
- the exported directory loaded by ``transformers.AutoModelForCausalLM.from_pretrained`` against
  the engine's own model on the same input;
- the bytes each rank read at stage 3 against the bytes of the tensors (about half on 2 ranks).

Models are built from a config with random weights; nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from _engine_common import decay_groups, spawn_once, trajectory_tolerance  # noqa: E402
from zerodp.engine.hf import (HFCheckpointError, INDEX_FILE, load_hf_state_dict, open_hf,  # noqa: E402
                              save_hf, shard_file_name)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))  # the spawned ranks inherit sys.path

import hf_causal_lm as ex  # noqa: E402

WORLD = 2
STEPS = 4
ARGV = ["--steps", str(STEPS), "--seq-len", "32", "--micro-batch", "2", "--lr", "1e-3"]
FP32 = ARGV + ["--mixed-precision", "fp32"]
SHARD_BYTES = 40_000  # the tied test model (~200 K fp32 parameters) in several files


def _config(**overrides):
    config = transformers.AutoConfig.from_pretrained(ex.TINY_CONFIG)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def _model(seed: int, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(**overrides))


def _probe(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def _error(fn) -> str:
    try:
        fn()
    except (HFCheckpointError, ValueError) as e:
        return str(e)
    return "no error"


# ---- the spawned group: every multi-rank check, once ---------------------------------------------
def _ranks(rank: int, world: int, tmp: str) -> dict:
    import zerodp
    from zerodp.engine.hf import load_hf

    quiet = lambda m: None  # noqa: E731
    out: dict = {}
    # 1. the example, fp32, saved as a Hugging Face directory
    args = ex.parse_args(FP32 + ["--out", f"{tmp}/trained"])
    result = ex.train(args, rank, world, torch.device("cpu"), log=quiet)
    engine = result["engine"]
    with torch.no_grad():
        out["logits"] = engine(input_ids=_probe(), use_cache=False).logits
    out["losses"] = result["losses"]
    out["state"] = engine.full_state_dict()

    # 2. the example's defaults (bf16 compute) through its main(), continuing from (1) with --checkpoint
    res = ex.main(ARGV[:1] + ["2"] + ARGV[2:] + ["--checkpoint", f"{tmp}/trained"])
    out["bf16_losses"], out["bf16_read"] = res["losses"], res["loaded"].fraction

    # 3. sliced import of a sharded directory at stage 3: each rank reads about its half
    def build(seed, **overrides):
        m = _model(seed, **overrides)
        return zerodp.parallelize(m, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), stage=3,
                                  units=ex.decoder_layers(m))

    engine = build(11, tie_word_embeddings=True)
    load = load_hf(engine, f"{tmp}/sharded")
    out["read"] = (load.bytes_read, load.file_bytes, load.reads)
    out["loaded"] = engine.full_state_dict()
    # ... also into a frozen embedding (kept in the units' shards at stage 3, not the optimizer's)
    m = _model(15, tie_word_embeddings=True)
    m.model.embed_tokens.weight.requires_grad_(False)
    engine = zerodp.parallelize(m, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), stage=3,
                                units=ex.decoder_layers(m))
    out["frozen_read"] = load_hf(engine, f"{tmp}/sharded").fraction
    out["frozen_loaded"] = engine.full_state_dict()

    # ... at stages 0-2: stage 0 reads everything (here with a frozen layer), stages 1-2 their master slice
    out["other_stages"] = {}
    for stage in (0, 1, 2):
        m = _model(16 + stage, tie_word_embeddings=True)
        if stage == 0:
            m.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
        engine = zerodp.parallelize(m, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), stage=stage)
        out["other_stages"][stage] = (load_hf(engine, f"{tmp}/sharded").fraction, engine.full_state_dict())

    # the bundled GPT's `zerodp export --format hf` loads back into a GPT engine (stage 1, tied weights)
    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(21)
    gpt = zerodp.parallelize(GPT(PRESETS["nano"]), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3), stage=1)
    load_hf(gpt, f"{tmp}/gpt-hf")
    out["gpt_loaded"] = gpt.full_state_dict()

    # 4. a directory of another model: one clear line, on every rank, before anything is loaded
    out["wrong_shape"] = _error(lambda: load_hf(build(12, tie_word_embeddings=True, intermediate_size=160),
                                                f"{tmp}/sharded"))
    out["missing"] = _error(lambda: load_hf(build(13, tie_word_embeddings=False), f"{tmp}/sharded"))
    out["empty"] = _error(lambda: load_hf(build(14, tie_word_embeddings=True), f"{tmp}/empty"))
    return out


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    (tmp / "empty").mkdir()
    source = _model(5, tie_word_embeddings=True)
    save_hf(source.state_dict(), tmp / "sharded", max_shard_bytes=SHARD_BYTES)
    from zerodp.train.export import export_hf

    gpt = _gpt_checkpoint(tmp / "gpt-run")
    export_hf(tmp / "gpt-run", tmp / "gpt-hf", log=lambda m: None, native_names=True)
    results = spawn_once(_ranks, WORLD, str(tmp), timeout=240, env={"HF_HUB_OFFLINE": "1"})
    return tmp, source, results, gpt


def _reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The example's model, data and optimizer in one process, on the whole global batch; returns
    the losses, the final weights and the initial ones."""
    args = ex.parse_args(FP32)
    model = ex.build_model(args)
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(decay_groups(model), lr=args.lr, weight_decay=args.weight_decay)
    from zerodp.train.data import Windows, load_corpus

    corpus = load_corpus()
    windows = Windows(corpus.train, args.seq_len, "train", corpus.name)
    losses = []
    for step in range(args.steps):
        x, y = ex.global_batch(step, windows, args.micro_batch * WORLD, args.seed, model.config.vocab_size)
        loss = ex.lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}, init


@pytest.mark.dist
def test_example_at_2_ranks_matches_one_process(group):
    _, _, results, _ = group
    losses, params, init = _reference()
    # Two correct runs differ by the order in which the ranks' gradient sums are taken: a relative
    # 2·N·ε per step, adding up over the steps (tests/_engine_common.py).
    tol = trajectory_tolerance(WORLD, STEPS)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=tol, atol=0)
    # Weights: assert_close's float32 tolerances. Adam divides each element's gradient by its own
    # running magnitude, so where the ranks' gradients nearly cancel, the order of their sum moves
    # that element by more than the gradient's relative error; a wrong gradient moves it by ~lr.
    state = results[0]["state"]
    assert set(params) <= set(state)
    moved = max((ref - init[name]).abs().max().item() for name, ref in params.items())
    assert moved > 100 * 1e-5, moved  # the weights moved far more than the tolerance below
    for name, ref in params.items():
        torch.testing.assert_close(state[name], ref, msg=lambda m: f"{name}: {m}")
    for name in params:  # every rank gathers the same values
        assert torch.equal(results[1]["state"][name], state[name])


@pytest.mark.dist
def test_export_loads_in_transformers_with_the_same_logits(group):
    tmp, _, results, _ = group
    out = tmp / "trained"
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index) == {"metadata", "weight_map"} and index["metadata"]["total_size"] > 0
    assert set(index["weight_map"].values()) == {shard_file_name(1, 1)}
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_probe(), use_cache=False).logits
    for r in results:  # fp32 weights, fp32 compute: assert_close's float32 tolerances
        torch.testing.assert_close(logits, r["logits"])
    # what transformers loaded is what the engine held
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), results[0]["state"][name]), name


@pytest.mark.dist
def test_example_default_bf16_continues_from_the_export(group):
    _, _, results, _ = group
    for r in results:
        assert len(r["bf16_losses"]) == 2 and all(torch.isfinite(torch.tensor(r["bf16_losses"])))
        assert 0.4 < r["bf16_read"] < 0.6, r["bf16_read"]


@pytest.mark.dist
def test_import_reads_only_each_ranks_slices(group):
    tmp, source, results, _ = group
    files = sorted(p.name for p in (tmp / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == shard_file_name(1, len(files))
    index = json.loads((tmp / "sharded" / INDEX_FILE).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved once, as save_pretrained does
    file_bytes = results[0]["read"][1]
    assert file_bytes == 4 * sum(p.numel() for p in source.parameters())
    for r in results:
        read, total, n_reads = r["read"]
        assert total == file_bytes
        # half of every unit, plus at most two partial rows per range read (hidden size 64)
        assert file_bytes / WORLD <= read <= file_bytes / WORLD + n_reads * 2 * 64 * 4, (read, file_bytes)
    assert sum(r["read"][0] for r in results) < 1.1 * file_bytes
    expected = {n: p.detach() for n, p in source.named_parameters()}
    for r in results:
        for name, value in expected.items():
            assert torch.equal(r["loaded"][name], value), name
            assert torch.equal(r["frozen_loaded"][name], value), name
        assert 0.45 < r["frozen_read"] < 0.55, r["frozen_read"]
        for stage, (fraction, loaded) in r["other_stages"].items():
            assert (fraction == 1.0) if stage == 0 else (0.5 <= fraction < 0.55), (stage, fraction)
            for name, value in expected.items():
                assert torch.equal(loaded[name], value), (stage, name)


@pytest.mark.dist
def test_a_directory_of_another_model_is_one_clear_line(group):
    tmp, _, results, _ = group
    for r in results:
        for key in ("wrong_shape", "missing", "empty"):
            assert "\n" not in r[key] and str(tmp) in r[key], r[key]
        assert "shape mismatch" in r["wrong_shape"] and "mlp" in r["wrong_shape"]
        assert "has no tensor for 1 parameter" in r["missing"] and "lm_head.weight" in r["missing"]
        assert "no *.safetensors files" in r["empty"]


def test_bad_directories_single_process(tmp_path):
    assert "does not exist" in _error(lambda: open_hf(tmp_path / "nope"))
    (tmp_path / "f.txt").write_text("x")
    assert "is not a directory" in _error(lambda: open_hf(tmp_path / "f.txt"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    msg = _error(lambda: open_hf(bad))
    assert "cannot be read as safetensors" in msg and "\n" not in msg
    gone = tmp_path / "gone"
    save_hf({"a": torch.ones(3, 4), "b": torch.zeros(5)}, gone, max_shard_bytes=40)
    (gone / shard_file_name(2, 2)).unlink()
    msg = _error(lambda: open_hf(gone))
    assert "is missing but" in msg and INDEX_FILE in msg
    assert "empty state dict" in _error(lambda: save_hf({}, tmp_path / "x"))


def test_save_bf16_tied_and_into_an_existing_directory(tmp_path):
    model = _model(3, tie_word_embeddings=True)
    out = tmp_path / "m"
    save_hf(model.state_dict(), out, dtype=torch.bfloat16, max_shard_bytes=30_000)
    n_before = len(list(out.glob("*.safetensors")))
    (out / "tokenizer.json").write_text("{}")  # kept by a save into the same directory
    save_hf(model.state_dict(), out, dtype=torch.bfloat16, config=model.config.to_dict())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [shard_file_name(1, 1), INDEX_FILE, "config.json", "tokenizer.json"]), n_before
    loaded = load_hf_state_dict(out)
    assert "lm_head.weight" not in loaded
    for name, p in model.named_parameters():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], p.detach().to(torch.bfloat16)), name
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def _gpt_checkpoint(root: Path):
    from zerodp.train import checkpoint as ckpt
    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(3)
    model = GPT(PRESETS["nano"])
    pieces = [type("P", (), dict(name=n, kind="param", start=0, stop=p.numel(), shape=tuple(p.shape),
                                 tensor=p.detach().reshape(-1)))
              for n, p in model.named_parameters()]
    ckpt.save(pieces, root / "checkpoints", 5, {"model": model.cfg.to_dict(), "stage": 0,
                                                "scalars": {"kinds": [], "groups": [{}]}, "data": {"kind": "bytes"}})
    return model


@pytest.mark.dist
def test_gpt_export_loads_back_into_an_engine(group):
    _, _, results, gpt = group
    for r in results:
        for name, p in gpt.named_parameters():
            assert torch.equal(r["gpt_loaded"][name], p.detach()), name


def test_cli_export_hf(tmp_path, capsys):
    from zerodp.cli import main

    model = _gpt_checkpoint(tmp_path / "run")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run"), str(out), "--format", "hf", "--max-shard-mb", "0.05"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["step"] == 5 and index["metadata"]["zerodp_model_config"] == model.cfg.to_dict()
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_hf_state_dict(out)  # under GPT-2's names (test_export_hf.py loads it in transformers)
    from zerodp.train.export import gpt2_state

    expected = gpt2_state({n: p.detach() for n, p in model.named_parameters()}, model.cfg)
    assert set(loaded) == set(expected)
    for name, p in expected.items():
        assert torch.equal(loaded[name], p), name
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf16"), "--format", "hf", "--dtype", "bfloat16"]) == 0
    assert all(t.dtype == torch.bfloat16 for t in load_hf_state_dict(tmp_path / "hf16").values())
    capsys.readouterr()
    # one clear line for options that do not fit the format
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "o.safetensors"), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--dtype applies to --format hf only" in err


def test_cli_export_dcp(tmp_path):
    pytest.importorskip("zerodp.engine.dcp")
    import torch.distributed.checkpoint as dcp

    from zerodp.cli import main

    model = _gpt_checkpoint(tmp_path / "run")
    out = tmp_path / "dcp"
    assert main(["export", str(tmp_path / "run"), str(out), "--format", "dcp"]) == 0
    keys = set(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata)
    assert {n for n, _ in model.named_parameters()} <= keys
