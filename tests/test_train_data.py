"""Data for the training app: corpora, windows, per-rank sharding and the batch arithmetic of guide §6.1."""

import numpy as np
import pytest

from zerodp.train.config import TrainConfig, plan_batch
from zerodp.train.data import (Sharding, TrainStream, Windows, bundled_text, load_corpus,
                               val_batches)


def test_bundled_corpus_is_python_docs_split_at_the_tail():
    raw = bundled_text()
    assert len(raw) > 100_000 and b"assert" in raw  # real English text shipped with Python
    c = load_corpus()
    assert c.kind == "bytes" and c.vocab_size == 256
    joined = np.concatenate([c.train, c.val]).tobytes()
    assert joined == raw
    assert 0.09 < c.val.size / len(raw) < 0.11


def test_windows_give_next_token_targets():
    tokens = np.arange(50, dtype=np.uint16)
    w = Windows(tokens, seq_len=8, split="training", source="t")
    assert w.count == (50 - 1) // 8
    x, y = w.batch([0, 3])
    assert x.tolist() == [list(range(0, 8)), list(range(24, 32))]
    assert y.tolist() == [list(range(1, 9)), list(range(25, 33))]


def _stream(n_windows, seq=4, mbs=2, acc=3, world=2, seed=7):
    tokens = np.arange(n_windows * seq + 1, dtype=np.uint16)
    w = Windows(tokens, seq, "training", "t")
    assert w.count == n_windows
    return TrainStream(w, Sharding(mbs, acc, world), seed)


def _windows_of_step(stream, step):
    sh = stream.sharding
    per_rank = {r: [stream.window_of(g) for m in range(sh.grad_acc) for g in sh.sample_ids(step, m, r)]
                for r in range(sh.world)}
    return per_rank


@pytest.mark.parametrize("n_windows", [1, 5, 12, 1000])
def test_every_rank_gets_the_same_number_of_micro_batches_whatever_the_data_size(n_windows):
    s = _stream(n_windows)
    for step in range(4):
        per_rank = _windows_of_step(s, step)
        assert {len(v) for v in per_rank.values()} == {s.sharding.micro_batch * s.sharding.grad_acc}
        for r in per_rank:
            for m in range(s.sharding.grad_acc):
                x, y = s.micro_batch(step, m, r)
                assert x.shape == (2, 4) and y.shape == (2, 4)


def test_ranks_read_disjoint_samples_that_cover_the_global_batch():
    s = _stream(1000)
    sh = s.sharding
    for step in range(3):
        ids = sorted(g for r in range(sh.world) for m in range(sh.grad_acc) for g in sh.sample_ids(step, m, r))
        assert ids == list(range(step * sh.global_batch, (step + 1) * sh.global_batch))


def test_each_epoch_visits_every_window_once_in_a_seeded_order():
    s = _stream(12)  # global batch 12 = one epoch per step
    seen = [sorted(w for ws in _windows_of_step(s, step).values() for w in ws) for step in range(3)]
    assert all(ep == list(range(12)) for ep in seen)
    orders = [[s.window_of(g) for g in range(e * 12, e * 12 + 12)] for e in range(3)]
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    other_seed = _stream(12, seed=8)
    assert [other_seed.window_of(g) for g in range(12)] != orders[0]


def test_global_batch_is_the_same_samples_at_any_world_size():
    a = _stream(1000, mbs=2, acc=4, world=2)
    b = _stream(1000, mbs=4, acc=1, world=4)
    for step in range(3):
        wa = sorted(w for ws in _windows_of_step(a, step).values() for w in ws)
        wb = sorted(w for ws in _windows_of_step(b, step).values() for w in ws)
        assert wa == wb


def test_stream_position_is_a_pure_function_of_the_step():
    a, b = _stream(50), _stream(50)
    for _ in range(3):  # a walks through steps; b jumps straight to step 9, as a resume does
        a.micro_batch(_, 0, 0)
    assert a.micro_batch(9, 2, 1)[0].tolist() == b.micro_batch(9, 2, 1)[0].tolist()


def test_validation_batches_are_equal_in_number_on_every_rank():
    w = Windows(np.arange(41, dtype=np.uint16), 4, "validation", "t")  # 10 windows
    for world in (1, 2, 3):
        counts = [len(list(val_batches(w, 2, 3, r, world))) for r in range(world)]
        assert counts == [3] * world


def test_text_and_bin_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes("héllo world, ".encode() * 100)
    c = load_corpus(str(text))
    assert c.kind == "bytes" and np.concatenate([c.train, c.val]).tobytes() == text.read_bytes()

    ids = np.arange(1000, dtype=np.uint16) % 700
    (tmp_path / "train.bin").write_bytes(ids.tobytes())
    (tmp_path / "val.bin").write_bytes(ids[:300].tobytes())
    c = load_corpus(str(tmp_path / "train.bin"))
    assert c.kind == "tokens" and c.vocab_size == 700
    assert c.train.tolist() == ids.tolist() and c.val.tolist() == ids[:300].tolist()
    assert TrainConfig().model_config(c.vocab_size).vocab_size == 700

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd number"):
        load_corpus(str(odd))


def test_missing_data_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.txt does not exist.*--data"):
        load_corpus(str(tmp_path / "nope.txt"))


def test_sequence_longer_than_the_data_is_a_clear_error(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x" * 200)
    c = load_corpus(str(f))
    with pytest.raises(ValueError, match=r"validation split .* fewer than seq_len \+ 1 = 129.*--seq-len"):
        Windows(c.val, 128, "validation", c.name)


def test_batch_arithmetic_matches_the_seed_example():
    # Guide §6.1: 4M tokens at seq 4k → 1024 samples; mbs 2 on 128 GPUs → grad_acc 4; on 512 → 1.
    p = plan_batch(4 * 1024 * 1024, 4096, 2, 128)
    assert (p.global_batch, p.grad_acc) == (1024, 4)
    assert plan_batch(4 * 1024 * 1024, 4096, 2, 512).grad_acc == 1
    assert p.micro_batch * p.grad_acc * p.dp == p.global_batch


@pytest.mark.parametrize("args, message", [
    ((8192, 100, 16, 2), r"not a multiple of --seq-len 100"),
    ((8192, 128, 24, 2), r"64 sequences .* not divisible by --micro-batch 24 × 2 ranks = 48"),
    ((1024, 128, 16, 2), r"grad_acc would be below 1"),
    ((8192, 128, 0, 2), r"--micro-batch must be a positive integer"),
])
def test_batch_errors_say_what_and_how_to_fix(args, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(*args)


def test_unknown_stage_and_preset_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown --stage 5.*0 \(DP\)"):
        TrainConfig(stage=5)
    with pytest.raises(ValueError, match=r"unknown --preset 'huge'"):
        TrainConfig(preset="huge")
