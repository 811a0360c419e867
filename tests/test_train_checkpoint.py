"""Checkpoint files: atomic saves, validation on load, and assembling any range from any ranks' pieces.

These tests exercise the file format with pieces cut by tests/_train_common.py, independently of
the engine: the full state is concatenated in name order and split into ``world`` contiguous
ranges, the way a ZeRO flat buffer is (guide §9). End-to-end tests with the engine are in
test_train_resume.py.
"""

import json
import shutil

import pytest
import torch

from zerodp.engine.master import Piece
from _engine_common import spawn_once
from _train_common import MODEL, pieces_for, reference_state, save_killed
from zerodp.train import checkpoint as ckpt


def _save_world(rank, world, root, step):
    state = reference_state()
    ckpt.save(pieces_for(state, rank, world), root, step, {"model": MODEL, "stage": 3}, keep=5)
    return rank


def _check_full(ck, state):
    for (n, k), t in state.items():
        assert torch.equal(ck.full(n, k), t), (n, k)


def test_single_rank_round_trip(tmp_path):
    state = reference_state()
    path = ckpt.save(pieces_for(state, 0, 1), tmp_path, 3, {"model": MODEL, "stage": 0})
    assert path.name == "step_00000003" and (path / ckpt.COMPLETE).exists()
    ck = ckpt.Checkpoint.open(path)
    assert ck.step == 3 and ck.world_size == 1 and ck.model_config == MODEL
    _check_full(ck, state)
    assert torch.equal(ck.rng(0)[ckpt.RNG_CPU], torch.get_rng_state())


def _corrupt_copy(src, dst, how):
    shutil.copytree(src, dst)
    if how == "missing":
        (dst / ckpt.rank_file(2)).unlink()
    elif how == "truncated":
        f = dst / ckpt.rank_file(1)
        f.write_bytes(f.read_bytes()[:-16])
    elif how == "flipped":
        f = dst / ckpt.rank_file(3)
        b = bytearray(f.read_bytes())
        b[-3] ^= 0xFF
        f.write_bytes(bytes(b))
    elif how == "manifest":
        (dst / ckpt.MANIFEST).write_text("{ not json")
    return dst


@pytest.mark.dist
def test_world4_pieces_assemble_anywhere_and_bad_files_are_named(tmp_path):
    root = tmp_path / "ck"
    spawn_once(_save_world, 4, str(root), 20, timeout=120)
    path = root / "step_00000020"
    ck = ckpt.Checkpoint.open(path)
    assert ck.world_size == 4 and len(ck.manifest["files"]) == 4
    state = reference_state()
    _check_full(ck, state)
    g = torch.Generator().manual_seed(1)
    for (n, k), t in state.items():  # arbitrary ranges cross rank boundaries
        for _ in range(10):
            a, b = sorted(torch.randint(0, t.numel() + 1, (2,), generator=g).tolist())
            assert torch.equal(ck.read(n, k, a, b), t.reshape(-1)[a:b])
    # another world size reads its own shards from these pieces
    for world in (1, 2, 3):
        for r in range(world):
            for p in pieces_for(state, r, world):
                assert torch.equal(ck.read(p.name, p.kind, p.start, p.stop), p.tensor)

    cases = {"missing": r"rank00002\.safetensors is missing.*4 ranks",
             "truncated": r"rank00001\.safetensors has \d+ bytes but the manifest says \d+.*truncated",
             "flipped": r"rank00003\.safetensors fails its SHA-256 check",
             "manifest": r"manifest\.json is not valid JSON"}
    for how, message in cases.items():
        bad = _corrupt_copy(path, tmp_path / how / path.name, how)
        with pytest.raises(ckpt.CheckpointError, match=message):
            ckpt.Checkpoint.open(bad)
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint of another model \(d_model: checkpoint 8, this run 16"):
        ck.check_model({**MODEL, "d_model": 16})
    with pytest.raises(ckpt.CheckpointError, match=r"b\.bias has shape \(7,\), the model has \(8,\)"):
        ck.check_pieces([Piece("b.bias", "param", 0, 8, (8,), torch.zeros(8))])


@pytest.mark.parametrize("phase", ["files", "manifest", "renamed", "complete"])
def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint(tmp_path, phase):
    root = tmp_path / "checkpoints"
    ckpt.save(pieces_for(reference_state(seed=1), 0, 1), root, 1, {"model": MODEL}, keep=1)
    assert save_killed(root, 2, phase, wait_s=60) == 17
    messages = []
    found = ckpt.find(tmp_path, log=messages.append)
    if phase == "complete":  # the new one was complete when it died: it wins, the old is still there
        assert found.name == "step_00000002" and (root / "step_00000001" / ckpt.COMPLETE).exists()
        _check_full(ckpt.Checkpoint.open(found), reference_state(seed=2))
    else:
        assert found.name == "step_00000001"
        _check_full(ckpt.Checkpoint.open(found), reference_state(seed=1))
        assert any("ignoring incomplete checkpoint" in m and "step_00000002" in m for m in messages)
        if phase == "renamed":
            with pytest.raises(ckpt.CheckpointError, match=r"step_00000002 is incomplete"):
                ckpt.find(root / "step_00000002")
    # the next save cleans up the partial one and prunes to `keep`
    ckpt.save(pieces_for(reference_state(seed=3), 0, 1), root, 3, {"model": MODEL}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]


def test_keep_prunes_only_after_the_new_checkpoint_is_complete(tmp_path):
    for step in (1, 2, 3):
        ckpt.save(pieces_for(reference_state(seed=step), 0, 1), tmp_path, step, {"model": MODEL}, keep=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    # saving a step that already exists (a resumed run redoing steps) replaces it whole
    ckpt.save(pieces_for(reference_state(seed=9), 0, 1), tmp_path, 3, {"model": MODEL}, keep=2)
    _check_full(ckpt.Checkpoint.open(tmp_path / "step_00000003"), reference_state(seed=9))


def test_not_a_checkpoint_and_empty_dirs(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.find(tmp_path / "nothing")
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.find(tmp_path)
    d = tmp_path / "step_00000001"
    d.mkdir()
    (d / ckpt.COMPLETE).write_text("")
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json is missing"):
        ckpt.Checkpoint.open(d)
    (d / ckpt.MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ckpt.CheckpointError, match="not a zerodp-checkpoint"):
        ckpt.Checkpoint.open(d)


def test_a_malformed_manifest_is_named(tmp_path):
    path = ckpt.save(pieces_for(reference_state(), 0, 1), tmp_path, 1, {"model": MODEL})
    m = json.loads((path / ckpt.MANIFEST).read_text())
    del m["pieces"][0]["stop"]
    (path / ckpt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json is malformed \(KeyError: 'stop'\)"):
        ckpt.Checkpoint.open(path)
