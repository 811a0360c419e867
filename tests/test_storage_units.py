"""The checkpoint writer's error paths in one process, at every point a filesystem error can hit
rank 0's part of a save (the manifest, the rename, the COMPLETE marker) and when a save replaces a
checkpoint of the same step: the error names the path, nothing of the failed save is left, and
the checkpoints from before are intact. (Multi-rank faults through training: test_storage_faults.py.)
"""

import errno
import os

import pytest
import torch

from zerodp.train import checkpoint as ckpt
from zerodp.train.hooks import NO_HOOKS, Hooks

from _train_common import MODEL, pieces_for, reference_state, save_killed


class FailAt(Hooks):
    """Hooks that make the writer meet ``code`` at filesystem operation ``point``."""

    def __init__(self, point, code):
        self.point, self.code = point, code

    def before_fs(self, point, step, path):
        if point == self.point:
            raise OSError(self.code, os.strerror(self.code), str(path))


def _same(path, seed):
    ck = ckpt.Checkpoint.open(path)  # every file's size and SHA-256
    return all(torch.equal(ck.full(n, k), t) for (n, k), t in reference_state(seed=seed).items())


@pytest.mark.parametrize("point,code", [("mkdir", errno.EACCES), ("shard", errno.ENOSPC),
                                        ("fsync", errno.EIO), ("manifest", errno.ENOSPC),
                                        ("rename", errno.EACCES), ("complete", errno.EIO)])
def test_an_error_at_any_point_of_a_save_leaves_the_previous_checkpoint(tmp_path, point, code):
    root = tmp_path / "checkpoints"
    ckpt.save(pieces_for(reference_state(seed=1), 0, 1), root, 1, {"model": MODEL}, keep=1)
    with pytest.raises(ckpt.CheckpointWriteError) as info:
        ckpt.save(pieces_for(reference_state(seed=2), 0, 1), root, 2, {"model": MODEL}, keep=1,
                  hooks=FailAt(point, code))
    text = str(info.value)
    assert text.startswith("the checkpoint of step 2 was not saved: rank 0 met ")
    assert f"({errno.errorcode[code]})" in text and str(root) in text
    assert text.endswith(f"the previous checkpoint {root / 'step_00000001'} is intact")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # nothing left behind
    assert _same(root / "step_00000001", seed=1)


def test_a_failed_save_of_the_same_step_puts_the_old_one_back(tmp_path):
    """A resumed run that redoes a step saves it again: if that fails after the old checkpoint of
    the step was moved aside, the old one is put back."""
    root = tmp_path / "checkpoints"
    ckpt.save(pieces_for(reference_state(seed=1), 0, 1), root, 3, {"model": MODEL}, keep=2)
    with pytest.raises(ckpt.CheckpointWriteError, match="Input/output error") as info:
        ckpt.save(pieces_for(reference_state(seed=2), 0, 1), root, 3, {"model": MODEL}, keep=2,
                  hooks=FailAt("complete", errno.EIO))
    assert str(info.value).endswith(f"the previous checkpoint {root / 'step_00000003'} is intact")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
    assert _same(root / "step_00000003", seed=1)


def test_without_faults_the_hooks_change_nothing(tmp_path):
    """The default hooks are stateless no-ops, and the writer keeps no hook of its own between saves."""
    assert not vars(NO_HOOKS) and type(NO_HOOKS) is Hooks
    failing = FailAt("shard", errno.ENOSPC)
    with pytest.raises(ckpt.CheckpointWriteError):
        ckpt.save(pieces_for(reference_state(seed=3), 0, 1), tmp_path, 6, {"model": MODEL}, hooks=failing)
    path = ckpt.save(pieces_for(reference_state(seed=4), 0, 1), tmp_path, 7, {"model": MODEL})
    assert _same(path, seed=4)


@pytest.mark.parametrize("phase", ["manifest", "renamed"])
def test_a_save_killed_while_replacing_the_same_step_loses_nothing(tmp_path, phase):
    """A resumed run that redoes a saved step saves it again: the complete checkpoint of that step
    is moved aside first. Killed then, the old checkpoint is still found (under its aside name),
    and the next save puts it back."""
    root = tmp_path / "checkpoints"
    ckpt.save(pieces_for(reference_state(seed=1), 0, 1), root, 3, {"model": MODEL}, keep=2)
    assert save_killed(root, 3, phase, wait_s=120) == 17
    found = ckpt.find(tmp_path, log=lambda m: None)
    assert ckpt.Checkpoint.open(found).step == 3 and _same(found, seed=1)
    ckpt.save(pieces_for(reference_state(seed=4), 0, 1), root, 4, {"model": MODEL}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    assert _same(root / "step_00000003", seed=1) and _same(root / "step_00000004", seed=4)
