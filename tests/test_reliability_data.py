"""Issue 9, data: every rank gets the same number of micro-batches per step whatever the data size,
so no rank waits for a collective that the others never issue.

Awkward sizes (fewer windows than one global batch, prime counts, one window) at world sizes 2-4,
for training and validation; then a real run at world 3 on a corpus of 11 windows with a global
batch of 12 sequences, which must simply finish.
"""


import numpy as np
import pytest

from _engine_common import in_make_fuzz, spawn_once
from _train_common import cpu_context
from zerodp.train.config import TrainConfig
from zerodp.train.data import Sharding, TrainStream, Windows, val_batches

SEQ = 4


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n_windows", [1, 2, 3, 7, 13, 101])
def test_every_rank_gets_grad_acc_full_micro_batches_every_step(world, n_windows):
    windows = Windows(np.arange(n_windows * SEQ + 1, dtype=np.uint16), SEQ, "training", "t")
    for mbs, acc in ((1, 1), (2, 3), (3, 2)):
        stream = TrainStream(windows, Sharding(mbs, acc, world), seed=5)
        for step in (0, 1, 2, 7):
            seen = []
            for rank in range(world):
                for micro in range(acc):  # exactly grad_acc micro-batches, each of mbs sequences
                    x, y = stream.micro_batch(step, micro, rank)
                    assert x.shape == y.shape == (mbs, SEQ)
                    seen += list(stream.sharding.sample_ids(step, micro, rank))
            gbs = mbs * acc * world  # the ranks split the step's global batch exactly
            assert sorted(seen) == list(range(step * gbs, (step + 1) * gbs))
            with pytest.raises(IndexError):
                stream.sharding.sample_ids(step, acc, 0)  # and there is no extra micro-batch


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n_windows", [1, 5, 11])
def test_every_rank_gets_the_same_validation_batches_count(world, n_windows):
    windows = Windows(np.arange(n_windows * SEQ + 1, dtype=np.uint16), SEQ, "validation", "t")
    for batches in (1, 3):
        shapes = [[tuple(x.shape) for x, _ in val_batches(windows, 2, batches, r, world)] for r in range(world)]
        assert shapes == [[(2, SEQ)] * batches] * world


def _run(rank, world, root, data):
    from zerodp.train.loop import train

    cfg = TrainConfig(preset="nano", data=data, seq_len=16, global_batch_tokens=192, micro_batch=2,
                      steps=3, eval_every=2, eval_batches=2, ckpt_every=0, progress=False, stage=2,
                      timeout_s=60, out=f"{root}/run")
    out = train(cfg, cpu_context(rank, world))
    return out.get("steps") if rank == 0 else True


@in_make_fuzz("every rank gets full micro-batches of any corpus size (the tests above)")
@pytest.mark.dist
def test_a_corpus_smaller_than_one_global_batch_trains_at_world_3(tmp_path):
    data = tmp_path / "tiny.txt"
    data.write_bytes(b"abcdefghij" * 20)  # 180 training tokens: 11 windows of 16+1; 1 validation window
    results = spawn_once(_run, 3, str(tmp_path), str(data), timeout=240)
    assert results == [3, True, True]
