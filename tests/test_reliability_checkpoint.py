"""Issue 9, checkpoints: what tests/test_train_checkpoint.py and test_train_resume.py do not cover.

Covered there: a truncated, corrupted or missing rank's shard and a broken manifest are refused
naming the file (world 4), another model's manifest names every differing setting, a piece one
rank needs but the checkpoint lacks is applied on no rank, and a single writer killed after each
phase of the save (files, manifest, rename, COMPLETE) leaves the previous checkpoint intact. The
bad-input table (test_reliability_input.py) runs the same refusals through ``zerodp train``.

Here: a shard that breaks *after* validation (deleted between the check and the load) is applied
on no rank — the load reads everything before it writes anything — and a multi-rank save in which
one rank is killed mid-save leaves the previous checkpoint loadable.
"""

import os
from dataclasses import replace

import pytest
import torch

from _engine_common import spawn_once
from zerodp.spawn import RankFailure
from zerodp.train import checkpoint as ckpt
from zerodp.train.config import TrainConfig
from zerodp.train.hooks import Hooks

from _train_common import MODEL, cpu_context, pieces_for, reference_state

pytestmark = pytest.mark.dist

BASE = TrainConfig(preset="nano", seq_len=32, global_batch_tokens=256, micro_batch=4, steps=2,
                   eval_every=0, eval_batches=1, ckpt_every=0, progress=False, stage=2, timeout_s=60)


def _everything(engine):
    params = {k: v.clone() for k, v in engine.full_state_dict().items()}
    pieces = {(p.name, p.kind, p.start): p.tensor.clone() for p in engine.checkpoint.state_pieces()}
    return params, pieces, engine.checkpoint.scalar_state(), torch.get_rng_state()


def _unchanged(a, b):
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
            and a[2] == b[2] and torch.equal(a[3], b[3]))


def _load_after_damage(rank, world, root):
    import torch.distributed as dist

    from zerodp.train.loop import build_engine, load_into, train

    train(replace(BASE, out=f"{root}/good"), cpu_context(rank, world))
    ck = ckpt.Checkpoint.open(ckpt.find(f"{root}/good"))  # validated: sizes and SHA-256 fine
    engine, _ = build_engine(BASE, BASE.model_config(256), cpu_context(rank, world))
    before = _everything(engine)
    dist.barrier()
    if rank == 0:  # now rank 1's shard disappears, between validation and loading
        (ck.path / ckpt.rank_file(1)).unlink()
    dist.barrier()
    try:
        load_into(engine, ck, cpu_context(rank, world))
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    return error, _unchanged(before, _everything(engine))


def test_a_shard_that_breaks_after_validation_is_applied_on_no_rank(tmp_path):
    (err0, same0), (err1, same1) = spawn_once(_load_after_damage, 2, str(tmp_path), timeout=240)
    assert err1 and "rank00001.safetensors" in err1, err1
    assert err0 and "another rank cannot load" in err0 and "nothing was loaded" in err0
    assert same0 and same1, "a rank changed its parameters, optimizer state or RNG before failing"


def _save_twice_and_kill(rank, world, root, victim, phase):
    class DieAt(Hooks):
        def save_phase(self, step, name):
            if rank == victim and name == phase:
                os._exit(17)  # as abrupt as a kill

    ckpt.save(pieces_for(reference_state(seed=1), rank, world), root, 1, {"model": MODEL}, keep=1)
    ckpt.save(pieces_for(reference_state(seed=2), rank, world), root, 2, {"model": MODEL}, keep=1,
              hooks=DieAt())
    return True


def test_a_multi_rank_save_killed_on_one_rank_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 dies after writing its shard, while rank 0 waits to write the manifest. (A single
    writer killed after each later phase is in test_train_checkpoint.py.)"""
    victim, phase = 1, "files"
    root = tmp_path / "checkpoints"
    with pytest.raises(RankFailure, match=f"rank {victim} died with exit code 17"):
        spawn_once(_save_twice_and_kill, 2, str(root), victim, phase, timeout=120, grace=30)
    messages = []
    found = ckpt.find(tmp_path, log=messages.append)
    assert found.name == "step_00000001"
    ck = ckpt.Checkpoint.open(found)
    assert ck.world_size == 2
    for (n, k), t in reference_state(seed=1).items():
        assert torch.equal(ck.full(n, k), t), (n, k)
    assert any("ignoring incomplete checkpoint" in m for m in messages), messages
    # the next save clears what the interrupted one left
    ckpt.save(pieces_for(reference_state(seed=3), 0, 1), root, 3, {"model": MODEL}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
