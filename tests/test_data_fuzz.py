"""Property-based tests of ``zerodp train``'s data loading: whatever file ``--data`` names — empty,
binary, not UTF-8, a ``.bin`` cut short, token ids the model to resume has no embedding for — the
run either starts with every token inside the vocabulary, or ends before any rank starts with one
clear error: a single line that names the file (or the checkpoint), raised as the ValueError that
``zerodp`` prints as ``zerodp train: error: ...``.

The checks run are the launcher's own (``zerodp.train.launch.validate``: load the data, cut the
windows, plan the batch, check the checkpoint to resume) and the training stream's micro-batches.
``make test`` runs the seeded "ci" hypothesis profile; ``make fuzz`` many more examples.
"""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from zerodp.engine.master import Piece
from zerodp.train import checkpoint as ckpt
from zerodp.train.config import TrainConfig
from zerodp.train.data import Sharding, TrainStream
from zerodp.train.launch import validate
from zerodp.train.loop import prepare

pytestmark = pytest.mark.fuzz

WORLD = 2


def _config(data: Path, seq_len: int, resume: str | None = None) -> TrainConfig:
    # micro-batch 1 × grad_acc 2 × 2 ranks: the batch arithmetic never fails, only the data can
    return TrainConfig(preset="nano", data=str(data), seq_len=seq_len, global_batch_tokens=4 * seq_len,
                       micro_batch=1, nproc=WORLD, steps=10, resume=resume)


def _check(cfg: TrainConfig, names: str) -> str:
    """Validate as the launcher does; on success read a few micro-batches. Returns "ok" or the
    error's text, after checking that the error is one clear line naming ``names``."""
    try:
        validate(cfg, WORLD)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        text = str(e)
        assert text and "\n" not in text, f"not one line: {text!r}"
        assert names in text, f"the error does not name {names}: {text}"
        assert len(text) < 600, text
        event("refused with one line")
        return text
    corpus, mc, plan, train_w, val_w = prepare(cfg, WORLD)
    assert corpus.train.size >= 1 and corpus.val.size >= 1
    assert int(max(corpus.train.max(), corpus.val.max())) < mc.vocab_size
    stream = TrainStream(train_w, Sharding(plan.micro_batch, plan.grad_acc, WORLD), cfg.seed)
    for step in (0, 1, 7):
        for rank in range(WORLD):
            x, y = stream.micro_batch(step, plan.grad_acc - 1, rank)
            assert x.shape == y.shape == (plan.micro_batch, cfg.seq_len)
            assert int(x.min()) >= 0 and int(max(x.max(), y.max())) < mc.vocab_size
    x, y = val_w.batch([val_w.count - 1])
    assert x.shape == (1, cfg.seq_len)
    corpus.decode(corpus.train[:50])  # never raises, whatever the bytes
    event("trains")
    return "ok"


# small files (mostly refused: too short) and files long enough to train
CONTENT = st.one_of(st.binary(max_size=64), st.binary(min_size=300, max_size=3000))


@given(content=CONTENT, suffix=st.sampled_from([".txt", "", ".dat", ".bin"]), seq_len=st.integers(1, 24))
def test_any_file_starts_or_fails_with_one_clear_line(content, suffix, seq_len):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"data{suffix}"
        path.write_bytes(content)
        outcome = _check(_config(path, seq_len), str(path))
        if not content:
            assert outcome != "ok"  # an empty file never trains
        if suffix == ".bin" and len(content) % 2:
            assert "an odd number" in outcome  # a truncated token file is named as such


@given(ids=st.one_of(st.lists(st.integers(0, 65535), max_size=40),
                     st.lists(st.integers(0, 65535), min_size=200, max_size=800)), cut=st.integers(0, 3),
       seq_len=st.integers(1, 24))
def test_a_token_file_cut_short_is_refused_as_such(ids, cut, seq_len):
    """A valid uint16 file with its last ``cut`` bytes lost: odd sizes are named as truncated."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokens.bin"
        raw = np.asarray(ids, dtype=np.uint16).tobytes()
        path.write_bytes(raw[: max(0, len(raw) - cut)])
        outcome = _check(_config(path, seq_len), str(path))
        if path.stat().st_size % 2:
            assert "an odd number" in outcome


@given(train=CONTENT, val=CONTENT, seq_len=st.integers(1, 16))
def test_a_train_and_val_pair_names_the_file_at_fault(train, val, seq_len):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "train.bin").write_bytes(train)
        (Path(d) / "val.bin").write_bytes(val)
        outcome = _check(_config(Path(d) / "train.bin", seq_len), d)
        if outcome != "ok" and len(val) % 2 and not len(train) % 2 and train:
            assert "val.bin" in outcome


_SAVED: dict = {}


def _saved_model(vocab: int) -> Path:
    """A checkpoint of a nano model with ``vocab`` token ids (one small tensor is enough: resuming
    is refused before any tensor is read)."""
    if vocab not in _SAVED:
        root = Path(tempfile.mkdtemp(prefix="zerodp-vocab-"))
        model = TrainConfig(preset="nano", seq_len=8).model_config(vocab).to_dict()
        t = torch.zeros(4)
        _SAVED[vocab] = ckpt.save([Piece("w", "param", 0, 4, (4,), t)], root, 1, {"model": model})
    return _SAVED[vocab]


@given(data=st.data(), vocab=st.sampled_from([256, 300, 512]))
def test_tokens_out_of_the_saved_models_vocabulary_are_one_clear_error(data, vocab):
    """A new run sizes its vocabulary from the data; a resumed one must fit the saved model's."""
    top = data.draw(st.integers(2, 700), label="ids below")
    ids = data.draw(st.lists(st.integers(0, top - 1), min_size=100, max_size=200), label="ids")
    saved = _saved_model(vocab)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokens.bin"
        path.write_bytes(np.asarray(ids, dtype=np.uint16).tobytes())
        outcome = _check(_config(path, 8, resume=str(saved)), str(path))
        top = max(ids)
        if top >= vocab:
            assert f"holds token id {top}, outside the vocabulary of the model in {saved} " \
                   f"(ids 0-{vocab - 1})" in outcome, outcome
        else:
            assert "outside the vocabulary" not in outcome
