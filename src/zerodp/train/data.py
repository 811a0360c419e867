"""Token corpora and the deterministic, rank-sharded stream of micro-batches.

Data parallelism gives each rank a different slice of the same global batch (guide §2.1, step 1):
``gbs = mbs × grad_acc × dp`` samples per step (guide §6). This module decides *which* samples.

The corpus is cut into non-overlapping windows of ``seq_len + 1`` tokens (input plus the next-token
target). Every epoch visits all training windows once, in an order drawn from ``(seed, epoch)``.
The global sample stream is the concatenation of those epochs, so sample number ``g`` of the whole
run is a pure function of ``(seed, g)``. Step ``s`` takes samples ``[s·gbs, (s+1)·gbs)``; within the
step, rank ``r`` takes micro-batch ``m`` as the ``mbs`` samples at position ``(m·dp + r)·mbs``.
Consequences (issue 9): every rank always gets exactly ``grad_acc`` micro-batches per step, however
small the corpus (the stream wraps into the next epoch); the data position is just the step number,
so a resume continues exactly; and the global batch of a step is the same set of samples at any
world size, so a run resumed at a different world size sees the same data.

Sources: the bundled corpus (the English documentation topics that ship with Python itself in
``pydoc_data.topics`` — no download), any text file (UTF-8 bytes become tokens 0–255), or a
nanoGPT-style ``.bin`` file of uint16 token ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BUNDLED = "bundled"
BYTE_VOCAB = 256
VAL_FRACTION = 0.1  # the last tenth of the tokens is held out for validation


@dataclass(frozen=True)
class Corpus:
    """A token sequence split into a training part and a validation part."""

    name: str  # "bundled" or the path it came from
    kind: str  # "bytes" (decodable as UTF-8) or "tokens" (ids from some other tokenizer)
    train: np.ndarray  # 1-D integer array
    val: np.ndarray
    vocab_size: int  # smallest vocabulary that holds every token id

    def decode(self, ids) -> str:
        return decode(ids, self.kind)


def decode(ids, kind: str) -> str:
    """Turn token ids back into text: bytes become UTF-8 text, other ids are printed as numbers."""
    ids = [int(i) for i in ids]
    if kind == "bytes":
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")
    return " ".join(str(i) for i in ids)


def bundled_text() -> bytes:
    """Python's own bundled documentation topics (about 0.46 MB of English), as UTF-8 bytes."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; fall back to stdlib docstrings
        import argparse, collections, inspect, json, logging, pathlib, typing  # noqa: E401

        mods = (argparse, collections, inspect, json, logging, pathlib, typing)
        topics = {m.__name__: inspect.getsource(m) for m in mods}
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def load_corpus(path: str | None = None, val_fraction: float = VAL_FRACTION) -> Corpus:
    """Load the bundled corpus (``path`` None or "bundled"), a text file, or a uint16 ``.bin`` file.

    For ``train.bin`` with a ``val.bin`` next to it (nanoGPT's layout) the two are used as given;
    otherwise the last ``val_fraction`` of the tokens is the validation split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if path is None or path == BUNDLED:
        tokens, kind, name = np.frombuffer(bundled_text(), dtype=np.uint8), "bytes", BUNDLED
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"data file {p} does not exist; pass --data with a text file "
                                    "or a uint16 .bin token file, or leave it out for the bundled corpus")
        if p.is_dir():
            raise ValueError(f"--data {p} is a directory; give a text file or a .bin token file")
        name = str(p)
        if p.suffix == ".bin":
            tokens, kind = _read_bin(p), "tokens"
            val_path = p.with_name("val.bin")
            if p.name == "train.bin" and val_path.exists():
                val = _read_bin(val_path)
                return Corpus(name, kind, tokens, val, _vocab(tokens, val, kind))
        else:
            tokens, kind = np.fromfile(p, dtype=np.uint8), "bytes"
    if tokens.size < 2:
        raise ValueError(f"data {name} holds {tokens.size} token{'' if tokens.size == 1 else 's'}; a "
                         "language model needs at least 2 (an input and the next token to predict)")
    n_val = max(1, int(tokens.size * val_fraction))
    train, val = tokens[:-n_val], tokens[-n_val:]
    return Corpus(name, kind, train, val, _vocab(train, val, kind))


def _read_bin(p: Path) -> np.ndarray:
    size = os.path.getsize(p)
    if size % 2:
        raise ValueError(f"{p} has {size} bytes, an odd number: a .bin token file holds uint16 ids "
                         "(2 bytes each); for text, give the file another suffix")
    if size == 0:
        raise ValueError(f"{p} is empty: a .bin token file holds uint16 token ids (2 bytes each)")
    return np.memmap(p, dtype=np.uint16, mode="r")


def _vocab(train: np.ndarray, val: np.ndarray, kind: str) -> int:
    if kind == "bytes":
        return BYTE_VOCAB
    return int(max(train.max(), val.max())) + 1


class Windows:
    """The ``seq_len + 1``-token windows of one split: window ``i`` starts at token ``i·seq_len``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str, source: str):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (tokens.size - 1) // seq_len
        if self.count < 1:
            raise ValueError(
                f"the {split} split of {source} holds {tokens.size} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}: lower --seq-len or give more data")

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each ``[len(indices), seq_len]`` int64."""
        rows = np.stack([np.asarray(self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1])
                         for i in indices]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


@dataclass(frozen=True)
class Sharding:
    """Who reads what: ``gbs = micro_batch × grad_acc × world`` samples per step (guide §6)."""

    micro_batch: int
    grad_acc: int
    world: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_acc * self.world

    def sample_ids(self, step: int, micro: int, rank: int) -> range:
        """Global sample numbers of rank ``rank``'s micro-batch ``micro`` in step ``step``."""
        if not (0 <= micro < self.grad_acc and 0 <= rank < self.world):
            raise IndexError(f"micro {micro} / rank {rank} out of range for {self}")
        first = step * self.global_batch + (micro * self.world + rank) * self.micro_batch
        return range(first, first + self.micro_batch)


class TrainStream:
    """The epoch-by-epoch shuffled stream of training windows (see the module docstring)."""

    def __init__(self, windows: Windows, sharding: Sharding, seed: int):
        self.windows, self.sharding, self.seed = windows, sharding, seed
        self._orders: dict[int, np.ndarray] = {}  # a step spans at most a few epochs

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(self.windows.count, generator=g).numpy()
        return self._orders[epoch]

    def window_of(self, sample: int) -> int:
        epoch, pos = divmod(sample, self.windows.count)
        return int(self._order(epoch)[pos])

    def micro_batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.sharding.sample_ids(step, micro, rank)
        return self.windows.batch([self.window_of(g) for g in ids])

    def epoch_at(self, step: int) -> float:
        """How many passes over the training split the first ``step`` steps made."""
        return step * self.sharding.global_batch / self.windows.count


def val_batches(windows: Windows, micro_batch: int, n_batches: int, rank: int, world: int):
    """Rank ``rank``'s ``n_batches`` validation micro-batches: a fixed, evenly spread set of windows.

    Every rank gets the same number of batches (they run the same collectives); when the split is
    smaller than ``n_batches·micro_batch·world`` windows, windows repeat.
    """
    total = n_batches * micro_batch * world
    spread = np.linspace(0, windows.count, num=total, endpoint=False).astype(np.int64) % windows.count
    for b in range(n_batches):
        first = (b * world + rank) * micro_batch
        yield windows.batch(spread[first: first + micro_batch])
